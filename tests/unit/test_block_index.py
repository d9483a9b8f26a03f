"""Unit tests of the compact columnar BlockIndex."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvstore.blockstore.index import BlockIndex, array_to_keys, keys_to_array
from kvstore.blockstore.indexsnapshot import index_from_table, index_to_table
from kvstore.errors import InvalidArgument

T0 = 1_700_000_000.0
W = 12


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def placements(n: int, start: int = 0) -> np.ndarray:
    return (np.arange(W, dtype=np.int32)[None, :] + np.arange(start, start + n)[:, None]) % 40


def fill(index: BlockIndex, ids: range, size: int = 1000, cls: int = 0, now: float = T0):
    keys = [key(i) for i in ids]
    n = len(keys)
    return keys, index.upsert(
        keys, placements(n), np.full(n, size), np.full(n, cls, dtype=np.uint8), now
    )


def test_upsert_find_get_roundtrip() -> None:
    index = BlockIndex(stripe_width=W)
    keys, rows = fill(index, range(10), size=111 * 1024, cls=2)
    assert len(index) == 10
    assert np.array_equal(index.find(keys), rows)
    assert index.find([key(99)]).tolist() == [-1]
    records = index.get(rows[[3, 1]])
    assert records.keys == [keys[3], keys[1]]
    assert np.array_equal(records.placements, placements(10)[[3, 1]])
    assert records.sizes.tolist() == [111 * 1024] * 2
    assert records.classes.tolist() == [2, 2]
    assert records.created.tolist() == [T0, T0]
    assert records.last_access.tolist() == [T0, T0]
    assert records.lease_count.tolist() == [0, 0]
    assert index.total_bytes() == 10 * 111 * 1024


def test_upsert_existing_replaces_fields_keeps_created_and_lease() -> None:
    index = BlockIndex()
    keys, rows = fill(index, range(3), size=10, cls=0, now=T0)
    index.acquire_lease(rows[:1], until=T0 + 100)
    new_rows = index.upsert(
        keys[:1], np.full((1, W), 7, dtype=np.int32), np.array([99]), np.array([1]), T0 + 50
    )
    assert new_rows.tolist() == [rows[0]]
    record = index.get(new_rows)
    assert record.placements.tolist() == [[7] * W]
    assert record.sizes.tolist() == [99]
    assert record.classes.tolist() == [1]
    assert record.created.tolist() == [T0]
    assert record.last_access.tolist() == [T0 + 50]
    assert record.lease_count.tolist() == [1]
    assert len(index) == 3


def test_duplicate_key_in_one_upsert_last_occurrence_wins() -> None:
    index = BlockIndex()
    k = key(1)
    rows = index.upsert(
        [k, key(2), k],
        np.stack([np.full(W, 1), np.full(W, 2), np.full(W, 3)]).astype(np.int32),
        np.array([10, 20, 30]),
        np.array([0, 0, 1]),
        T0,
    )
    assert rows[0] == rows[2]
    assert len(index) == 2
    record = index.get(rows[:1])
    assert record.sizes.tolist() == [30]
    assert record.classes.tolist() == [1]
    assert record.placements.tolist() == [[3] * W]


def test_structured_keys_that_share_prefixes_are_distinct() -> None:
    # Keys differing only in their last bytes (not BLAKE2b digests) must still hash apart.
    index = BlockIndex()
    keys = [i.to_bytes(32, "big") for i in range(5000)]
    rows = index.upsert(
        keys, np.zeros((5000, W), np.int32), np.ones(5000, np.int64), np.zeros(5000, np.int64), T0
    )
    assert len(set(rows.tolist())) == 5000
    assert np.array_equal(index.find(keys), rows)
    assert index.find([(5000).to_bytes(32, "big")]).tolist() == [-1]


def test_remove_frees_rows_for_reuse_and_tombstones_keep_chains() -> None:
    index = BlockIndex()
    keys, rows = fill(index, range(2000))
    removed = index.remove(keys[::2] + [key(10**6)])
    assert len(removed) == 1000
    assert sorted(removed.keys) == sorted(keys[::2])
    assert len(index) == 1000
    assert (index.find(keys[::2]) == -1).all()
    # The survivors are still found (a tombstone must not cut a probe chain).
    assert np.array_equal(index.find(keys[1::2]), rows[1::2])
    _, new_rows = fill(index, range(5000, 6000))
    assert set(new_rows.tolist()) == set(rows[::2].tolist())
    assert len(index) == 2000
    # Removing again is a no-op.
    assert len(index.remove(keys[::2])) == 0


def test_many_remove_insert_cycles_rebuild_table_and_stay_consistent() -> None:
    index = BlockIndex()
    live: dict[bytes, int] = {}
    for cycle in range(30):
        new_keys, new_rows = fill(index, range(cycle * 500, cycle * 500 + 500))
        live.update(zip(new_keys, new_rows.tolist(), strict=True))
        victims = list(live)[:400]
        index.remove(victims)
        for victim in victims:
            del live[victim]
    assert len(index) == len(live)
    assert index.find(list(live)).tolist() == list(live.values())
    assert index.memory_bytes() / max(1, len(index)) < 2000  # table sized to live, not history


def test_numpy_key_arrays_are_accepted() -> None:
    index = BlockIndex()
    raw = np.frombuffer(b"".join(key(i) for i in range(4)), dtype=np.uint8).reshape(4, 32)
    rows = index.upsert(
        raw, np.zeros((4, W), np.int32), np.ones(4, np.int64), np.zeros(4, np.int64), T0
    )
    assert np.array_equal(index.find([key(i) for i in range(4)]), rows)
    assert array_to_keys(keys_to_array(raw)) == [key(i) for i in range(4)]


def test_touch_moves_last_access_forward_only() -> None:
    index = BlockIndex()
    _, rows = fill(index, range(2))
    index.touch(rows[:1], T0 + 10)
    index.touch(rows[:1], T0 + 5)
    assert index.get(rows).last_access.tolist() == [T0 + 10, T0]


def test_leases_count_and_end() -> None:
    index = BlockIndex()
    _, rows = fill(index, range(3))
    row = rows[:1]
    index.acquire_lease(row, until=T0 + 60)
    index.acquire_lease(row, until=T0 + 30)  # an earlier end never shortens the lease
    assert index.get(row).lease_count.tolist() == [2]
    assert index.is_leased(row, T0 + 59).tolist() == [True]
    assert index.is_leased(row, T0 + 60).tolist() == [False]  # ended
    index.release_lease(row)
    assert index.is_leased(row, T0).tolist() == [True]
    index.release_lease(row)
    assert index.is_leased(row, T0).tolist() == [False]
    assert index.get(row).lease_until.tolist() == [0.0]
    index.release_lease(row)  # an extra release stops at 0
    assert index.get(row).lease_count.tolist() == [0]
    # The same row twice in one call takes two leases.
    index.acquire_lease(np.array([rows[1], rows[1]]), until=T0 + 10)
    assert index.get(rows[1:2]).lease_count.tolist() == [2]


def test_lease_end_is_rounded_up_never_down() -> None:
    index = BlockIndex()
    _, rows = fill(index, range(1))
    index.acquire_lease(rows, until=T0 + 10.2)
    assert index.is_leased(rows, T0 + 10.5).tolist() == [True]
    assert index.is_leased(rows, T0 + 11).tolist() == [False]


def test_set_placement_and_rows_on_node() -> None:
    index = BlockIndex()
    keys = [key(i) for i in range(3)]
    place = np.array([np.arange(W), np.arange(W) + 12, np.arange(W) + 24], dtype=np.int32)
    rows = index.upsert(keys, place, np.ones(3, np.int64), np.zeros(3, np.int64), T0)
    assert index.rows_on_node(5).tolist() == [rows[0]]
    index.set_placement(int(rows[1]), 0, 5)
    assert sorted(index.rows_on_node(5).tolist()) == sorted([rows[0], rows[1]])
    index.set_placement(int(rows[0]), 5, -1)
    assert index.rows_on_node(5).tolist() == [rows[1]]
    assert index.get(rows[:1]).placements[0, 5] == -1
    index.remove(keys[1:2])
    assert index.rows_on_node(5).tolist() == []


def test_expired_rows_by_class_and_basis() -> None:
    index = BlockIndex()
    day = 86400.0
    _, agent = fill(index, range(0, 5), cls=1, now=T0)
    _, chat = fill(index, range(5, 10), cls=2, now=T0)
    ttl = np.array([day, 3 * day, 7 * day])
    assert index.expired_rows(T0 + 3 * day - 1, ttl).size == 0
    assert index.expired_rows(T0 + 3 * day, ttl).size == 0  # strictly older than the TTL
    assert sorted(index.expired_rows(T0 + 3 * day + 1, ttl).tolist()) == sorted(agent.tolist())
    # Touching an agent block restarts its clock under the last_access basis only.
    index.touch(agent[:1], T0 + 2 * day)
    after = index.expired_rows(T0 + 3 * day + 1, ttl, basis="last_access").tolist()
    assert agent[0] not in after
    assert agent[0] in index.expired_rows(T0 + 3 * day + 1, ttl, basis="created").tolist()
    assert sorted(index.expired_rows(T0 + 7 * day + 1, ttl, basis="created").tolist()) == sorted(
        agent.tolist() + chat.tolist()
    )
    # Leased rows are never expired; limit bounds the answer.
    index.acquire_lease(chat[:2], until=T0 + 8 * day)
    rows = index.expired_rows(T0 + 7 * day + 1, ttl, basis="created")
    assert not set(chat[:2].tolist()) & set(rows.tolist())
    assert index.expired_rows(T0 + 7 * day + 1, ttl, basis="created", limit=3).size == 3
    # A class the TTL array does not cover never expires; inf means never.
    assert index.expired_rows(T0 + 100 * day, np.array([day])).size == 0
    assert index.expired_rows(T0 + 100 * day, np.array([day, np.inf, np.inf])).size == 0


def test_lru_rows_minimal_oldest_first_prefix_skipping_leased() -> None:
    index = BlockIndex()
    keys = [key(i) for i in range(10)]
    rows = index.upsert(
        keys, np.zeros((10, W), np.int32), np.full(10, 100), np.zeros(10, np.int64), T0
    )
    for position, row in enumerate(rows):
        index.touch([row], T0 + 100 - position)  # row 9 oldest ... row 0 newest
    assert index.lru_rows(T0 + 200, 250).tolist() == [rows[9], rows[8], rows[7]]
    assert index.lru_rows(T0 + 200, 300).tolist() == [rows[9], rows[8], rows[7]]
    assert index.lru_rows(T0 + 200, 0).tolist() == []
    index.acquire_lease(rows[8:9], until=T0 + 500)
    assert index.lru_rows(T0 + 200, 250).tolist() == [rows[9], rows[7], rows[6]]
    # After the lease ends the block is a candidate again.
    assert index.lru_rows(T0 + 600, 250).tolist() == [rows[9], rows[8], rows[7]]
    # Asking for more than there is returns every unleased row in LRU order.
    everything = index.lru_rows(T0 + 200, 10**9).tolist()
    assert everything == [r for r in rows[::-1].tolist() if r != rows[8]]


def test_lru_rows_on_a_large_index_matches_a_full_sort() -> None:
    index = BlockIndex()
    n = 150_000  # > 65,536 rows: the threshold comes from a strided sample of the column
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 2**63, size=(n, 4), dtype=np.uint64)
    sizes = rng.integers(50_000, 150_000, size=n)
    rows = index.upsert(raw, np.zeros((n, W), np.int32), sizes, np.zeros(n, np.int64), T0)
    index.touch(rows, T0)  # no-op, same time
    access = T0 + rng.integers(0, 1000, size=n).astype(np.float64)  # many ties
    for value in np.unique(access):
        index.touch(rows[access == value], float(value))
    order = np.lexsort((rows, access))
    cumulative = np.cumsum(sizes[order])
    for needed in (1, 10**6, int(sizes.sum() // 7), int(sizes.sum()) - 1, int(sizes.sum()) * 2):
        got = index.lru_rows(T0 + 2000, needed)
        cut = int(np.searchsorted(cumulative, needed)) + 1
        assert got.tolist() == rows[order[:cut]].tolist()


def test_bytes_and_counts_by_class() -> None:
    index = BlockIndex()
    fill(index, range(0, 4), size=10, cls=0)
    fill(index, range(4, 6), size=100, cls=2)
    assert index.bytes_by_class(3).tolist() == [40, 0, 200]
    assert index.count_by_class(3).tolist() == [4, 0, 2]
    assert index.total_bytes() == 240


def test_snapshot_roundtrip_through_parquet(tmp_path) -> None:
    index = BlockIndex()
    keys, rows = fill(index, range(100), size=5, cls=1)
    index.touch(rows[:10], T0 + 7.5)
    index.acquire_lease(rows[:3], until=T0 + 99)
    index.set_placement(int(rows[4]), 2, -1)
    index.remove(keys[50:60])
    path = tmp_path / "index.parquet"
    pq.write_table(index_to_table(index), path)
    restored = index_from_table(pq.read_table(path))
    assert len(restored) == 90
    assert restored.stripe_width == W
    survivors = keys[:50] + keys[60:]
    a = index.get(index.find(survivors))
    b = restored.get(restored.find(survivors))
    assert a.keys == b.keys
    for field in ("placements", "sizes", "classes", "created", "last_access", "lease_until"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert np.array_equal(a.lease_count, b.lease_count)
    assert (restored.find(keys[50:60]) == -1).all()


def test_from_table_rejects_foreign_tables() -> None:
    with pytest.raises(InvalidArgument, match="missing column"):
        index_from_table(pa.table({"key": [b"x"]}))


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda ix: ix.upsert([b"short"], np.zeros((1, W)), [1], [0], T0), "keys[0]"),
        (lambda ix: ix.upsert([key(1)], np.zeros((1, 3), np.int32), [1], [0], T0), "placements"),
        (lambda ix: ix.upsert([key(1)], np.full((1, W), -2), [1], [0], T0), "placements"),
        (lambda ix: ix.upsert([key(1)], np.zeros((1, W), np.int32), [-1], [0], T0), "sizes"),
        (lambda ix: ix.upsert([key(1)], np.zeros((1, W), np.int32), [1], [255], T0), "classes"),
        (lambda ix: ix.upsert([key(1)], np.zeros((1, W), np.int32), [1], [0], -5.0), "now"),
        (lambda ix: ix.get([10**6]), "rows"),
        (lambda ix: ix.touch([0.5], T0), "rows"),
        (lambda ix: ix.set_placement(0, W, 1), "shard_index"),
        (lambda ix: ix.set_placement(0, 0, 70000), "node_id"),
        (lambda ix: ix.expired_rows(T0, [1.0], basis="mtime"), "basis"),  # type: ignore[arg-type]
        (lambda ix: ix.expired_rows(T0, [-1.0]), "ttl_by_class"),
        (lambda ix: ix.lru_rows(T0, -1), "bytes_needed"),
        (lambda ix: ix.find(key(1)), "keys"),
    ],
)
def test_bad_arguments_name_the_argument(call, argument) -> None:
    index = BlockIndex()
    fill(index, range(1))
    with pytest.raises(InvalidArgument) as caught:
        call(index)
    assert caught.value.argument == argument


def test_freed_row_is_rejected_by_row_apis() -> None:
    index = BlockIndex()
    keys, rows = fill(index, range(2))
    index.remove(keys[:1])
    with pytest.raises(InvalidArgument, match="holds no block"):
        index.get(rows[:1])


def test_memory_per_block_is_compact() -> None:
    index = BlockIndex()
    n = 200_000
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 2**63, size=(n, 4), dtype=np.uint64)
    for start in range(0, n, 10_000):  # incremental growth, like a live shard
        chunk = raw[start : start + 10_000]
        index.upsert(
            chunk,
            np.zeros((len(chunk), W), np.int32),
            np.ones(len(chunk), np.int64),
            np.zeros(len(chunk), np.int64),
            T0,
        )
    assert len(index) == n
    assert index.memory_bytes() / n <= 128


def test_lru_rows_skips_excluded_rows() -> None:
    index = BlockIndex()
    keys = [key(i) for i in range(5)]
    rows = index.upsert(keys, np.zeros((5, W), np.int32), np.full(5, 10), np.zeros(5, int), T0)
    for position, row in enumerate(rows):
        index.touch([row], T0 + position)
    assert index.lru_rows(T0 + 9, 20, exclude_rows=rows[:1]).tolist() == rows[1:3].tolist()
    with pytest.raises(InvalidArgument) as caught:
        index.lru_rows(T0 + 9, 20, exclude_rows=np.array([999]))
    assert caught.value.argument == "exclude_rows"


def test_float_arrays_are_refused_for_integer_columns() -> None:
    index = BlockIndex()
    with pytest.raises(InvalidArgument) as caught:
        index.upsert([key(1)], np.zeros((1, W)), np.ones(1, np.int64), np.zeros(1, int), T0)
    assert caught.value.argument == "placements"
    with pytest.raises(InvalidArgument) as caught:
        index.upsert([key(1)], np.zeros((1, W), np.int32), np.ones(1), np.zeros(1, int), T0)
    assert caught.value.argument == "sizes"
    assert len(index) == 0  # nothing half-inserted


def test_touch_with_one_time_per_row() -> None:
    index = BlockIndex()
    _, rows = fill(index, range(3))
    index.touch(np.array([rows[0], rows[1], rows[0]]), np.array([T0 + 5, T0 + 7, T0 + 9]))
    index.touch(rows[2:], np.array([T0 - 100]))  # never backwards
    assert index.get(rows).last_access.tolist() == [T0 + 9, T0 + 7, T0]
    with pytest.raises(InvalidArgument) as caught:
        index.touch(rows, np.array([T0, T0]))
    assert caught.value.argument == "now"
    with pytest.raises(InvalidArgument):
        index.touch(rows[:1], np.array([np.nan]))
