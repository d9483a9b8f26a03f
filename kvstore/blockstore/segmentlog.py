"""A storage node's segment log: the segment files, which one is open, and the LSNs.

``segments.py`` owns the bytes (records, footers, scans); this owns the log made of them: the
segments found at open (read back, with torn tails cut off and older unsealed ones sealed), the
one open segment that appends go to (sealed and replaced once a batch would take it past
``segment_bytes``), LSN allocation (one counter, never reused: an LSN names an event), and
removing a segment compaction emptied. It knows nothing of shards or of which records are live:
the index (``shardindex.py``) applies the records the log hands it, and compaction
(``compaction.py``) decides what to copy.

Every batch is one write call and at most one ``fdatasync`` (``fsync`` policy ``batch`` or
``always``; ``always`` also makes segment creates and removes durable). File access goes
through ``logfiles.LogFiles``, so the log runs over memory in its unit tests.

The page cache keeps only the newest ``cached_bytes`` the log appended: past them, the oldest
appends' pages are dropped (advice to the kernel, after their flush, so they are clean). A
write then fills pages the log just gave back instead of taking memory the machine never
touched, which on a VM whose host reclaims unused guest memory costs ~5x as much: measured
here, a loop of 730 KB appends, each flushed, costs 0.5 CPU-s per GB written with the bound and
2.6-3.0 without it once the memory freed earlier is used up. Reads of the newest blocks (a
prefix reused soon after it was written) still come from memory.

Not thread-safe: the node that owns it serializes calls.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kvstore.blockstore.logfiles import CacheBound, LogFiles
from kvstore.blockstore.segments import (
    RECORD_BYTES,
    RECORD_DTYPE,
    SEGMENT_HEADER_BYTES,
    Segment,
    entries_for,
    open_segment,
    segment_files,
    segment_name,
)
from kvstore.clock import Clock

log = logging.getLogger(__name__)


class AppendFailed(Exception):
    """Writing a batch failed; the segment was cut back, so no record of it is in the log.
    (Failing to roll to a new segment is not this: that ``OSError`` propagates.)"""


class SegmentLog:
    """The segments of one node's log, opened and read back (``entry_tables``), ready for
    appends."""

    def __init__(
        self,
        files: LogFiles,
        *,
        segment_bytes: int,
        fsync: str,
        clock: Clock,
        label: str = "segment log",
        cached_bytes: int | None = None,
    ) -> None:
        """``fsync``: ``always``, ``batch`` or ``never`` (``StorageNodeConfig.fsync``);
        ``label``: who owns the log, for its log messages; ``cached_bytes``: how many of the
        newest appended bytes stay in the page cache (``StorageNodeConfig.cached_log_bytes``;
        None: no bound)."""
        self._files = files
        self._segment_bytes = segment_bytes
        self._fsync = fsync
        self._clock = clock
        self._label = label
        self._cached = CacheBound(cached_bytes)
        self._segments: dict[int, Segment] = {}
        self._next_lsn = 1
        #: Records and spans found damaged when the log was read back.
        self.damaged_records = 0
        self._read_back()
        self._open = self._open_for_appends()

    # --- opening ---------------------------------------------------------------------------

    def _read_back(self) -> None:
        for name in segment_files(self._files):
            found = open_segment(self._files, name)
            if found is None:
                continue
            segment, scan = found
            for offset, reason in scan.damaged:
                self.damaged_records += 1
                log.warning("%s: %s at %d: %s", self._label, name, offset, reason)
            self._segments[segment.seq] = segment
            self._next_lsn = max(self._next_lsn, segment.first_lsn)
            if scan.entries.size:
                last = int(scan.entries["record"]["lsn"].max())
                self._next_lsn = max(self._next_lsn, last + 1)

    def _open_for_appends(self) -> Segment:
        """The newest unsealed segment, made ready for appends; or a new one. Older unsealed
        segments (a node that died mid-roll) are sealed now."""
        unsealed = sorted(seq for seq, seg in self._segments.items() if not seg.sealed)
        for seq in unsealed:
            segment = self._segments[seq]
            segment.file.start_writes()
            segment.file.truncate(segment.size)  # cut a torn tail off
            if seq != unsealed[-1]:
                segment.seal(self._syncs)
        if unsealed:
            segment = self._segments[unsealed[-1]]
            segment.reserve_through(segment.size)  # the blocks it had ahead before the restart
            return segment
        return self._new_segment()

    def entry_tables(self) -> list[tuple[int, np.ndarray]]:
        """(segment seq, ``ENTRY_DTYPE`` entries) of every segment holding records, in sequence
        order: what a replay applies (``ShardIndex.replay``)."""
        tables = []
        for seq in sorted(self._segments):
            entries = self._segments[seq].all_entries()
            if entries.size:
                tables.append((seq, entries))
        return tables

    # --- appends ---------------------------------------------------------------------------

    @property
    def _syncs(self) -> bool:
        return self._fsync != "never"

    def take_lsns(self, count: int) -> int:
        """The first of ``count`` fresh LSNs (the records' headers carry them)."""
        first = self._next_lsn
        self._next_lsn += count
        return first

    @property
    def next_lsn(self) -> int:
        return self._next_lsn

    def append(self, heads: bytes | bytearray, bodies: Sequence[object]) -> tuple[int, list[int]]:
        """Append records (``heads``: their 96-byte headers end to end; ``bodies``: one each,
        empty for a mark) in one write; returns (segment seq, each record's offset).

        The open segment is sealed and replaced first when the batch would take it past
        ``segment_bytes`` (a batch larger than that gets a segment of its own); ``AppendFailed``
        when the write fails (nothing of the batch stays in the log)."""
        lengths = np.frombuffer(heads, RECORD_DTYPE)["body_len"].astype(np.int64)
        sizes = lengths + RECORD_BYTES
        start = self._make_room(int(sizes.sum()))
        offsets = (start + np.cumsum(sizes) - sizes).tolist()
        segment = self._open
        parts: list[object]
        if _one_row_each(bodies, lengths):
            parts = [_records(heads, bodies)]  # type: ignore[arg-type]
        else:
            parts = _interleaved(heads, bodies, lengths.tolist())
        try:
            segment.append(
                parts,
                [entries_for(offsets, heads, bodies)],
                self._syncs,
            )
        except OSError as error:
            raise AppendFailed(str(error)) from error
        for seq, offset, length in self._cached.appended(segment.seq, start, segment.size - start):
            self._drop_cached(seq, offset, length)
        return segment.seq, offsets

    def _drop_cached(self, seq: int, offset: int, length: int) -> None:
        """Let the page cache drop an old append's pages (advice: failing it is no error)."""
        segment = self._segments.get(seq)
        if segment is None:  # removed since (compaction): its pages went with it
            return
        try:
            segment.file.drop_cached(offset, length)
        except OSError as error:  # the kernel will evict them some time
            log.debug("%s: dropping cached pages of %d: %s", self._label, seq, error)

    def _make_room(self, size: int) -> int:
        """Where a batch of ``size`` bytes goes in the open segment (rolled first if need be)."""
        if self._open.size > SEGMENT_HEADER_BYTES and self._open.size + size > self._segment_bytes:
            self._open.seal(self._syncs)
            self._open = self._new_segment()
        return self._open.size

    def _new_segment(self) -> Segment:
        seq = max(self._segments, default=0) + 1
        segment = Segment.create(self._files, seq, self._next_lsn, self._clock.now())
        if self._fsync == "always":
            self._files.sync()
        self._segments[seq] = segment
        return segment

    # --- reads and what is there -----------------------------------------------------------

    def read(self, seq: int, offset: int, length: int, into: memoryview) -> bool:
        """Read ``length`` bytes of segment ``seq`` at ``offset``; False when the segment is
        gone or shorter."""
        segment = self._segments.get(seq)
        return segment is not None and segment.read(offset, length, into)

    def reader(self, seq: int) -> int | None:
        """A new read descriptor of segment ``seq`` (the caller closes it), None when the
        segment is gone or has none (``LogFile.reader``)."""
        segment = self._segments.get(seq)
        return None if segment is None else segment.file.reader()

    def segment(self, seq: int) -> Segment | None:
        return self._segments.get(seq)

    @property
    def open_seq(self) -> int:
        return self._open.seq

    def sealed(self) -> dict[int, int]:
        """Segment seq -> file size of every sealed segment (the ones compaction may empty)."""
        return {
            seq: segment.size
            for seq, segment in self._segments.items()
            if segment.sealed and segment is not self._open
        }

    def entries_except(self, seq: int) -> list[np.ndarray]:
        """The entries of every segment but ``seq``."""
        return [s.all_entries() for q, s in self._segments.items() if q != seq]

    def where(self, seq: int) -> str:
        """Segment ``seq``'s file, as a path."""
        return self._files.where(segment_name(seq))

    def __len__(self) -> int:
        return len(self._segments)

    def disk_bytes(self) -> int:
        """The segments' sizes, footers and dead records included."""
        return sum(segment.size for segment in self._segments.values())

    def allocated_bytes(self) -> int:
        """What the segment files take on the filesystem (its blocks)."""
        return sum(segment.file.allocated_bytes() for segment in self._segments.values())

    # --- removal ---------------------------------------------------------------------------

    def remove(self, seq: int) -> None:
        """Remove sealed segment ``seq`` (compaction moved whatever was live out of it)."""
        if seq == self._open.seq:
            raise ValueError(f"segment {seq} is the open one")
        segment = self._segments.pop(seq)
        segment.close()
        self._files.remove(segment_name(seq))
        if self._fsync == "always":
            self._files.sync()

    def close(self) -> None:
        """Close every file (the open segment stays unsealed: a restart scans its tail)."""
        for segment in self._segments.values():
            segment.close()


def _one_row_each(bodies: Sequence[object], lengths: np.ndarray) -> bool:
    """Whether ``bodies`` is one 2-D array whose rows are the records' bodies, whole."""
    if not isinstance(bodies, np.ndarray) or bodies.ndim != 2 or not bodies.shape[1]:
        return False
    return bool((lengths == bodies.shape[1]).all())


def _records(heads: bytes | bytearray, rows: np.ndarray) -> np.ndarray:
    """Records whose bodies are the rows of one 2-D array (a client's put batch) as one buffer,
    each header before its row: one copy of the batch (~0.1 ms for 64 shards of 11 KiB, while
    its bytes are still in the cache from the receive) instead of a list of two buffers a
    record, which the write walked in Python (~0.3 ms a batch)."""
    count, width = rows.shape
    out = np.empty((count, RECORD_BYTES + width), np.uint8)
    out[:, :RECORD_BYTES] = np.frombuffer(heads, np.uint8).reshape(count, RECORD_BYTES)
    out[:, RECORD_BYTES:] = rows
    return out


def _interleaved(
    heads: bytes | bytearray, bodies: Sequence[object], lengths: list[int]
) -> list[object]:
    """Headers and bodies in file order, as few buffers as that takes: consecutive headers of
    records without a body (marks) go as one slice of ``heads``."""
    view = memoryview(heads)
    if not any(lengths):  # marks only (a commit's or a delete's batch): the headers, whole
        return [view]
    parts: list[object] = []
    run = 0  # where the headers not yet in ``parts`` start
    for n, (body, length) in enumerate(zip(bodies, lengths, strict=True)):
        if length:
            parts += (view[run : (n + 1) * RECORD_BYTES], body)
            run = (n + 1) * RECORD_BYTES
    if run < len(view):
        parts.append(view[run:])
    return parts
