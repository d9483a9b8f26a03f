"""query_hit over both real tiers on a local multi-node Ray cluster: the block store (leases)
and the SWA directory, against hand-computed SPEC §5 plans in both modes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.geometry import GeometryConfig
from kvstore.keys import block_keys
from kvstore.runtime.cluster import LocalCluster
from kvstore.runtime.deploy import BlockStoreHandles, deploy_blockstore
from kvstore.runtime.swa_actors import SWADeployment, deploy_swa
from kvstore.swa.config import SWAConfig
from kvstore.swa.hit import BlockClientLookup

GEOMETRY = GeometryConfig.default()
STATE = GEOMETRY.state_size_to_disk
PROMPT_LEN = 1500  # 11 full blocks; cap 1500 - 134 = 1366 → 10 whole blocks (1280) inside it


def prompt(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100_000, PROMPT_LEN, dtype=np.int64)


@pytest.fixture(scope="module")
def tiers(
    ray_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[BlockStoreHandles, SWADeployment]]:
    root: Path = tmp_path_factory.mktemp("swa-hit-blocks")
    blocks = deploy_blockstore(
        BlockStoreConfig(
            data_root=str(root), deployment="swahitblocks", node=StorageNodeConfig(fsync="never")
        ),
        ray_cluster,
        start_repair=False,
    )
    swa = None
    try:
        swa = deploy_swa(
            {m: ray_cluster.node_id(m) for m in ray_cluster.machines[:3]},
            config=SWAConfig(name="swahit", capacity_bytes=8 * STATE, heartbeat_interval_s=0.5),
            geometry=GEOMETRY,
        )
        yield blocks, swa
    finally:
        if swa is not None:
            swa.shutdown()
        blocks.shutdown()


def test_query_hit_plans_over_the_real_block_store_and_swa_directory(
    ray_cluster: LocalCluster, tiers: tuple[BlockStoreHandles, SWADeployment]
) -> None:
    blocks, swa = tiers
    m0, m1 = ray_cluster.machines[:2]
    block_client = blocks.client()
    swa_client = swa.client(local_machine=m0)
    query = swa_client.hit_query(BlockClientLookup(block_client), GEOMETRY)

    # Prompt A: blocks 0..7 cached (L1 = 1024) and the state at 1024 stored on m1.
    tokens_a = prompt(1)
    keys_a = block_keys(GEOMETRY.fingerprint(), tokens_a)
    assert len(keys_a) == 11
    put = block_client.put_blocks(keys_a[:8], [bytes([i]) * 4096 for i in range(8)])
    assert put.ok and len(put.stored) == 8
    state = np.random.default_rng(2).integers(0, 256, STATE, dtype=np.uint8)
    assert swa_client.put(m1, keys_a[7], 1024, state) is True

    for mode in ("standard", "bounded-replay"):
        result = query.query_hit(keys_a, PROMPT_LEN, mode)
        plan = result.plan
        assert (plan.cap, plan.block_hit_tokens, plan.hit_tokens) == (1366, 1024, 1024)
        assert plan.swa_hit and plan.swa_position == 1024 and plan.swa_location == m1
        assert (plan.replay_tokens, plan.compute_from, plan.store_at) == (0, 1024, 1408)
        assert result.swa_owner is not None and result.swa_owner.machine_id == m1
        assert result.advice is not None and not result.advice.local
        # The block lease covers exactly the 8 leading blocks.
        assert result.leased_blocks == 8 and list(result.lease.keys) == keys_a[:8]
        fetched = swa_client.fetch(result.swa_owner, result.swa_key)
        assert fetched is not None and np.array_equal(fetched.blob, state)
        block_client.release(result.lease)
    # Token ids give the same plan as keys.
    by_tokens = query.query_hit(tokens_a, PROMPT_LEN, "standard")
    assert by_tokens.plan == query.query_hit(keys_a, PROMPT_LEN, "standard").plan
    block_client.release(by_tokens.lease)

    # Prompt B: blocks 0..10 cached (run truncated to the cap: L1 = 1280), no state anywhere.
    tokens_b = prompt(3)
    keys_b = block_keys(GEOMETRY.fingerprint(), tokens_b)
    assert block_client.put_blocks(keys_b, [bytes(4096)] * 11).ok
    standard = query.query_hit(keys_b, PROMPT_LEN, "standard")
    assert (standard.plan.block_hit_tokens, standard.plan.hit_tokens) == (1280, 1152)
    assert not standard.plan.swa_hit and standard.swa_owner is None
    assert standard.leased_blocks == 10  # the 11th block lies beyond the cap: not leased
    bounded = query.query_hit(keys_b, PROMPT_LEN, "bounded-replay")
    assert (bounded.plan.hit_tokens, bounded.plan.replay_start, bounded.plan.replay_tokens) == (
        1280,
        1152,
        128,
    )
    assert bounded.plan.compute_from == 1280
    for result in (standard, bounded):
        block_client.release(result.lease)

    # A state stored locally is preferred and counted as local.
    assert swa_client.put(m0, keys_b[9], 1280, state) is True
    local = query.query_hit(keys_b, PROMPT_LEN, "standard")
    assert local.plan.hit_tokens == 1280 and local.swa_owner is not None
    assert local.swa_owner.machine_id == m0 and local.advice is not None and local.advice.local
    block_client.release(local.lease)

    # Nothing cached: no lease, hit 0, both modes.
    keys_c = block_keys(GEOMETRY.fingerprint(), prompt(4))
    for mode in ("standard", "bounded-replay"):
        empty = query.query_hit(keys_c, PROMPT_LEN, mode)
        assert empty.plan.hit_tokens == 0 and empty.lease is None and empty.leased_blocks == 0
