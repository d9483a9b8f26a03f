"""Compaction of a storage node's segment log: the emptiest sealed segments (live share under
``compact_live_fraction``) have their live records copied into the open segment, in LSN-keeping
copies (so a replay after a restart ends in the same state), and are removed once empty.

A mixin of ``StorageNode`` (``node.py``): it works on the node's segments, index and live byte
counts, which it names below; kept apart so the node module stays about serving calls.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.blockstore.segments import (
    FLAG_COMMITTED,
    RECORD_BYTES,
    SHARD,
    Segment,
    entries_for,
    record_header,
    segment_name,
)
from kvstore.blockstore.shardindex import ShardIndex

if TYPE_CHECKING:
    from kvstore.blockstore.config import StorageNodeConfig
    from kvstore.privatefs import PrivateDir

log = logging.getLogger(__name__)


class Compaction:
    """``compact`` and its steps; the node state it shares is declared here for the checker."""

    node_id: int
    config: StorageNodeConfig
    _segments: dict[int, Segment]
    _live: Any
    _index: ShardIndex
    _open: Segment
    _segdir: PrivateDir
    _compacting: tuple[int, int] | None
    _marks_cache: tuple[int, np.ndarray] | None = None  # (segment seq, marks_live) of a move
    _counters: dict[str, int]

    # The node's own (``StorageNode`` overrides both).
    @property
    def _syncs(self) -> bool:
        raise NotImplementedError

    def _start_batch(self, size: int) -> int:
        raise NotImplementedError

    def compact(self, budget_bytes: int) -> dict[str, int]:
        """Move up to ``budget_bytes`` of live records out of sealed segments whose live share
        fell under ``compact_live_fraction`` (the emptiest first) into the open segment, and
        remove each segment once emptied; resumes where the last call stopped."""
        moved = removed = 0
        while moved < budget_bytes:
            if self._compacting is None:
                seq = self._compaction_candidate()
                if seq is None:
                    break
                self._compacting = (seq, 0)
            seq, start = self._compacting
            step, finished = self._move_records(seq, start, budget_bytes - moved)
            moved += step
            if not finished:
                break
            self._remove_segment(seq)
            removed += 1
        self._counters["bytes_compacted"] += moved
        self._counters["segments_compacted"] += removed
        return {"bytes_moved": moved, "segments_removed": removed}

    def _compaction_candidate(self) -> int | None:
        shares = {
            seq: self._live[seq] / segment.size
            for seq, segment in self._segments.items()
            if segment.sealed and segment is not self._open
        }
        below = [seq for seq, share in shares.items() if share < self.config.compact_live_fraction]
        return min(below, key=shares.__getitem__) if below else None

    def _move_records(self, seq: int, start: int, budget: int) -> tuple[int, bool]:
        """Copy live records of segment ``seq`` from entry ``start`` on, up to ``budget``
        bytes; returns (bytes copied, whether the segment holds nothing live any more)."""
        segment = self._segments[seq]
        entries = segment.all_entries()
        marks_live = self._marks_live(seq, entries)
        copies: list[tuple[int | None, bytes, np.ndarray | None]] = []  # (row, head, body)
        size = 0
        position = start
        while position < len(entries) and size < budget:
            entry = entries[position]
            record = entry["record"]
            head = record.tobytes()
            if record["kind"] == SHARD:
                offset = int(entry["offset"])
                found = self._index.live_row(
                    seq, offset, bytes(record["key"]), int(record["token"])
                )
                body = np.empty(int(record["body_len"]), np.uint8)
                if found is not None and segment.read(
                    offset + RECORD_BYTES,
                    body.size,
                    memoryview(body),  # type: ignore[arg-type]
                ):
                    row, committed = found
                    if committed:
                        head = _committed_copy(record, body.size)
                    copies.append((row, head, body))
                    size += RECORD_BYTES + body.size
            elif marks_live[position]:
                copies.append((None, head, None))
                size += RECORD_BYTES
            position += 1
        if copies:
            offset = self._start_batch(size)
            parts: list[object] = []
            offsets: list[int] = []
            for _, head, copied in copies:
                offsets.append(offset)
                parts += (head,) if copied is None else (head, copied)
                offset += len(head) + (0 if copied is None else copied.size)
            heads = b"".join(head for _, head, _ in copies)
            bodies = [b"" if copied is None else copied for _, _, copied in copies]
            target = self._open
            try:
                target.append(parts, [entries_for(offsets, heads, bodies)], self._syncs)
            except OSError as error:
                log.warning("node %d: compacting segment %d failed: %s", self.node_id, seq, error)
                return 0, False
            offset = target.size - size
            columns = self._index.columns
            for moved, _, copied in copies:
                record_bytes = RECORD_BYTES + (0 if copied is None else copied.size)
                if moved is not None:
                    self._live[seq] -= record_bytes
                    self._live[target.seq] += record_bytes
                    columns["seg"][moved] = target.seq
                    columns["offset"][moved] = offset
                offset += record_bytes
        finished = position >= len(entries)
        self._compacting = None if finished else (seq, position)
        if finished:
            self._marks_cache = None
        return size, finished

    def _marks_live(self, seq: int, entries: np.ndarray) -> np.ndarray:
        """Which records of segment ``seq`` are marks whose shard is still in another segment
        (so the mark must be copied). Worked out once per segment moved, not per step: a scan of
        every other segment's entries, under the node's lock, every 0.1 s step stalled a node
        holding thousands of segments. Safe to keep for the move: a mark acts on an older
        shard, and shards appended since cannot be the target of a mark already here."""
        cached = self._marks_cache
        if cached is not None and cached[0] == seq:
            return cached[1]
        others = [s.all_entries() for q, s in self._segments.items() if q != seq]
        shard_lsns = np.concatenate(
            [e["record"]["lsn"][e["record"]["kind"] == SHARD] for e in others]
            or [np.zeros(0, np.uint64)]
        )
        live = np.isin(entries["record"]["target_lsn"], shard_lsns)
        self._marks_cache = (seq, live)
        return live

    def _remove_segment(self, seq: int) -> None:
        segment = self._segments.pop(seq)
        del self._live[seq]
        segment.close()
        self._segdir.remove(segment_name(seq))
        if self.config.fsync == "always":
            self._segdir.fsync()


def _committed_copy(record: np.void, body_len: int) -> bytes:
    """The header of a compaction copy of a committed SHARD record: the same fields and LSN,
    flagged committed (its COMMIT record may be compacted away)."""
    return record_header(
        SHARD,
        int(record["lsn"]),
        bytes(record["key"]),
        token=int(record["token"]),
        class_id=int(record["class_id"]),
        index=int(record["index"]),
        flags=FLAG_COMMITTED,
        created=float(record["created"]),
        stamp=float(record["stamp"]),
        body_len=body_len,
    )
