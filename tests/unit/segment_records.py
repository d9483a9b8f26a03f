"""Records written straight to a ``SegmentLog`` and indexed in a ``ShardIndex``, as a storage
node does (``kvstore.blockstore.node``), for the tests of the log, the index and compaction
alone. Bodies are random bytes: the log never parses them, the index only keeps their length."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from kvstore.blockstore.segmentlog import SegmentLog
from kvstore.blockstore.segments import COMMIT, DELETE, RECORD_BYTES, SHARD, record_headers
from kvstore.blockstore.shardindex import ShardIndex

BODY_BYTES = 200


def key(n: int) -> bytes:
    return n.to_bytes(4, "big") * 8


def shards(
    log: SegmentLog, keys: Sequence[bytes], token: int = 1, body_bytes: int = BODY_BYTES
) -> tuple[int, list[int], list[bytes]]:
    """Append SHARD records of ``keys`` in one batch: (segment seq, offsets, bodies)."""
    bodies = [os.urandom(body_bytes) for _ in keys]
    heads = record_headers(
        SHARD, log.take_lsns(len(keys)), keys, token=token, body_len=body_bytes, stamp=1.0
    )
    seq, offsets = log.append(heads, bodies)
    return seq, offsets, bodies


def marks(log: SegmentLog, kind: int, targets: Sequence[tuple[bytes, int, int]]) -> int:
    """Append COMMIT or DELETE records of (key, token, target LSN); returns their segment."""
    keys, tokens, lsns = zip(*targets, strict=True)
    heads = record_headers(kind, log.take_lsns(len(keys)), keys, token=tokens, target_lsn=lsns)
    seq, _ = log.append(heads, [b""] * len(keys))
    return seq


def put(
    log: SegmentLog, index: ShardIndex, keys: Sequence[bytes], token: int = 1
) -> dict[bytes, bytes]:
    """A node's put: SHARD records appended and indexed pending; returns each key's body."""
    first = log.next_lsn
    seq, offsets, bodies = shards(log, keys, token)
    index.add(
        token,
        keys,
        seg=seq,
        offset=offsets,
        body_len=BODY_BYTES,
        stamp=1.0,
        lsn=np.arange(first, first + len(keys), dtype=np.uint64),
    )
    return dict(zip(keys, bodies, strict=True))


def commit(log: SegmentLog, index: ShardIndex, keys: Sequence[bytes], token: int = 1) -> None:
    """A node's commit: COMMIT records appended, the pending shards committed."""
    marks(log, COMMIT, [(k, token, index.get("lsn", index.pending[(k, token)])) for k in keys])
    for k in keys:
        assert index.commit(k, token)


def delete(log: SegmentLog, index: ShardIndex, keys: Sequence[bytes]) -> None:
    """A node's delete: DELETE records appended, the committed shards forgotten."""
    marks(log, DELETE, [(k, 0, index.get("lsn", index.committed[k])) for k in keys])
    for k in keys:
        assert index.forget(k)


def body_at(log: SegmentLog, index: ShardIndex, k: bytes) -> bytes | None:
    """The body of ``k``'s committed shard, read where the index says it is."""
    row = index.committed[k]
    into = bytearray(index.get("body_len", row))
    found = log.read(
        index.get("seg", row), index.get("offset", row) + RECORD_BYTES, len(into), memoryview(into)
    )
    return bytes(into) if found else None
