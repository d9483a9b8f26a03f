"""The GC worker over real in-process meta shards and storage nodes (real files), fake clock.

The tier here is the block store's own plain objects (``MetaShard``, ``StorageNode``) behind
its ``LocalFanout``; only the clock is fake (``ManualClock``), moved by days without sleeping.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvstore.blockstore.client import BlockStoreClient
from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.blockstore.fanout import META, NODE, LocalFanout
from kvstore.blockstore.meta import MetaShard
from kvstore.blockstore.node import StorageNode
from kvstore.blockstore.placement import meta_shard_of
from kvstore.clock import ManualClock
from kvstore.gc.config import DAY, GCConfig
from kvstore.gc.worker import GCWorker, ReconcileLoop

T0 = 1_700_000_000.0
PAYLOAD = 2_000


def key(i: int) -> bytes:
    return hashlib.blake2b(b"gc-test-%d" % i, digest_size=32).digest()


def payload(i: int) -> np.ndarray:
    return np.frombuffer(hashlib.shake_256(b"%d" % i).digest(PAYLOAD), dtype=np.uint8)


class Killed(BaseException):
    """Stands for the process dying: not an Exception, so nothing on the way catches it."""


class DyingNode(StorageNode):
    """A storage node whose process dies the first time it is asked to delete shards."""

    armed = False

    def delete(self, keys, not_after=None):  # type: ignore[no-untyped-def]
        if self.armed:
            self.armed = False
            raise Killed("GC worker killed between index removal and shard deletion")
        return super().delete(keys, not_after)


@dataclass
class Tier:
    config: BlockStoreConfig
    clock: ManualClock
    nodes: list[StorageNode]
    metas: list[MetaShard]
    fanout: LocalFanout
    client: BlockStoreClient

    def worker(self, gc: GCConfig | None = None) -> GCWorker:
        return GCWorker(
            gc or GCConfig(),
            self.fanout,
            meta_shards=range(len(self.metas)),
            nodes=range(len(self.nodes)),
            class_names=self.config.traffic_classes,
            clock=self.clock,
            data_shards=self.config.data_shards,
            parity_shards=self.config.parity_shards,
        )

    def put(self, ids: list[int], traffic_class: str = "default") -> None:
        result = self.client.put_blocks(
            [key(i) for i in ids], [payload(i) for i in ids], traffic_class
        )
        assert result.ok and len(result.stored) == len(ids)

    def indexed(self) -> set[bytes]:
        """Keys in the meta shards' indexes, read without touching them (no lookup)."""
        found: set[bytes] = set()
        for meta in self.metas:
            found.update(bytes(k) for k in meta.snapshot_table().column("key").to_pylist())
        return found

    def used(self) -> int:
        """What the GC counts: the live bytes of the nodes' logs."""
        return sum(node.usage()["live_bytes"] for node in self.nodes)

    def capacity(self) -> int:
        return sum(node.usage()["capacity_bytes"] for node in self.nodes)

    def shard_files(self) -> int:
        return sum(node.usage()["shards"] for node in self.nodes)

    def referenced(self, node_id: int):  # type: ignore[no-untyped-def]
        def answer(keys):  # type: ignore[no-untyped-def]
            owners = meta_shard_of(keys, len(self.metas))
            out = [False] * len(keys)
            for shard in set(owners.tolist()):
                positions = [p for p, o in enumerate(owners.tolist()) if o == shard]
                got = self.metas[shard].referenced([keys[p] for p in positions], node_id)
                for p, used in zip(positions, got, strict=True):
                    out[p] = used
            return out

        return answer


def make_tier(root: Path, capacity_per_node: int = 64 * 2**20, node_class=StorageNode) -> Tier:
    clock = ManualClock(T0)
    config = BlockStoreConfig(
        meta_shards=2,
        storage_nodes=12,
        lease_seconds=60.0,
        orphan_grace_s=60.0,
        node=StorageNodeConfig(fsync="never", capacity_bytes=capacity_per_node),
    )
    nodes = [node_class(i, root / f"node{i}", config.node, clock) for i in range(12)]
    metas = [MetaShard(s, config, clock) for s in range(2)]
    targets: dict = {(NODE, n.node_id): n for n in nodes}
    targets.update({(META, m.shard_id): m for m in metas})
    fanout = LocalFanout(targets)
    client = BlockStoreClient(config, fanout, clock=clock)
    return Tier(config, clock, nodes, metas, fanout, client)


@pytest.fixture
def tier(tmp_path: Path) -> Tier:
    return make_tier(tmp_path)


