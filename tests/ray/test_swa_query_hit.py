"""query_hit over both real tiers on a local multi-node Ray cluster, through the tier facade: the
block store (leases) and the SWA directory, against hand-computed docs/rules.md §5 plans in both
modes."""

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
from kvstore.runtime.tiers import cluster_tier
from kvstore.swa.config import SWAConfig
from kvstore.tier.records import HitAnswer, HitRequest

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
    tier = cluster_tier(blocks, swa, GEOMETRY, local_machine=m0)  # the one facade

    def query(keys_or_tokens: object, mode: str = "standard", lease: bool = True) -> HitAnswer:
        if isinstance(keys_or_tokens, np.ndarray):
            return tier.query_hit(HitRequest(token_ids=keys_or_tokens, mode=mode, take_lease=lease))
        return tier.query_hit(
            HitRequest(
                block_keys=keys_or_tokens, prompt_len=PROMPT_LEN, mode=mode, take_lease=lease
            )
        )

    # Prompt A: blocks 0..7 cached (L1 = 1024) and the state at 1024 stored on m1.
    tokens_a = prompt(1)
    keys_a = block_keys(GEOMETRY.fingerprint(), tokens_a)
    assert len(keys_a) == 11
    payloads = [bytes([i]) * 4096 for i in range(8)]
    put = tier.put_blocks(keys_a[:8], payloads)
    assert put.stored == 8 and put.committed == 8 and not put.failed_keys
    state = np.random.default_rng(2).integers(0, 256, STATE, dtype=np.uint8)
    assert tier.put_swa_state(keys_a[7], 1024, state.tobytes(), machine=m1) == m1

    for mode in ("standard", "bounded-replay"):
        answer = query(keys_a, mode)
        plan = answer.plan
        assert (plan.cap, plan.block_hit_tokens, plan.hit_tokens) == (1366, 1024, 1024)
        assert plan.swa_hit and plan.swa_position == 1024 and plan.swa_location == m1
        assert (plan.replay_tokens, plan.compute_from, plan.store_at) == (0, 1024, 1408)
        assert answer.swa_owner == m1 and answer.advice in ("fetch", "replay")
        assert answer.fetch_seconds > 0 and answer.replay_seconds > 0
        # The lease covers the 8 leading blocks: a read with it needs no meta round trip.
        assert list(answer.hit_block_keys) == keys_a[:8] and answer.lease_id
        reads = tier.get_blocks(list(answer.hit_block_keys), answer.lease_id)
        assert [read.payload for read in reads] == payloads
        fetched = tier.get_swa_state(keys_a[7], 1024)
        assert fetched.owner == m1 and fetched.state == state.tobytes()
    # Token ids give the same plan as keys.
    by_tokens = query(tokens_a)
    assert by_tokens.plan == query(keys_a, lease=False).plan
    assert tier.release_lease(by_tokens.lease_id or "")

    # Prompt B: blocks 0..10 cached (run truncated to the cap: L1 = 1280), no state anywhere.
    tokens_b = prompt(3)
    keys_b = block_keys(GEOMETRY.fingerprint(), tokens_b)
    assert tier.put_blocks(keys_b, [bytes(4096)] * 11).committed == 11
    standard = query(keys_b, "standard")
    assert (standard.plan.block_hit_tokens, standard.plan.hit_tokens) == (1280, 1152)
    assert not standard.plan.swa_hit and standard.swa_owner is None
    # The engine loads 9 blocks (the 10th is recomputed to rebuild the window).
    assert list(standard.hit_block_keys) == keys_b[:9]
    bounded = query(keys_b, "bounded-replay")
    assert (bounded.plan.hit_tokens, bounded.plan.replay_start, bounded.plan.replay_tokens) == (
        1280,
        1152,
        128,
    )
    assert bounded.plan.compute_from == 1280 and list(bounded.hit_block_keys) == keys_b[:10]
    for answer in (standard, bounded):
        assert tier.release_lease(answer.lease_id or "")

    # A state stored locally is preferred.
    assert tier.put_swa_state(keys_b[9], 1280, state.tobytes(), machine=m0) == m0
    local = query(keys_b, "standard")
    assert local.plan.hit_tokens == 1280 and local.swa_owner == m0
    assert tier.release_lease(local.lease_id or "")

    # Nothing cached: no lease, hit 0, both modes.
    keys_c = block_keys(GEOMETRY.fingerprint(), prompt(4))
    for mode in ("standard", "bounded-replay"):
        empty = query(keys_c, mode)
        assert empty.plan.hit_tokens == 0 and empty.lease_id is None
        assert empty.hit_block_keys == ()
    assert tier.stats().extra["open_leases"] == 0
