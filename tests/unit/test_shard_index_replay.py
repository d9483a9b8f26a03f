"""ShardIndex.replay: the keys applied at once give the same index as the ordered loop alone."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.blockstore.segments import (
    COMMIT,
    DELETE,
    ENTRY_DTYPE,
    FLAG_COMMITTED,
    SHARD,
)
from kvstore.blockstore.shardindex import ShardIndex


def _history(seed: int, records: int) -> list[tuple[int, np.ndarray]]:
    """Random records over a random number of keys (some sharing an 8-byte prefix) in two
    segments: lone shards, shard-then-commit pairs (of the right token or not), compaction
    copies, deletes, commits aimed at other records."""
    rng = np.random.default_rng(seed)
    prefixes = [k if k % 7 else k + 1 for k in range(int(rng.integers(1, 200)))]  # 0 and 1 share
    keys = [bytes([p]) * 8 + bytes([k]) * 24 for k, p in enumerate(prefixes)]
    entries = np.zeros(records, ENTRY_DTYPE)
    last_shard: dict[bytes, int] = {}
    lsn = 0
    for i in range(records):
        key = keys[int(rng.integers(len(keys)))]
        kind = int(rng.choice([SHARD, SHARD, COMMIT, DELETE]))
        copy = rng.random() < 0.1 and lsn > 0  # a compaction copy keeps its record's LSN
        lsn = lsn if copy else lsn + 1
        record = entries["record"][i : i + 1]
        record["key"] = np.frombuffer(key, "V32")
        record["kind"] = kind
        record["token"] = int(rng.integers(1, 3))
        record["flags"] = FLAG_COMMITTED if copy or rng.random() < 0.1 else 0
        record["lsn"] = lsn
        # Mostly at the key's last shard; sometimes at the last shard under its 8-byte prefix
        # (another key's, where two share one) or anywhere.
        aimed = (
            last_shard.get(key if rng.random() < 0.6 else key[:8]) if rng.random() < 0.9 else None
        )
        record["target_lsn"] = aimed if aimed is not None else int(rng.integers(1, lsn + 1))
        record["body_len"] = 100
        if kind == SHARD:
            last_shard[key] = last_shard[key[:8]] = lsn
        entries["offset"][i] = 64 + i * 196
    half = records // 2
    return [(1, entries[:half].copy()), (2, entries[half:].copy())]


def _loop_only(tables: list[tuple[int, np.ndarray]]) -> ShardIndex:
    """The reference: ``replay`` with every record sent through the ordered loop."""
    index = ShardIndex()
    original = ShardIndex._apply_simple

    def nothing_simple(self: ShardIndex, records: np.ndarray, row_of: np.ndarray) -> np.ndarray:
        return np.arange(len(records))

    ShardIndex._apply_simple = nothing_simple  # type: ignore[method-assign]
    try:
        index.replay(tables)
    finally:
        ShardIndex._apply_simple = original  # type: ignore[method-assign]
    return index


@pytest.mark.parametrize("seed", range(40))
def test_replay_matches_the_ordered_loop(seed: int) -> None:
    tables = _history(seed, records=int(np.random.default_rng(seed).integers(2, 400)))
    fast = ShardIndex()
    next_lsn = fast.replay(tables)
    slow = _loop_only(tables)
    assert fast.committed == slow.committed
    assert fast.pending == slow.pending
    assert fast.live == slow.live
    assert next_lsn == max(int(t["record"]["lsn"].max()) for _, t in tables) + 1


def test_the_common_histories_are_applied_without_the_loop() -> None:
    """A restart of many committed shards should not go record by record."""
    entries = np.zeros(6, ENTRY_DTYPE)
    records = entries["record"]
    for i, (key, kind, flags, target) in enumerate(
        [
            (1, SHARD, 0, 0),
            (1, COMMIT, 0, 1),
            (2, SHARD, 0, 0),
            (3, SHARD, FLAG_COMMITTED, 0),
            (4, SHARD, 0, 0),
            (4, DELETE, 0, 5),
        ]
    ):
        records["key"][i] = np.frombuffer(bytes([key]) * 32, "V32")[0]
        records["kind"][i], records["flags"][i] = kind, flags
        records["lsn"][i], records["target_lsn"][i], records["token"][i] = i + 1, target, 7
    index = ShardIndex()
    row_of = np.where(records["kind"] == SHARD, np.cumsum(records["kind"] == SHARD) - 1, -1)
    tangled = index._apply_simple(records, row_of)
    assert tangled.tolist() == [4, 5]  # key 4's shard-then-delete goes to the loop
    assert index.committed == {bytes([1]) * 32: 0, bytes([3]) * 32: 2}
    assert index.pending == {(bytes([2]) * 32, 7): 1}
