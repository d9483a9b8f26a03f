"""The Block KVCache tier on a real local Ray cluster: 14 storage node actors (one failure
domain each, own data dir) spread over the session cluster's machines, 2 meta shards, the repair
loop. Actors are killed, restarted and redeployed for real; every read is checked bit-exact."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from kvstore.blockstore.client import BlockStoreClient
from kvstore.blockstore.config import BlockStoreConfig
from kvstore.geometry import GeometryConfig
from kvstore.runtime.cluster import LocalCluster
from kvstore.runtime.deploy import BlockStoreHandles, deploy_blockstore

BLOCK = GeometryConfig.default().block_bytes  # one V4.1-Flash block


class Tier:
    def __init__(self, cluster: LocalCluster, root: Path) -> None:
        self.cluster = cluster
        self.config = BlockStoreConfig(
            storage_nodes=14,
            meta_shards=2,
            data_root=str(root),
            deployment="bs-test",
            dead_after_s=2.0,
            health_interval_s=0.3,
            node_retry_s=1.0,
            call_timeout_s=15.0,
        )
        self.handles = deploy_blockstore(self.config, cluster)
        self.client = self.handles.client()
        self.stored: dict[bytes, np.ndarray] = {}
        self._next = 0

    def put(self, count: int, traffic_class: str = "default") -> list[bytes]:
        keys = [os.urandom(32) for _ in range(count)]
        rng = np.random.default_rng(self._next)
        self._next += 1
        payloads = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in keys]
        result = self.client.put_blocks(keys, payloads, traffic_class)
        assert result.stored == keys, result
        self.stored.update(zip(keys, payloads, strict=True))
        return keys

    def assert_all_exact(self, client: BlockStoreClient | None = None) -> None:
        keys = list(self.stored)
        got = (client or self.client).get_blocks(keys)
        wrong = [
            i
            for i, g in enumerate(got)
            if g is None or g.tobytes() != self.stored[keys[i]].tobytes()
        ]
        assert wrong == [], f"{len(wrong)} of {len(keys)} committed blocks not served bit-exact"

    def placements(self) -> dict[bytes, list[int]]:
        out: dict[bytes, list[int]] = {}
        for meta in self.handles.metas:
            table = ray.get(meta.snapshot_table.remote(), timeout=30)
            for key, placement in zip(
                table.column("key").to_pylist(), table.column("placement").to_pylist(), strict=True
            ):
                out[key] = placement
        return out

    def repair_stats(self) -> dict[str, Any]:
        return ray.get(self.handles.repair.stats.remote(), timeout=30)


@pytest.fixture(scope="module")
def tier(ray_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    made = Tier(ray_cluster, tmp_path_factory.mktemp("blockstore"))
    try:
        yield made
    finally:
        made.handles.shutdown()


def _wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except ray.exceptions.RayError:
            pass  # restarting: ask again
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _restarted(handle: Any, before: str) -> bool:
    """True once the actor answers from a new incarnation (ray.kill is asynchronous)."""
    return bool(ray.get(handle.incarnation.remote(), timeout=5) != before)


def test_put_lookup_get_round_trip_is_bit_exact(tier: Tier) -> None:
    keys = tier.put(64, "agent")
    found = tier.client.lookup(keys + [os.urandom(32)])
    assert found.hit_blocks == 64 and found.lease is not None
    got = tier.client.get_blocks(keys, found.lease)
    assert all(
        g is not None and g.tobytes() == tier.stored[k].tobytes()
        for k, g in zip(keys, got, strict=True)
    )
    tier.client.release(found.lease)
    by_class = [ray.get(m.stored_bytes_by_class.remote(), timeout=30) for m in tier.handles.metas]
    assert sum(c["agent"] for c in by_class) == 64 * BLOCK


def test_three_nodes_down_in_a_stripe_make_only_that_block_a_miss(tier: Tier) -> None:
    keys = tier.put(32)
    ray.get(tier.handles.repair.pause.remote(True), timeout=30)
    placements = tier.placements()
    down = [0, 1, 2]
    lost = {k for k in keys if len(set(placements[k]) & set(down)) >= 3}
    assert lost and len(lost) < len(keys)
    for node in down:
        tier.handles.kill_node(node, restart=False)
    got = tier.client.get_blocks(keys)
    for key, block in zip(keys, got, strict=True):
        if key in lost:
            assert block is None
        else:
            assert block is not None and block.tobytes() == tier.stored[key].tobytes()
    for node in down:  # the machines come back with their disks
        tier.handles.start_node(node)
    ray.get(tier.handles.repair.pause.remote(False), timeout=30)
    time.sleep(tier.config.node_retry_s)
    tier.assert_all_exact()


def test_two_dead_nodes_lose_nothing_and_repair_restores_twelve_healthy_shards(
    tier: Tier,
) -> None:
    tier.put(32)
    dead = [5, 9]
    for node in dead:
        tier.handles.kill_node(node, restart=False)
    tier.assert_all_exact()  # degraded reads, before any repair

    def repaired() -> bool:
        return not any(set(p) & set(dead) for p in tier.placements().values())

    _wait_for(repaired, 90, "repair of the dead nodes' shards")
    for key, placement in tier.placements().items():
        assert len(set(placement)) == 12 and min(placement) >= 0, key
    stats = tier.repair_stats()
    assert set(dead) <= set(stats["dead_nodes"])
    assert stats["shards"] > 0 and stats["bytes"] > 0 and stats["throughput_bytes_per_s"] > 0
    # every block now survives two *more* failures
    other = [n for n in range(12) if n not in dead][:2]
    fresh = tier.handles.client()
    for node in other:
        tier.handles.kill_node(node, restart=True)  # crash; Ray restarts them on their dirs
    tier.assert_all_exact(fresh)
    for node in dead:
        tier.handles.start_node(node)


def test_a_restarted_storage_node_serves_its_shards_again(tier: Tier) -> None:
    # The repair loop may still be moving shards off nodes the previous test restarted (its
    # health view lags a restart); with it running, node 3 can legitimately gain a shard
    # between the two snapshots. Pause it, and wait out a tick in flight (stats takes its lock).
    ray.get(tier.handles.repair.pause.remote(True), timeout=30)
    tier.repair_stats()
    try:
        keys = tier.put(16)
        node = 3
        handle = tier.handles.nodes[node]
        held = ray.get(handle.holds.remote(keys), timeout=30)
        assert any(held)
        before = ray.get(handle.incarnation.remote(), timeout=30)
        tier.handles.kill_node(node, restart=True)
        _wait_for(lambda: _restarted(handle, before), 60, "node restart")
        # Every shard it held it holds again. (Not "exactly those": a put returns once
        # min_write_shards nodes acknowledged, so a commit mark still on its way to a slow node
        # can land after the snapshot above: seen here once, node 3 gaining one committed shard.)
        again = ray.get(handle.holds.remote(keys), timeout=30)
        assert [a for a, b in zip(again, held, strict=True) if b] == [True] * sum(held)
        tier.assert_all_exact()
    finally:
        ray.get(tier.handles.repair.pause.remote(False), timeout=30)


def test_a_restarted_meta_shard_rebuilds_its_index(tier: Tier) -> None:
    keys = tier.put(16, "chatbot")
    before = sorted(tier.placements().items())
    meta = tier.handles.metas[0]
    incarnation = ray.get(meta.incarnation.remote(), timeout=30)
    tier.handles.kill_meta(0, restart=True)
    _wait_for(lambda: _restarted(meta, incarnation), 60, "meta shard restart")
    _wait_for(lambda: ray.get(meta.ready.remote(), timeout=5), 60, "meta shard rebuild")
    stats = ray.get(meta.stats.remote(), timeout=30)
    assert stats["rebuilt_blocks"] == stats["blocks"] > 0
    after = tier.placements()
    assert sorted(after) == sorted(key for key, _ in before)
    moved = 0
    for key, nodes in before:
        # The rebuilt index places every shard; one may differ only where the repair loop of
        # the shared tier moved it meanwhile (it runs throughout), never by losing it.
        assert len(set(after[key])) == 12 and -1 not in after[key]
        moved += sum(a != b for a, b in zip(after[key], nodes, strict=True))
    assert moved <= 2 * len(before)
    assert tier.client.lookup(keys).hit_blocks == len(keys)
    tier.assert_all_exact()


def test_a_writer_killed_before_its_meta_commit_leaves_nothing_visible_until_a_rebuild(
    tier: Tier,
) -> None:
    config = tier.config

    class DyingClient(BlockStoreClient):
        def _commit_in_meta(self, *args: Any, **kwargs: Any) -> Any:
            os._exit(1)  # every shard is written and committed on its node; no index has it

    @ray.remote(num_cpus=0, max_restarts=0)
    class Writer:
        def put(self, keys: list[bytes], payloads: list[np.ndarray]) -> None:
            handles = BlockStoreHandles.from_names(config)
            client = DyingClient(config, handles.fanout(), node_ids=sorted(handles.nodes))
            client.put_blocks(keys, payloads)

    def shards_held() -> list[int]:
        """How many nodes hold a committed shard of each of ``keys``."""
        answers = ray.get([n.holds.remote(keys) for n in tier.handles.nodes.values()], timeout=30)
        return [sum(held) for held in zip(*answers, strict=True)]

    keys = [os.urandom(32) for _ in range(8)]
    payloads = [np.full(BLOCK, i, dtype=np.uint8) for i in range(8)]
    writer = Writer.remote()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(writer.put.remote(keys, payloads), timeout=60)
    assert shards_held() == [12] * 8  # written, in one round, and durable
    assert tier.client.lookup(keys).hit_blocks == 0
    assert tier.client.get_blocks(keys) == [None] * 8
    incarnations = ray.get([m.incarnation.remote() for m in tier.handles.metas], timeout=30)
    for shard in range(config.meta_shards):
        tier.handles.kill_meta(shard, restart=True)
    for meta, old in zip(tier.handles.metas, incarnations, strict=True):
        _wait_for(lambda m=meta, b=old: _restarted(m, b), 60, "meta shard restart")
    tier.handles.wait_ready(60)
    # A rebuild finds each write's 12 durable shards agreeing: whole blocks, their own bytes.
    got = tier.client.get_blocks(keys)
    assert all(
        g is not None and g.tobytes() == p.tobytes() for g, p in zip(got, payloads, strict=True)
    )
    tier.stored.update(zip(keys, payloads, strict=True))
    ray.get([n.reclaim_orphans.remote(0.0) for n in tier.handles.nodes.values()], timeout=60)
    assert shards_held() == [12] * 8  # indexed now: the scrub keeps every one
    tier.assert_all_exact()


def test_a_whole_cluster_restart_loses_no_committed_block(tier: Tier) -> None:
    tier.put(16)
    tier.handles.shutdown()
    tier.handles = deploy_blockstore(tier.config, tier.cluster)
    tier.client = tier.handles.client()
    assert tier.client.lookup(list(tier.stored)).hit_blocks == len(tier.stored)
    tier.assert_all_exact()