def test_agent_goes_after_3_days_chatbot_after_7_not_before(tier: Tier) -> None:
    tier.put(list(range(0, 10)), "agent")
    tier.put(list(range(10, 20)), "chatbot")
    tier.put(list(range(20, 25)), "default")
    files_before = tier.shard_files()
    worker = tier.worker(GCConfig(ttl={"default": "30d", "agent": "3d", "chatbot": "7d"}))
    agent = {key(i) for i in range(10)}
    chatbot = {key(i) for i in range(10, 20)}

    tier.clock.set(T0 + 3 * DAY - 1)
    report = worker.run_once()
    assert report.expired.total_blocks == 0
    assert len(tier.indexed()) == 25

    tier.clock.set(T0 + 3 * DAY + 1)
    report = worker.run_once()
    assert report.expired.as_dict() == {"agent": {"blocks": 10, "bytes": 10 * PAYLOAD}}
    assert tier.indexed().isdisjoint(agent)
    assert chatbot <= tier.indexed()
    assert tier.shard_files() == files_before - 10 * 12  # every shard of each block deleted
    assert report.shards_deleted == 10 * 12

    tier.clock.set(T0 + 7 * DAY - 1)
    assert worker.run_once().expired.total_blocks == 0
    assert chatbot <= tier.indexed()

    tier.clock.set(T0 + 7 * DAY + 1)
    report = worker.run_once()
    assert report.expired.as_dict() == {"chatbot": {"blocks": 10, "bytes": 10 * PAYLOAD}}
    assert tier.indexed() == {key(i) for i in range(20, 25)}
    # Readers see clean misses, counted as "expired" per class in the meta shard stats.
    assert tier.client.lookup([key(0)], traffic_class="agent").hit_blocks == 0
    misses = [m.stats()["misses"]["agent"]["expired"] for m in tier.metas]
    assert sum(misses) == 1


def test_ttl_counts_from_last_access(tier: Tier) -> None:
    tier.put([1, 2], "agent")
    tier.clock.set(T0 + 2 * DAY)
    hit = tier.client.lookup([key(1)])  # an access restarts block 1's idle clock
    tier.client.release(hit.lease)
    tier.clock.set(T0 + 3 * DAY + 1)
    tier.worker().run_once()
    assert tier.indexed() == {key(1)}
    tier.clock.set(T0 + 5 * DAY + 1)
    tier.worker().run_once()
    assert tier.indexed() == set()


def test_expiry_runs_in_batches_until_done(tier: Tier) -> None:
    tier.put(list(range(23)), "agent")
    tier.clock.set(T0 + 4 * DAY)
    report = tier.worker(GCConfig(delete_batch=4)).run_once()
    assert report.expired.total_blocks == 23
    assert tier.indexed() == set()
    assert tier.shard_files() == 0


def test_leased_block_survives_expiry_until_its_lease_ends(tier: Tier) -> None:
    tier.put([1, 2, 3], "agent")
    meta_of = {k: int(meta_shard_of([key(k)], 2)[0]) for k in (1, 2)}
    # Reader 1 holds block 1 for 5 days; reader 2 holds block 2 for 5 days and lets go early.
    tier.metas[meta_of[1]].lookup([key(1)], lease_seconds=5 * DAY)
    tier.metas[meta_of[2]].lookup([key(2)], lease_seconds=5 * DAY)
    worker = tier.worker()
    tier.clock.set(T0 + 3 * DAY + 1)
    worker.run_once()
    assert tier.indexed() == {key(1), key(2)}
    tier.clock.set(T0 + 4 * DAY)
    tier.metas[meta_of[2]].release([key(2)])
    worker.run_once()
    assert tier.indexed() == {key(1)}
    tier.clock.set(T0 + 5 * DAY + 1)  # block 1's lease ended: it goes on the next pass
    worker.run_once()
    assert tier.indexed() == set()


def per_node_block_bytes(root: Path) -> int:
    """Live bytes one block puts on each node (one shard record: header + shard)."""
    probe = make_tier(root)
    probe.put([10**6])
    used = [node.usage()["live_bytes"] for node in probe.nodes]
    assert len(set(used)) == 1
    return used[0]


def test_past_high_watermark_evicts_exactly_the_lru_down_to_low(tmp_path: Path) -> None:
    unit = per_node_block_bytes(tmp_path / "probe")
    tier = make_tier(tmp_path / "tier", capacity_per_node=100 * unit)  # room for 100 blocks
    ids = list(range(95))
    for i in ids:  # written one second apart
        tier.put([i])
        tier.clock.advance(1)
    # Re-read a shuffled half: the LRU order is now the never-read ones, then by read time.
    rng = np.random.default_rng(3)
    reread = rng.permutation(ids)[:50].tolist()
    for i in reread:
        tier.client.release(tier.client.lookup([key(i)]).lease)
        tier.clock.advance(1)
    lru_order = [i for i in ids if i not in reread] + reread
    # One of the oldest is being read right now: it must survive, the next one goes instead.
    protected = lru_order[3]
    held = tier.client.lookup([key(protected)])
    lru_order.remove(protected)
    lru_order.append(protected)  # the lookup touched it; it is also leased

    assert tier.used() > 0.90 * tier.capacity()
    report = tier.worker().run_once()
    # 95 blocks at 1 % each: evict exactly 15 to reach 80 %.
    expected_gone = {key(i) for i in lru_order[:15]}
    assert report.evicted.total_blocks == 15
    assert tier.indexed() == {key(i) for i in ids} - expected_gone
    assert tier.used() <= 0.80 * tier.capacity()
    assert tier.used() + unit * 12 > 0.80 * tier.capacity()  # not one block more
    assert key(protected) in tier.indexed()
    assert tier.client.get_blocks([key(protected)], held.lease)[0].tobytes() == (
        payload(protected).tobytes()
    )
    tier.client.release(held.lease)
    # Below the high watermark now: a second pass evicts nothing (idempotent).
    assert tier.worker().run_once().evicted.total_blocks == 0
    evicted_misses = sum(m.stats()["misses"]["default"]["evicted"] for m in tier.metas)
    assert tier.client.lookup([key(lru_order[0])]).hit_blocks == 0
    assert sum(m.stats()["misses"]["default"]["evicted"] for m in tier.metas) == (
        evicted_misses + 1
    )


