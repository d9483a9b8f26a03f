"""Compaction of a storage node's segment log: the emptiest sealed segments (live share under
``compact_live_fraction``) have their live records copied into the open segment, in LSN-keeping
copies (so a replay after a restart ends in the same state), and are removed once empty.

A collaborator of ``StorageNode`` (``node.py``), built on the node's segment log and index: the
log says what segments there are and takes the copies, the index says which records are live
and learns where they moved. What is its own is the progress of a move across calls (a budget
a call may stop mid-segment) and the marks found live for the segment being moved.
"""

from __future__ import annotations

import logging

import numpy as np

from kvstore.blockstore.segmentlog import AppendFailed, SegmentLog
from kvstore.blockstore.segments import (
    FLAG_COMMITTED,
    RECORD_BYTES,
    SHARD,
    record_header,
)
from kvstore.blockstore.shardindex import ShardIndex

log = logging.getLogger(__name__)


class Compaction:
    """``compact`` and its steps over one log and its index."""

    def __init__(
        self,
        segments: SegmentLog,
        index: ShardIndex,
        live_fraction: float,
        label: str = "compaction",
    ) -> None:
        """``live_fraction``: a sealed segment whose live share fell under it is emptied;
        ``label``: whose log, for log messages."""
        self._log = segments
        self._index = index
        self._live_fraction = live_fraction
        self._label = label
        self._compacting: tuple[int, int] | None = None  # (segment seq, next entry) of a move
        self._marks_cache: tuple[int, np.ndarray] | None = None  # (seq, marks_live) of a move

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
            self._log.remove(seq)
            removed += 1
        return {"bytes_moved": moved, "segments_removed": removed}

    def _compaction_candidate(self) -> int | None:
        shares = {
            seq: self._index.live_bytes(seq) / size for seq, size in self._log.sealed().items()
        }
        below = [seq for seq, share in shares.items() if share < self._live_fraction]
        return min(below, key=shares.__getitem__) if below else None

    def _move_records(self, seq: int, start: int, budget: int) -> tuple[int, bool]:
        """Copy live records of segment ``seq`` from entry ``start`` on, up to ``budget``
        bytes; returns (bytes copied, whether the segment holds nothing live any more)."""
        segment = self._log.segment(seq)
        assert segment is not None, f"segment {seq} is being compacted but gone"
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
            heads = b"".join(head for _, head, _ in copies)
            bodies = [b"" if copied is None else copied for _, _, copied in copies]
            try:
                target, offsets = self._log.append(heads, bodies)
            except AppendFailed as error:
                log.warning("%s: compacting segment %d failed: %s", self._label, seq, error)
                return 0, False
            for (moved, _, _), offset in zip(copies, offsets, strict=True):
                if moved is not None:
                    self._index.move(moved, target, offset)
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
        others = self._log.entries_except(seq)
        shard_lsns = np.concatenate(
            [e["record"]["lsn"][e["record"]["kind"] == SHARD] for e in others]
            or [np.zeros(0, np.uint64)]
        )
        live = np.isin(entries["record"]["target_lsn"], shard_lsns)
        self._marks_cache = (seq, live)
        return live


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
