"""The shard index alone: its maps change only through its methods, which keep the live bytes
of each segment in step with the rows pointing into it."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.blockstore.segments import RECORD_BYTES
from kvstore.blockstore.shardindex import ShardIndex

A, B = bytes([1]) * 32, bytes([2]) * 32


def add(index: ShardIndex, keys: list[bytes], token: int, seg: int, body: int = 100) -> list[int]:
    return index.add(
        token, keys, seg=seg, offset=[64 + 1000 * n for n in range(len(keys))], body_len=body
    )


def test_pending_then_committed_with_live_bytes_per_segment() -> None:
    index = ShardIndex(capacity=2)
    rows = add(index, [A, B], token=7, seg=1)
    assert dict(index.pending) == {(A, 7): rows[0], (B, 7): rows[1]}
    assert dict(index.live) == {1: 2 * (RECORD_BYTES + 100)}
    assert index.commit(A, 7) and not index.commit(A, 7) and not index.commit(B, 8)
    assert dict(index.committed) == {A: rows[0]} and dict(index.pending) == {(B, 7): rows[1]}
    assert index.live_total() == 2 * (RECORD_BYTES + 100)


def test_a_retried_put_and_a_newer_commit_replace_the_older_row() -> None:
    index = ShardIndex(capacity=1)  # rows are reused and the columns grow
    add(index, [A], token=7, seg=1)
    add(index, [A], token=7, seg=2, body=50)  # the same put again
    assert len(index.pending) == 1 and dict(index.live) == {2: RECORD_BYTES + 50}
    index.commit(A, 7)
    add(index, [A], token=9, seg=3)
    index.commit(A, 9)
    assert index.get("seg", index.committed[A]) == 3
    assert dict(index.live) == {3: RECORD_BYTES + 100}  # segment 2's record is dead now


def test_abort_forget_and_move_keep_live_bytes_in_step() -> None:
    index = ShardIndex()
    add(index, [A, B], token=7, seg=1)
    assert index.abort(B, 7) and not index.abort(B, 7)
    index.commit(A, 7)
    row = index.committed[A]
    index.move(row, seq=4, offset=128)
    assert (index.get("seg", row), index.get("offset", row)) == (4, 128)
    assert dict(index.live) == {4: RECORD_BYTES + 100}
    assert index.live_row(4, 128, A, 7) == (row, True) and index.live_row(1, 64, A, 7) is None
    assert index.forget(A) and not index.forget(A)
    assert dict(index.live) == {} and index.live_total() == 0


def test_callers_cannot_change_the_maps_or_columns_behind_its_back() -> None:
    index = ShardIndex()
    add(index, [A], token=7, seg=1)
    with pytest.raises(TypeError):
        index.pending[(B, 7)] = 0  # type: ignore[index]
    with pytest.raises(TypeError):
        index.live[1] = 0  # type: ignore[index]
    with pytest.raises(ValueError, match="read-only"):
        index.column("seg")[0] = np.uint32(5)
    assert index.get("seg", index.pending[(A, 7)]) == 1


def test_a_batch_over_two_segments_counts_each_and_an_empty_one_takes_no_row() -> None:
    index = ShardIndex(capacity=4)
    rows = index.add(7, [A, B], seg=np.array([1, 2]), offset=[64, 64], body_len=[10, 20])
    assert dict(index.live) == {1: RECORD_BYTES + 10, 2: RECORD_BYTES + 20}
    assert index.add(7, [], seg=3, offset=[], body_len=[]) == []
    assert dict(index.live) == {1: RECORD_BYTES + 10, 2: RECORD_BYTES + 20}
    third = index.add(7, [bytes([3]) * 32], seg=3, offset=[64], body_len=5)
    assert third[0] not in rows  # the free rows were all still there
