"""The engine side against the real in-cluster tier: the erasure-coded block store and the SWA
tier on the shared local Ray cluster. The fetcher process joins that cluster itself (it is given
the cluster's address and the deployments' configs, not handles) and reads through the real
clients; the connector plans with the real ``query_hit`` (block lease + SWA directory) and saves
through the real ``put_blocks`` / SWA ``put``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.geometry import GeometryConfig
from kvstore.gpu.connector import ConnectorConfig, EngineRequest, KVConnector
from kvstore.gpu.kvlayout import KVLayout
from kvstore.gpu.pools import DevicePools
from kvstore.keys import block_keys
from kvstore.runtime.cluster import LocalCluster
from kvstore.runtime.deploy import deploy_blockstore
from kvstore.runtime.swa_actors import deploy_swa
from kvstore.runtime.tiers import ClusterReaderFactory, cluster_tier
from kvstore.swa.config import SWAConfig

GEOMETRY = GeometryConfig(num_state_seqs=2)
KV = KVLayout.from_geometry(GEOMETRY)


@pytest.fixture(scope="module")
def deployed(ray_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    root: Path = tmp_path_factory.mktemp("gpu-blocks")
    config = BlockStoreConfig(
        data_root=str(root), deployment="gpuengine", node=StorageNodeConfig(fsync="never")
    )
    blocks = deploy_blockstore(config, ray_cluster, start_repair=False)
    swa = None
    try:
        swa = deploy_swa(
            {m: ray_cluster.node_id(m) for m in ray_cluster.machines[:3]},
            config=SWAConfig(name="gpuengine", capacity_bytes=8 * KV.state_bytes),
            geometry=GEOMETRY,
        )
        yield config, blocks, swa
    finally:
        if swa is not None:
            swa.shutdown()
        blocks.shutdown()


def test_load_from_the_real_tier_and_save_back(ray_cluster: LocalCluster, deployed) -> None:
    config, blocks, swa = deployed
    m0, m1 = ray_cluster.machines[:2]
    tier = cluster_tier(blocks, swa, GEOMETRY, local_machine=m0)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 50_000, 5 * 128 + 60)  # 700 tokens: cap 566 → L1 = 512
    keys = block_keys(GEOMETRY.fingerprint(), tokens)
    payloads = [rng.integers(0, 256, KV.block_bytes, dtype=np.uint8) for _ in keys[:4]]
    put = tier.put_blocks(keys[:4], [p.tobytes() for p in payloads], "chatbot")
    assert put.committed == 4 and put.failed_keys == ()
    state = rng.integers(0, 256, KV.state_bytes, dtype=np.uint8)
    assert tier.put_swa_state(keys[3], 512, state.tobytes(), machine=m1) == m1

    pools = DevicePools(GEOMETRY, num_blocks=8)
    factory = ClusterReaderFactory(
        ray_cluster.address, config, GEOMETRY, swa.layout(), local_machine=m0
    )
    connector = KVConnector(
        pools,
        reader_factory=factory,
        writer=tier,
        hit_source=tier,
        config=ConnectorConfig(staging_bytes=16 << 20, layer_timeout_s=120),
    )
    try:
        request = EngineRequest("r", tuple(int(t) for t in tokens), traffic_class="chatbot")
        assert connector.get_num_new_matched_tokens(request, 0) == (512, False)
        table = pools.blocks.allocate("r", 6)
        slot = pools.slots.allocate("r")
        connector.update_state_after_alloc(request, table, slot, 512)
        connector.bind_connector_metadata(connector.build_connector_meta())
        connector.start_load_kv()
        for layer in range(GEOMETRY.num_layers):
            connector.wait_for_layer_load(layer)
        connector.wait_for_save()
        assert connector.get_block_ids_with_load_errors() == set()
        for layer in KV.block_layers:
            rows = pools.read_blocks(layer, table[:4]).numpy()
            for row, payload in zip(rows, payloads, strict=True):
                assert np.array_equal(row, KV.block_slice(payload, layer))
        for layer in KV.state_layers:
            assert np.array_equal(pools.swa[layer][slot].numpy(), KV.state_slice(state, layer))
        assert tier.stats().extra["open_leases"] == 0  # given back after the load

        # This engine computes block 4 and saves it through the real block store.
        block_four = rng.integers(0, 256, KV.block_bytes, dtype=np.uint8)
        for layer in KV.block_layers:
            pools.block_kv[layer][table[4]] = pools.block_kv[layer].new_tensor(
                KV.block_slice(block_four, layer)
            )
        connector.schedule_prefill_save(request, table, None)
        connector.bind_connector_metadata(connector.build_connector_meta())
        connector.start_load_kv()
        for layer in range(GEOMETRY.num_layers):
            connector.save_kv_layer(layer)
        connector.wait_for_save()
        pending = connector.request_finished(request, table, slot)
        deadline = time.monotonic() + 120
        while pending and "r" not in connector.get_finished({"r"})[0]:
            assert time.monotonic() < deadline, "the save never finished"
            time.sleep(0.05)
        (result,) = [r for r in connector.save_results if r.request_id == "r"]
        assert result.error is None and result.saved_keys == (keys[4],)
    finally:
        connector.shutdown()
    (read,) = blocks.client().get_blocks([keys[4]])
    assert read is not None and np.array_equal(np.asarray(read), block_four)
