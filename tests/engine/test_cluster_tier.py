"""The connector core against the real in-cluster tier: the erasure-coded block store on the
shared local Ray cluster. The fetcher process joins that cluster itself (it is given the
cluster's address and the deployment's config, not handles) and reads through the real
client; the scheduler plans with the real ``query_hit`` (a block lease taken) and the worker
saves through the real ``put_blocks``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.engine.scheduler import PagedScheduler
from kvstore.engine.worker import PagedWorker
from kvstore.geometry import GeometryConfig
from kvstore.runtime.cluster import LocalCluster
from kvstore.runtime.deploy import deploy_blockstore
from kvstore.runtime.tiers import ClusterReaderFactory, cluster_tier

GEOMETRY = GeometryConfig()
FINGERPRINT = b"cluster-engine".ljust(32, b"\0")
SHAPE = (16, 2, 128, 64)  # 16 blocks of 64 KiB per layer, two layers


@pytest.fixture(scope="module")
def deployed(ray_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    root: Path = tmp_path_factory.mktemp("gpu-blocks")
    config = BlockStoreConfig(
        data_root=str(root), deployment="gpuengine", node=StorageNodeConfig(fsync="never")
    )
    blocks = deploy_blockstore(config, ray_cluster, start_repair=False)
    try:
        yield config, blocks
    finally:
        blocks.shutdown()


def engine(ray_cluster, config, tier, seed: int | None) -> tuple[PagedScheduler, PagedWorker, list]:
    """One engine's halves over its KV tensors (NaN where it computed nothing)."""
    if seed is None:
        tensors = [torch.full(SHAPE, float("nan")) for _ in range(2)]
    else:
        made = torch.Generator().manual_seed(seed)
        tensors = [torch.randn(SHAPE, generator=made) for _ in range(2)]
    factory = ClusterReaderFactory(ray_cluster.address, config, GEOMETRY)
    worker = PagedWorker(tensors, factory, tier, staging_bytes=16 << 20, layer_timeout_s=120)
    scheduler = PagedScheduler(tier, FINGERPRINT, mode="full-attention", reads_end_leases=False)
    return scheduler, worker, tensors


def step(scheduler: PagedScheduler, worker: PagedWorker) -> None:
    worker.start(scheduler.build())
    for layer in range(2):
        worker.wait_layer(layer)
        worker.save_layer(layer)
    worker.finish_step()


def test_a_second_engine_loads_from_the_real_tier_and_gives_the_lease_back(
    ray_cluster: LocalCluster, deployed
) -> None:
    config, blocks = deployed
    tier = cluster_tier(blocks, None, GEOMETRY, block_bytes=2 * 64 * 1024)
    prompt = [int(t) for t in np.random.default_rng(7).integers(2, 50_000, 4 * 128 + 60)]
    a_sched, a, a_kv = engine(ray_cluster, config, tier, seed=1)
    try:
        assert a_sched.matched_tokens("r", prompt, 0) == 0
        a_sched.allocated("r", [0, 1, 2, 3, 4], 0)
        a_sched.step("r", prompt, len(prompt), table=[0, 1, 2, 3, 4])
        step(a_sched, a)
        assert a.flush(120) and a.stats.blocks_saved == 4 and a.stats.saves_failed == 0
    finally:
        a.close()

    b_sched, b, b_kv = engine(ray_cluster, config, tier, seed=None)
    try:
        assert b_sched.matched_tokens("r", prompt, 0) == 512
        b_sched.allocated("r", [9, 8, 7, 6, 5], 512)
        b_sched.step("r", prompt, len(prompt), table=[9, 8, 7, 6, 5])
        step(b_sched, b)
        assert b.load_errors() == set()
        for mine, theirs in zip([9, 8, 7, 6], [0, 1, 2, 3], strict=True):
            for layer in range(2):
                assert torch.equal(b_kv[layer][mine], a_kv[layer][theirs])
        b_sched.build()  # the next step: the load has run, its lease ends
        assert tier.stats().extra["open_leases"] == 0

        # Planned and dropped before its step: the lease goes back at once.
        assert b_sched.matched_tokens("gone", prompt, 0) == 512
        b_sched.allocated("gone", [10, 11, 12, 13, 14], 512)
        assert tier.stats().extra["open_leases"] == 1
        assert b_sched.finished("gone") is False
        assert tier.stats().extra["open_leases"] == 0
    finally:
        b.close()
