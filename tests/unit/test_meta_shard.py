"""Meta shard: writer arbitration, visibility, leases, GC, miss reasons, rebuild, repair hooks."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest

from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.meta import MetaShard
from kvstore.blockstore.node import MANIFEST_SCHEMA
from kvstore.blockstore.placement import meta_shard_of
from kvstore.blockstore.records import MissReason, PutStatus
from kvstore.clock import ManualClock
from kvstore.errors import InvalidArgument

CONFIG = BlockStoreConfig(meta_shards=1, storage_nodes=14, lease_seconds=30.0)
STRIPE = np.arange(12, dtype=np.int32)


def _key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def _shard(clock: ManualClock | None = None) -> MetaShard:
    return MetaShard(0, CONFIG, clock or ManualClock(1_000_000.0))


def _commit(meta: MetaShard, keys: list[bytes], token: int = 1, class_id: int = 0) -> list[bool]:
    meta.begin_put(keys, token)
    placements = np.tile(STRIPE, (len(keys), 1))
    return meta.commit(keys, token, placements, [1000] * len(keys), class_id)


def test_writers_are_arbitrated_per_key() -> None:
    clock = ManualClock(1_000_000.0)
    meta = _shard(clock)
    assert meta.begin_put([_key(1), _key(2)], 7) == [PutStatus.GRANTED, PutStatus.GRANTED]
    assert meta.begin_put([_key(1), _key(3)], 8) == [PutStatus.BUSY, PutStatus.GRANTED]
    # the loser cannot commit over the reservation holder
    assert meta.commit([_key(1)], 8, STRIPE[None, :], [10], 0) == [False]
    assert meta.commit([_key(1)], 7, STRIPE[None, :], [10], 0) == [True]
    assert meta.begin_put([_key(1)], 9) == [PutStatus.EXISTS]
    assert meta.commit([_key(1)], 9, STRIPE[None, :], [10], 0) == [False]
    meta.abort_put([_key(2)], 7)
    assert meta.begin_put([_key(2)], 8) == [PutStatus.GRANTED]
    clock.advance(CONFIG.put_reservation_s + 1)  # a writer slower than its reservation loses it
    assert meta.begin_put([_key(3)], 10) == [PutStatus.GRANTED]


def test_a_block_is_visible_only_after_commit() -> None:
    meta = _shard()
    meta.begin_put([_key(1)], 1)
    assert not meta.locate([_key(1)]).found[0]
    _commit(meta, [_key(1)])
    reply = meta.locate([_key(1), _key(2)])
    assert reply.found.tolist() == [True, False]
    assert reply.placements[0].tolist() == STRIPE.tolist()
    assert reply.sizes.tolist() == [1000, 0]


def test_readable_means_k_shards_on_nodes_not_known_down() -> None:
    meta = _shard()
    _commit(meta, [_key(1)])
    assert meta.lookup([_key(1)], down_nodes=[0, 1]).readable.tolist() == [True]
    assert meta.lookup([_key(1)], down_nodes=[0, 1, 2]).readable.tolist() == [False]
    meta.mark_nodes(down=[0, 1])
    assert meta.lookup([_key(1)], down_nodes=[5]).readable.tolist() == [False]
    meta.mark_nodes(up=[0])
    assert meta.lookup([_key(1)], down_nodes=[5]).readable.tolist() == [True]
    assert meta.stats()["misses"]["default"][MissReason.UNREADABLE] == 2


def test_leases_protect_blocks_from_gc_until_released_or_expired() -> None:
    clock = ManualClock(1_000_000.0)
    meta = _shard(clock)
    _commit(meta, [_key(1), _key(2)])
    reply = meta.lookup([_key(1)])
    assert reply.lease_until == pytest.approx(clock.now() + 30)
    assert meta.gc_evict([_key(1), _key(2)], clock.now()) != []
    assert meta.locate([_key(1)]).found.tolist() == [True]  # leased: kept
    assert meta.locate([_key(2)]).found.tolist() == [False]
    meta.release([_key(1)])
    removed = meta.gc_evict([_key(1)], clock.now())
    assert [r.key for r in removed] == [_key(1)]
    assert removed[0].nodes == tuple(range(12)) and removed[0].reason == MissReason.EVICTED
    _commit(meta, [_key(3)])
    meta.lookup([_key(3)])
    clock.advance(32)  # the reader vanished without releasing: the lease runs out
    assert [r.key for r in meta.gc_evict([_key(3)], clock.now())] == [_key(3)]


def test_gc_evict_keeps_a_block_used_after_the_evictor_chose_it() -> None:
    """A GC pass reads the LRU order, then evicts (seconds later on a busy tier): a block a
    reader used in between is no longer least recently used and stays; the others go."""
    clock = ManualClock(1_000_000.0)
    meta = _shard(clock)
    _commit(meta, [_key(1), _key(2), _key(3)])
    clock.advance(5)
    chosen_at = clock.now()
    candidates = [key for _, key, _ in meta.gc_lru_candidates(chosen_at, 3000)]
    assert candidates == [_key(1), _key(2), _key(3)]
    clock.advance(1)
    meta.lookup([_key(2)])  # used after the choice; its lease given back at once
    meta.release([_key(2)])
    removed = meta.gc_evict(candidates, clock.now(), chosen_at=chosen_at)
    assert sorted(r.key for r in removed) == [_key(1), _key(3)]
    assert meta.locate([_key(2)]).found.tolist() == [True]
    # Without the choice's time (an older caller) only leases protect a block.
    assert [r.key for r in meta.gc_evict([_key(2)], clock.now())] == [_key(2)]


def test_gc_expire_and_lru_and_bytes_by_class() -> None:
    clock = ManualClock(1_000_000.0)
    meta = _shard(clock)
    _commit(meta, [_key(1)], class_id=1)  # agent
    clock.advance(10)
    _commit(meta, [_key(2)], token=2, class_id=2)  # chatbot
    assert meta.stored_bytes_by_class() == {"default": 0, "agent": 1000, "chatbot": 1000}
    candidates = meta.gc_lru_candidates(clock.now(), 1500)
    assert [key for _, key, _ in candidates] == [_key(1), _key(2)]
    clock.advance(3 * 86400)
    removed = meta.gc_expire(clock.now(), {"agent": 3 * 86400, "chatbot": 7 * 86400})
    assert [(r.key, r.traffic_class, r.reason) for r in removed] == [
        (_key(1), "agent", MissReason.EXPIRED)
    ]
    with pytest.raises(InvalidArgument, match="ttl_seconds_by_class"):
        meta.gc_expire(clock.now(), {"nope": 1.0})
    meta.lookup([_key(1), _key(9)], traffic_class="agent")
    misses = meta.stats()["misses"]
    assert misses["agent"][MissReason.EXPIRED] == 1
    assert misses["agent"][MissReason.NEVER_WRITTEN] == 1


def test_lease_expired_miss_reason() -> None:
    clock = ManualClock(1_000_000.0)
    meta = _shard(clock)
    _commit(meta, [_key(1)])
    until = meta.lookup([_key(1)]).lease_until
    clock.advance(40)
    meta.gc_evict([_key(1)], clock.now())
    meta.locate([_key(1)], lease_until=until)
    assert meta.stats()["misses"]["default"][MissReason.LEASE_EXPIRED] == 1


def _manifest(
    keys: list[bytes],
    index_of: dict[bytes, int],
    stamp: float = 0.0,
    digest: bytes = b"h" * 8,
    created: float = 999_000.0,
) -> pa.Table:
    return pa.table(
        {
            "key": pa.array(keys, pa.binary(32)),
            "shard_index": pa.array([index_of[k] for k in keys], pa.uint8()),
            "payload_len": pa.array([5000] * len(keys), pa.int64()),
            "class_id": pa.array([2] * len(keys), pa.uint8()),
            "created": pa.array([created] * len(keys), pa.float64()),
            "file_bytes": pa.array([600] * len(keys), pa.int64()),
            "stamp": pa.array([stamp] * len(keys), pa.float64()),
            "payload_hash": pa.array([digest] * len(keys), pa.binary(8)),
        },
        schema=MANIFEST_SCHEMA,
    )


def test_rebuild_restores_blocks_with_k_shards_and_never_fewer() -> None:
    meta = MetaShard(0, CONFIG, ManualClock(1_000_000.0), rebuilding=True)
    assert meta.lookup([_key(1)]).found.tolist() == [False]  # a miss, not an error
    assert meta.stats()["misses"]["unknown"][MissReason.REBUILDING] == 1
    meta.begin_rebuild()
    # block 1: committed shards on nodes 0..11 (shard i on node i); block 2: only on 0..8
    for node in range(12):
        keys = [_key(1)] + ([_key(2)] if node < 9 else [])
        meta.absorb_manifest(node, _manifest(keys, dict.fromkeys(keys, node)))
    _commit(meta, [_key(3)])  # committed while rebuilding: kept as is
    assert meta.finish_rebuild() == 1
    reply = meta.locate([_key(1), _key(2), _key(3)])
    assert reply.found.tolist() == [True, False, True]
    assert reply.placements[0].tolist() == list(range(12))
    assert reply.sizes[0] == 5000
    assert meta.stored_bytes_by_class()["chatbot"] == 5000


def test_rebuild_prefers_the_newer_copy_and_the_write_with_most_shards() -> None:
    meta = MetaShard(0, CONFIG, ManualClock(1_000_000.0), rebuilding=True)
    key = _key(1)
    for node in range(12):
        meta.absorb_manifest(node, _manifest([key], {key: node}, stamp=10.0))
    # shard 11 was repaired onto node 13 later; node 11 came back with its stale copy
    meta.absorb_manifest(13, _manifest([key], {key: 11}, stamp=50.0))
    # an older write of the same key left 3 shards on other nodes
    old = b"o" * 8
    meta.absorb_manifest(12, _manifest([key], {key: 0}, digest=old, created=5.0))
    assert meta.finish_rebuild() == 1
    assert meta.locate([key]).placements[0].tolist() == list(range(11)) + [13]


def test_repair_queue_hands_out_stripes_once_and_compare_and_set_moves() -> None:
    meta = _shard()
    keys = [_key(i) for i in range(5)]
    _commit(meta, keys)
    stripes, summary = meta.repair_queue([3], [], limit=2, max_bytes=1 << 30)
    assert len(stripes) == 2 and summary["stripes_left"] == 5 and summary["lost_1"] == 5
    rest, summary = meta.repair_queue([3], [], limit=10, max_bytes=1 << 30)
    assert len(rest) == 3 and summary["stripes_left"] == 3
    assert {s.key for s in stripes + rest} == set(keys)
    assert meta.repair_queue([3], [], limit=10, max_bytes=1 << 30)[0] == []  # handed out
    assert meta.set_placements([(keys[0], 3, 13, 3), (keys[1], 3, 13, 99)]) == [True, False]
    assert meta.locate([keys[0]]).placements[0, 3] == 13
    assert meta.referenced([keys[0], keys[1], _key(77)], 13) == [True, False, False]
    assert meta.referenced([keys[0]], 3) == [False]
    again, summary = meta.repair_queue([3], [], limit=10, max_bytes=1 << 30, refresh=True)
    assert len(again) == 4 and summary["stripes_left"] == 4


def test_keys_of_another_shard_are_rejected() -> None:
    config = BlockStoreConfig(meta_shards=4)
    keys = [_key(i) for i in range(20)]
    foreign = next(k for k, s in zip(keys, meta_shard_of(keys, 4), strict=True) if s != 0)
    with pytest.raises(InvalidArgument, match="meta shard"):
        MetaShard(0, config).lookup([foreign])
    with pytest.raises(InvalidArgument, match="shard_id"):
        MetaShard(4, config)