def test_below_high_watermark_nothing_is_evicted(tmp_path: Path) -> None:
    unit = per_node_block_bytes(tmp_path / "probe")
    tier = make_tier(tmp_path / "tier", capacity_per_node=100 * unit)
    tier.put(list(range(90)))
    assert tier.worker().run_once().evicted.total_blocks == 0
    assert len(tier.indexed()) == 90


def test_everything_leased_evicts_nothing_and_does_not_spin(tmp_path: Path) -> None:
    unit = per_node_block_bytes(tmp_path / "probe")
    tier = make_tier(tmp_path / "tier", capacity_per_node=10 * unit)
    tier.put(list(range(10)))
    held = tier.client.lookup([key(i) for i in range(10)])
    assert held.hit_blocks == 10
    report = tier.worker().run_once()
    assert report.evicted.total_blocks == 0
    assert len(tier.indexed()) == 10


def test_worker_killed_between_index_and_shards_leaves_no_half_block(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, node_class=DyingNode)
    tier.put(list(range(6)), "agent")
    tier.put(list(range(6, 9)), "chatbot")
    files_before = tier.shard_files()
    victim = tier.nodes[5]
    assert isinstance(victim, DyingNode)
    victim.armed = True
    tier.clock.set(T0 + 3 * DAY + 1)
    with pytest.raises(Killed):
        tier.worker(GCConfig(delete_batch=2)).run_once()
    # Mid-batch: the blocks of the first batch left the index, the rest not yet. Every block is
    # either indexed and whole, or gone and a clean miss: never part of a block.
    indexed = tier.indexed()
    forgotten = {key(i) for i in range(6)} - indexed
    assert 0 < len(forgotten) < 6
    for i in range(9):
        if key(i) in indexed:
            # (Checked on the nodes: a read through the client would count as an access.)
            assert all(node.holds([key(i)]) == [True] for node in tier.nodes)
        else:
            assert tier.client.lookup([key(i)]).hit_blocks == 0
            assert tier.client.get_blocks([key(i)]) == [None]
    orphans = tier.shard_files() - len(indexed) * 12
    assert orphans > 0  # the dead worker left shards behind
    # The next pass finishes the job and is idempotent after that.
    tier.worker().run_once()
    assert tier.indexed() == {key(i) for i in range(6, 9)}
    assert tier.worker().run_once().expired.total_blocks == 0
    orphans = tier.shard_files() - 3 * 12
    assert orphans > 0  # the shards of the batch in flight when it died are still there
    # The node scrub reclaims the orphans once they are past the grace period.
    tier.clock.advance(tier.config.orphan_grace_s + 1)
    reclaimed = sum(
        node.reclaim_orphans(tier.referenced(node.node_id), tier.config.orphan_grace_s)[
            "committed_reclaimed"
        ]
        for node in tier.nodes
    )
    assert reclaimed == orphans
    assert tier.shard_files() == files_before - 6 * 12
    survivors = tier.client.get_blocks([key(i) for i in range(6, 9)])
    assert [s.tobytes() for s in survivors] == [payload(i).tobytes() for i in range(6, 9)]


def test_a_dead_meta_shard_or_node_is_one_failed_step_not_a_failed_pass(tier: Tier) -> None:
    tier.put(list(range(12)), "agent")
    tier.fanout.dead.add((META, 1))
    tier.fanout.dead.add((NODE, 7))
    tier.clock.set(T0 + 4 * DAY)
    report = tier.worker().run_once()
    owned_by_0 = {key(i) for i in range(12) if meta_shard_of([key(i)], 2)[0] == 0}
    assert report.expired.total_blocks == len(owned_by_0)
    assert any("meta 1" in error for error in report.errors)
    assert any("node 7" in error for error in report.errors)
    assert tier.indexed() == {key(i) for i in range(12)} - owned_by_0
    tier.fanout.dead.clear()
    assert tier.worker().run_once().expired.total_blocks == 12 - len(owned_by_0)
    assert tier.indexed() == set()


def test_reconcile_loop_survives_a_failing_pass() -> None:
    calls: list[int] = []

    def step() -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("meta shard restarting")

    loop = ReconcileLoop(step, interval_s=0.001)
    loop.run(max_passes=4)
    assert calls == [0, 1, 2, 3]
    assert loop.failures == 1
    assert "meta shard restarting" in (loop.last_error or "")
    loop.stop()
    loop.run()  # stopped: returns at once
    assert len(calls) == 4
