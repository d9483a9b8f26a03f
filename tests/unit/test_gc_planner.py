"""The GC planner: global LRU merge across meta shards, and whole-pass plans over an index."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvstore.blockstore.index import BlockIndex
from kvstore.errors import InvalidArgument
from kvstore.gc.config import DAY, GCConfig
from kvstore.gc.planner import LRUCandidates, merge_lru, plan_index

T0 = 1_700_000_000.0
NAMES = ("default", "agent", "chatbot")


def key(shard: int, i: int) -> bytes:
    return hashlib.blake2b(b"%d/%d" % (shard, i), digest_size=32).digest()


def shard_candidates(shard: int, last: list[float], sizes: list[int]) -> LRUCandidates:
    order = np.argsort(last, kind="stable")
    return LRUCandidates(
        shard=shard,
        keys=[key(shard, int(i)) for i in order],
        last_access=np.asarray(last, dtype=np.float64)[order],
        sizes=np.asarray(sizes, dtype=np.int64)[order],
        classes=np.zeros(len(last), dtype=np.int64),
    )


def test_merge_takes_the_global_oldest_not_each_shards_oldest() -> None:
    # Shard 0 holds only recent blocks, shard 1 only old ones: a per-shard split would evict
    # recent blocks of shard 0; the global order takes all of them from shard 1.
    a = shard_candidates(0, [100.0, 101.0, 102.0], [10, 10, 10])
    b = shard_candidates(1, [1.0, 2.0, 3.0], [10, 10, 10])
    evictions = merge_lru([a, b], 25)
    assert [(e.shard, e.keys) for e in evictions] == [(1, [key(1, 0), key(1, 1), key(1, 2)])]


def test_merge_matches_a_brute_force_global_sort() -> None:
    rng = np.random.default_rng(11)
    shards = []
    everything = []
    for shard in range(4):
        n = int(rng.integers(0, 40))
        last = rng.integers(0, 50, size=n).astype(float).tolist()  # ties across shards
        sizes = rng.integers(1, 100, size=n).tolist()
        candidates = shard_candidates(shard, last, sizes)
        shards.append(candidates)
        for position, k in enumerate(candidates.keys):
            everything.append(
                (candidates.last_access[position], shard, position, k, candidates.sizes[position])
            )
    everything.sort(key=lambda item: item[:3])
    total = sum(item[4] for item in everything)
    for needed in (1, 50, total // 3, total, total + 10):
        expected, running = [], 0
        for item in everything:
            if running >= needed:
                break
            expected.append(item[3])
            running += item[4]
        got = {k for e in merge_lru(shards, needed) for k in e.keys}
        assert got == set(expected)
        for e in merge_lru(shards, needed):
            assert np.all(np.diff([shards[e.shard].keys.index(k) for k in e.keys]) > 0)


def test_merge_edge_cases() -> None:
    a = shard_candidates(0, [1.0], [10])
    assert merge_lru([a], 0) == []
    assert merge_lru([], 100) == []
    with pytest.raises(InvalidArgument):
        merge_lru([a], -1)
    with pytest.raises(InvalidArgument):
        LRUCandidates(0, [key(0, 0)], np.zeros(2), np.zeros(1), np.zeros(1))


def build(ids_by_class: dict[int, range], size: int = 1000) -> BlockIndex:
    index = BlockIndex()
    for cls, ids in ids_by_class.items():
        n = len(ids)
        rows = index.upsert(
            [key(9, i) for i in ids], np.zeros((n, 12), np.int32), np.full(n, size),
            np.full(n, cls), T0,
        )  # fmt: skip
        for i, row in zip(ids, rows, strict=True):
            index.touch([row], T0 + i)
    return index


def test_plan_expires_first_then_evicts_among_survivors() -> None:
    index = build({0: range(0, 10), 1: range(10, 20), 2: range(20, 30)})
    config = GCConfig(ttl={"default": "30d", "agent": "3d", "chatbot": "30d"})
    # At 3 days + 15 s: agent blocks touched before T0 + 15 s expire (ids 10..14).
    now = T0 + 3 * DAY + 15
    # Capacity of 26 blocks: 25 left after expiry is 96 % > 90 %: evict down to 80 % = 20.8
    # blocks -> 5 more, the oldest survivors: default ids 0..4 (not the expired agent ones).
    plan = plan_index(index, now, config, NAMES, capacity_bytes=26 * 1000)
    assert plan.expired.blocks.tolist() == [0, 5, 0]
    assert plan.evicted.blocks.tolist() == [5, 0, 0]
    assert plan.evicted.bytes.tolist() == [5000, 0, 0]
    assert plan.used_after == 20 * 1000
    table = plan.format_table()
    assert "agent" in table and "total" in table
    assert plan.as_dict()["expired"]["agent"] == {"blocks": 5, "bytes": 5000}


def test_plan_without_capacity_plans_no_eviction() -> None:
    index = build({0: range(5)})
    plan = plan_index(index, T0, GCConfig(), NAMES)
    assert plan.evicted.total_blocks == 0
    assert plan.expired.total_blocks == 0
    with pytest.raises(InvalidArgument):
        plan_index(index, T0, GCConfig(), NAMES, capacity_bytes=-1)


def test_plan_respects_leases() -> None:
    index = build({1: range(4)})
    rows = index.find([key(9, 0)])
    index.acquire_lease(rows, until=T0 + 10 * DAY)
    plan = plan_index(index, T0 + 5 * DAY, GCConfig(), NAMES, capacity_bytes=1000)
    assert plan.expired.blocks.tolist() == [0, 3, 0]
    assert plan.evicted.total_blocks == 0  # the only survivor is leased
