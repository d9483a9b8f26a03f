"""The on-disk log of a storage node: segment files of records, and the one module that owns
their layout.

Why a log (issue 17): a node kept each shard in its own ~11 KiB file, written under
``pending/`` and renamed into ``shards/`` (12 files per block: a node holding 2 TB would hold
~180 million files), and a batch of 64 shards cost 64 creates, 64 renames and a ``syncfs``. Here
a batch is one ``writev`` at the end of the node's current segment and at most one
``fdatasync``; a segment is sealed at ``segment_bytes`` (64 MiB by default), so 100,000 shards
make tens of files.

Segment file ``segments/<seq:016x>.seg``::

    segment header (64 B)   magic b"KVSEGv01", seq u64, first LSN u64, created f64,
                            zero padding, xxh3-64 of bytes [0, 56)
    record, record, ...     appended; nothing is ever rewritten in place
    footer (sealed only)    one ENTRY (120 B) per record, then a 32-byte trailer:
                            magic b"KVFOOTv1", entries u64, footer offset u64, xxh3-64 of the
                            entries; a segment without a valid trailer is the open one (or was,
                            when its node died) and is scanned record by record

Record = a 96-byte header, then ``body_len`` bytes (a codec shard for ``SHARD``, none for the
others)::

    offset size field
         0    4 magic          b"KVRC"
         4    1 kind           1 SHARD, 2 COMMIT, 3 DELETE
         5    1 class id       traffic class of the block (SHARD)
         6    1 flags          bit 0: committed (SHARD: a put committed as it was written, or
                               a compaction copy of a committed shard)
         7    1 shard index    stripe position (SHARD)
         8    8 lsn            log sequence number: the identity of this record's event
        16    8 token          the put that wrote the shard (SHARD, COMMIT)
        24    8 created        f64, the block's creation time (writer's clock)
        32    8 stamp          f64, when this node received the shard
        40    4 body_len       u32
        44    4 reserved       zero
        48    8 target lsn     COMMIT / DELETE: the lsn of the SHARD record they act on
        56   32 key            the block key
        88    8 checksum       xxh3-64 of bytes [0, 88)

One shard format: the body is the codec shard (``kvstore.ec.shard``) byte for byte, with its
own header, checksum and the tier's one payload hash; a record header only frames it in the log
and carries what a node needs to rebuild its index (stripe position, class, times, writer). No
second payload hash exists.

Record identity and order: every record gets the next LSN of its node. A compaction copy keeps
the LSN of the record it copies (an LSN names an event, not a place), so a node that restarts
replays every record it finds in LSN order (ties: the newer segment last) and reaches the state
it had, whatever compaction moved where (``segmentlog.py`` reads the segments back,
``shardindex.py`` applies their records). An LSN above ``MAX_LSN`` is never written: a record
or segment header claiming one is treated as damage and left out (a crafted one would otherwise
move the node's next LSN past the u64 field, and no append could follow).

Torn and corrupt records: a record whose header checksum fails ends the valid prefix of an open
segment's scan; the scan then looks for the next valid header (a corrupt span in the middle
loses only what it covers) and the file is cut back to the end of the last valid record, so new
appends never sit behind garbage. A body that fails its codec checksum is reported as corrupt and
never indexed. In a sealed segment the footer lists the records; their bodies are verified when
read (by the reader, end to end) and by scrub.

File access goes through ``logfiles.py`` (disk, or memory in the log's unit tests).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import xxhash

from kvstore.blockstore.logfiles import DiskFiles, LogFile, LogFiles
from kvstore.ec.shard import HEADER_BYTES as SHARD_HEADER_BYTES
from kvstore.ec.shard import PAYLOAD_HASH
from kvstore.errors import CorruptShard
from kvstore.privatefs import PrivateDir

_sums: ModuleType | None
try:  # the headers' checksums in one C call; without a compiler at install, a loop serves
    from kvstore.blockstore import _shardsums as _sums
except ImportError:  # pragma: no cover - the CI machine builds it
    _sums = None

log = logging.getLogger(__name__)

SHARD, COMMIT, DELETE = 1, 2, 3
KINDS = (SHARD, COMMIT, DELETE)
FLAG_COMMITTED = 1
#: The highest LSN a node uses (LSNs count up from 1: at a billion records a second this lasts
#: ~290 years). A record or segment header above it, checksum or not, is damage: replaying it
#: would push the node's next LSN past what the u64 field holds, and every append would fail.
MAX_LSN = 2**63 - 1

SEGMENT_MAGIC = b"KVSEGv01"
SEGMENT_HEADER = struct.Struct("<8sQQd24s8s")
SEGMENT_HEADER_BYTES = SEGMENT_HEADER.size
assert SEGMENT_HEADER_BYTES == 64
RECORD_MAGIC = b"KVRC"
RECORD = struct.Struct("<4sBBBBQQddII Q32s8s")
RECORD_BYTES = RECORD.size
assert RECORD_BYTES == 96
_COVERED = 88
TRAILER_MAGIC = b"KVFOOTv1"
TRAILER = struct.Struct("<8sQQ8s")
TRAILER_BYTES = TRAILER.size
#: Bytes of blocks an open segment has allocated ahead of its appends at a time (``reserve``):
#: about ten 64-block puts' shards on a node, returned at seal.
RESERVE_AHEAD_BYTES = 8 << 20

#: A record header as a numpy row (the same 96 bytes as ``RECORD``).
RECORD_DTYPE = np.dtype(
    [
        ("magic", "V4"),
        ("kind", "u1"),
        ("class_id", "u1"),
        ("flags", "u1"),
        ("index", "u1"),
        ("lsn", "<u8"),
        ("token", "<u8"),
        ("created", "<f8"),
        ("stamp", "<f8"),
        ("body_len", "<u4"),
        ("reserved", "<u4"),
        ("target_lsn", "<u8"),
        ("key", "V32"),
        ("checksum", "V8"),
    ]
)
assert RECORD_DTYPE.itemsize == RECORD_BYTES
#: One record as a footer lists it (and as a scan finds it): where it starts, its header, and
#: from a SHARD body the two codec fields an index needs (payload length and hash).
ENTRY_DTYPE = np.dtype(
    [("offset", "<u8"), ("record", RECORD_DTYPE), ("payload_len", "<u8"), ("payload_hash", "V8")]
)
assert ENTRY_DTYPE.itemsize == 120
_PAYLOAD_LEN = slice(16, 24)  # in a codec shard's header
assert PAYLOAD_HASH.start == _PAYLOAD_LEN.stop  # entries_for reads both in one slice


def segment_name(seq: int) -> str:
    return f"{seq:016x}.seg"


def seq_of(name: str) -> int | None:
    stem, dot, ext = name.partition(".")
    if ext != "seg" or not dot or len(stem) != 16:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


def record_header(
    kind: int,
    lsn: int,
    key: bytes,
    *,
    token: int = 0,
    class_id: int = 0,
    index: int = 0,
    flags: int = 0,
    created: float = 0.0,
    stamp: float = 0.0,
    body_len: int = 0,
    target_lsn: int = 0,
) -> bytes:
    head = RECORD.pack(
        RECORD_MAGIC,
        kind,
        class_id,
        flags,
        index,
        lsn,
        token,
        created,
        stamp,
        body_len,
        0,
        target_lsn,
        key,
        bytes(8),
    )
    return head[:_COVERED] + xxhash.xxh3_64_digest(head[:_COVERED])


def record_headers(
    kind: int,
    first_lsn: int,
    keys: Sequence[bytes],
    **fields: Sequence[float] | np.ndarray | float,
) -> bytearray:
    """The headers of ``len(keys)`` records of one kind with LSNs from ``first_lsn`` on, end to
    end (96 bytes each, checksums filled in): a batch built at once rather than record by record.
    ``fields``: any of the record's numeric fields (``token``, ``class_id``, ``flags``,
    ``index``, ``created``, ``stamp``, ``body_len``, ``target_lsn``), per record or one value."""
    count = len(keys)
    heads = np.zeros(count, RECORD_DTYPE)
    heads["magic"] = np.frombuffer(RECORD_MAGIC, "V4")[0]
    heads["kind"] = kind
    heads["lsn"] = np.arange(first_lsn, first_lsn + count, dtype=np.uint64)
    heads["key"] = np.frombuffer(b"".join(keys), "V32")
    for name, values in fields.items():
        heads[name] = values
    rows = heads.view(np.uint8).reshape(count, RECORD_BYTES)
    rows[:, _COVERED:] = np.frombuffer(_head_sums(rows), np.uint8).reshape(count, 8)
    return bytearray(rows.tobytes())


def _head_sums(heads: np.ndarray) -> bytes:
    """The checksum of each record header in ``heads`` ((n, 96) uint8, C-contiguous): xxh3-64
    of its first 88 bytes, big-endian, 8 bytes a header, end to end. One C call
    (``_shardsums.row_sums``) for a batch; a hash call a header cost a put ~30 us a node."""
    if _sums is not None:
        return _sums.row_sums(heads, RECORD_BYTES, 0, _COVERED)
    flat = memoryview(heads.reshape(-1))  # type: ignore[arg-type]  # numpy's stubs
    digest = xxhash.xxh3_64_digest
    return b"".join([digest(flat[at : at + _COVERED]) for at in range(0, len(flat), RECORD_BYTES)])


def entries_for(
    offsets: Sequence[int], heads: bytes | bytearray, bodies: Sequence[object]
) -> bytes:
    """The footer entries of the records at ``offsets`` with headers ``heads`` (96 bytes each,
    end to end) and ``bodies`` (a SHARD record's codec shard, or at least its first 64 bytes;
    anything for the others): each header, and a shard's payload length and hash."""
    records = np.frombuffer(heads, RECORD_DTYPE)
    shard = _shard_rows(records)
    if isinstance(bodies, np.ndarray) and bodies.ndim == 2 and shard.all():
        # A node's put batch, one shard a row: the fields of every header in one slice.
        fields = bodies[:, _PAYLOAD_LEN.start : PAYLOAD_HASH.stop].tobytes()
        return _entries(offsets, records, shard, fields)
    fields = b"".join(
        [
            bytes(memoryview(body)[_PAYLOAD_LEN.start : PAYLOAD_HASH.stop])  # type: ignore[arg-type]
            for body, is_shard in zip(bodies, shard.tolist(), strict=True)
            if is_shard
        ]
        if shard.any()
        else []  # marks only
    )
    return _entries(offsets, records, shard, fields)


def _shard_rows(records: np.ndarray) -> np.ndarray:
    """Which records are SHARDs with a body long enough to hold a codec header."""
    return (records["kind"] == SHARD) & (records["body_len"] >= SHARD_HEADER_BYTES)


def _entries(
    offsets: Sequence[int] | np.ndarray, records: np.ndarray, shard: np.ndarray, fields: bytes
) -> bytes:
    """The one entry builder: ``fields`` is each SHARD row's payload length and hash (16 bytes
    from its codec header), end to end, in row order."""
    entries = np.zeros(len(records), ENTRY_DTYPE)
    if not len(records):
        return entries.tobytes()
    entries["offset"] = offsets
    entries["record"] = records
    found = np.frombuffer(fields, np.dtype([("len", "<u8"), ("hash", "V8")]))
    entries["payload_len"][shard] = found["len"]
    entries["payload_hash"][shard] = found["hash"]
    return entries.tobytes()


def header_ok(head: bytes | memoryview) -> bool:
    """Whether ``head`` (96 bytes) is a record header with a good checksum and kind."""
    return (
        len(head) == RECORD_BYTES
        and bytes(head[:4]) == RECORD_MAGIC
        and head[4] in KINDS
        and xxhash.xxh3_64_digest(head[:_COVERED]) == bytes(head[_COVERED:])
    )


@dataclass
class Scan:
    """What reading one segment found."""

    entries: np.ndarray  # ENTRY_DTYPE, in file order
    #: Where the valid records end (appends continue here); the file's size when sealed.
    end: int
    sealed: bool
    #: (offset, reason) of spans and bodies found damaged.
    damaged: list[tuple[int, str]]


class Segment:
    """One segment file (``logfiles.LogFile``): readable always, written while it is the open
    one."""

    def __init__(self, seq: int, first_lsn: int, file: LogFile, size: int) -> None:
        self.seq = seq
        self.first_lsn = first_lsn
        self.file = file
        self.size = size
        self.sealed = False
        #: Where the blocks allocated ahead of the appends end (``reserve_through``): 0 until
        #: this opening's first append.
        self.reserved_end = 0
        #: Entries of the records appended since it was opened (open segment), joined at seal.
        self.pending_entries: list[bytes] = []
        self.entries: np.ndarray = np.zeros(0, ENTRY_DTYPE)

    @classmethod
    def create(cls, files: LogFiles, seq: int, first_lsn: int, now: float) -> Segment:
        name = segment_name(seq)
        file = files.create(name)
        head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, seq, first_lsn, now, bytes(24), bytes(8))
        head = head[:56] + xxhash.xxh3_64_digest(head[:56])
        try:
            file.write([head], 0)
        except OSError:
            file.close()
            files.remove(name)
            raise
        return cls(seq, first_lsn, file, SEGMENT_HEADER_BYTES)

    def all_entries(self) -> np.ndarray:
        if self.pending_entries:
            joined = np.frombuffer(b"".join(self.pending_entries), ENTRY_DTYPE)
            self.entries = np.concatenate([self.entries, joined]) if self.entries.size else joined
            self.pending_entries = []
        return self.entries

    def append(self, parts: Sequence[object], entries: list[bytes], sync: bool) -> None:
        """Write ``parts`` (record headers and bodies) at the end; on any failure the file is cut
        back to where it was, so a failed batch leaves no record behind."""
        start = self.size
        total = sum(memoryview(p).nbytes for p in parts)  # type: ignore[arg-type, misc]
        self.reserve_through(start + total)
        try:
            self.file.write(parts, start)
            if sync:
                self.file.sync()
        except OSError:
            try:
                self.file.truncate(start)
            except OSError:
                log.exception("segment %d: could not cut a failed append back", self.seq)
            raise
        self.size = start + total
        self.pending_entries.extend(entries)

    def reserve_through(self, end: int) -> None:
        """Have the file's blocks allocated up to the first multiple of ``RESERVE_AHEAD_BYTES``
        at or past ``end`` (``LogFile.reserve``). Each flush then writes into blocks the file
        has, where a file growing by appends has them allocated at every flush (a put's write
        and ``fdatasync`` cost ~30 % less CPU). On a fixed grid, so that a reopened log
        holds the blocks it held before."""
        if end <= self.reserved_end:
            return
        grid = -(-end // RESERVE_AHEAD_BYTES) * RESERVE_AHEAD_BYTES
        self.file.reserve(self.size, grid - self.size)
        self.reserved_end = grid

    def seal(self, sync: bool) -> None:
        """Write the footer and stop appending (the file is closed for writes)."""
        entries = self.all_entries()
        body = entries.tobytes()
        trailer = TRAILER.pack(TRAILER_MAGIC, len(entries), self.size, xxhash.xxh3_64_digest(body))
        self.file.write([body, trailer], self.size)
        end = self.size + len(body) + len(trailer)
        if self.reserved_end > end:
            self.file.truncate(end)  # give back the blocks allocated ahead and not written
        if sync:
            self.file.sync()
        self.file.end_writes()
        self.size = end
        self.sealed = True

    def read(self, offset: int, length: int, into: memoryview) -> bool:
        """Read ``length`` bytes at ``offset`` into ``into``; False when the file is short."""
        return self.file.read_into(offset, into[:length]) == length

    def close(self) -> None:
        self.file.close()


def open_segment(files: LogFiles, name: str) -> tuple[Segment, Scan] | None:
    """Open an existing segment file and find its records (None: not a segment, logged).
    Records with an LSN above ``MAX_LSN`` are reported damaged and left out."""
    seq = seq_of(name)
    if seq is None:
        return None
    file = files.open(name)
    try:
        size = file.size()
        head = file.read(0, SEGMENT_HEADER_BYTES)
        if len(head) < SEGMENT_HEADER_BYTES:
            raise CorruptShard("shorter than its header")
        magic, stored_seq, first_lsn, _created, _pad, checksum = SEGMENT_HEADER.unpack(head)
        if (
            magic != SEGMENT_MAGIC
            or stored_seq != seq
            or checksum != xxhash.xxh3_64_digest(head[:56])
        ):
            raise CorruptShard("bad segment header")
        if first_lsn > MAX_LSN:
            raise CorruptShard(f"segment header names LSN {first_lsn}, above the LSN space")
        scan = _read_footer(file, size) or _scan(file, size)
    except (OSError, CorruptShard) as error:
        file.close()
        log.warning("%s is not a usable segment (%s); left alone", files.where(name), error)
        return None
    _drop_beyond_lsn_space(scan)
    segment = Segment(seq, first_lsn, file, scan.end)
    segment.entries = scan.entries
    segment.sealed = scan.sealed
    return segment, scan


def _drop_beyond_lsn_space(scan: Scan) -> None:
    """Leave out of ``scan`` the records whose LSN is above ``MAX_LSN`` (reported damaged)."""
    beyond = scan.entries["record"]["lsn"] > MAX_LSN
    if beyond.any():
        for offset in scan.entries["offset"][beyond].tolist():
            scan.damaged.append((offset, "record LSN above the LSN space (left out)"))
        scan.entries = scan.entries[~beyond]


def _read_footer(file: LogFile, size: int) -> Scan | None:
    if size < SEGMENT_HEADER_BYTES + TRAILER_BYTES:
        return None
    trailer = file.read(size - TRAILER_BYTES, TRAILER_BYTES)
    magic, count, footer_at, checksum = TRAILER.unpack(trailer)
    footer_bytes = count * ENTRY_DTYPE.itemsize
    if magic != TRAILER_MAGIC or footer_at + footer_bytes + TRAILER_BYTES != size:
        return None
    body = file.read(footer_at, footer_bytes)
    if len(body) != footer_bytes or xxhash.xxh3_64_digest(body) != checksum:
        return None
    return Scan(np.frombuffer(body, ENTRY_DTYPE).copy(), size, True, [])


def _scan(file: LogFile, size: int) -> Scan:
    """Every valid record of a segment without a footer (headers checked, see the module doc).

    Bodies are not verified here: every reader checks what it decodes end to end and scrub
    checks every shard in time, so a damaged body is an erasure, never wrong bytes. Verifying
    them, and building entries one by one, made a restart of 200,000 shards take ~6 s; the
    headers are framed in a light loop and checked in bulk (``_framed_run``), and one record at
    a time only where a run stops (damage, a torn tail).
    """
    damaged: list[tuple[int, str]] = []
    runs: list[tuple[np.ndarray, np.ndarray]] = []
    end = SEGMENT_HEADER_BYTES
    raw = file.read(0, size)  # the one unsealed segment, at most ~segment_bytes
    data = np.frombuffer(raw, np.uint8)
    offset = SEGMENT_HEADER_BYTES
    while offset + RECORD_BYTES <= len(raw):
        offsets, heads, after = _framed_run(raw, data, offset)
        if len(offsets):
            runs.append((offsets, heads))
            offset = end = after
            continue
        if not header_ok(raw[offset : offset + RECORD_BYTES]):
            found = _resync(raw, offset + 1)
            damaged.append((offset, "bad record header" if found else "torn tail"))
            if found is None:
                break
            offset = found
            continue
        # A good header whose body runs past the end of the file: the torn last append.
        damaged.append((offset, "torn tail (record runs past the end)"))
        break
    offsets = np.concatenate([o for o, _ in runs]) if runs else np.zeros(0, np.int64)
    records = (
        np.concatenate([h for _, h in runs]) if runs else np.zeros((0, RECORD_BYTES), np.uint8)
    ).view(RECORD_DTYPE)[:, 0]
    shard = _shard_rows(records)
    at = offsets[shard] + RECORD_BYTES + _PAYLOAD_LEN.start
    fields = _rows(data, at, PAYLOAD_HASH.stop - _PAYLOAD_LEN.start).tobytes()
    entries = np.frombuffer(_entries(offsets, records, shard, fields), ENTRY_DTYPE).copy()
    return Scan(entries, end, False, damaged)


def _rows(data: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """The ``width`` bytes at each of ``starts`` in ``data``, one row each (one gather)."""
    if len(data) < width:
        return np.zeros((0, width), np.uint8)
    return np.lib.stride_tricks.sliding_window_view(data, width)[starts]


def _framed_run(raw: bytes, data: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The good records that follow one another from ``start`` (possibly none): their offsets,
    their headers (rows of 96 bytes), and where the last of them ends.

    Framing follows each header's body length after a magic check only; the headers found are
    then checked together (kind, checksum) and the run is cut before the first that fails, so
    a garbage length after damage frames nothing that is kept."""
    framed: list[int] = []
    offset, limit = start, len(raw)
    body_len = struct.Struct("<I").unpack_from
    while offset + RECORD_BYTES <= limit and raw[offset : offset + 4] == RECORD_MAGIC:
        after = offset + RECORD_BYTES + body_len(raw, offset + 40)[0]
        if after > limit:
            break
        framed.append(offset)
        offset = after
    offsets = np.asarray(framed, np.int64)
    heads = np.ascontiguousarray(_rows(data, offsets, RECORD_BYTES))
    good = np.frombuffer(_head_sums(heads), "<u8") == heads[:, _COVERED:].copy().view("<u8")[:, 0]
    good &= np.isin(heads[:, 4], KINDS)
    keep = len(framed) if good.all() else int(np.argmin(good))
    if not keep:
        return offsets[:0], heads[:0], start
    last = framed[keep - 1]
    return offsets[:keep], heads[:keep], last + RECORD_BYTES + body_len(raw, last + 40)[0]


def _resync(raw: bytes, start: int) -> int | None:
    """The offset of the next valid record header at or after ``start``, or None."""
    position = start
    while True:
        found = raw.find(RECORD_MAGIC, position)
        if found < 0 or found + RECORD_BYTES > len(raw):
            return None
        if header_ok(raw[found : found + RECORD_BYTES]):
            return found
        position = found + 1


def segment_files(files: LogFiles) -> list[str]:
    """The names of the segment files in ``files``, in sequence order."""
    return sorted(name for name in files.names() if seq_of(name) is not None)


def find_shard_records(node_dir: str | os.PathLike[str], key: bytes) -> list[tuple[str, int, int]]:
    """The SHARD records of ``key`` in one node's segments, as (segment file, record offset,
    record bytes): live or dead, read from the files alone (no lock, nothing written). For tools
    and tests that look at a node's disk from outside its process; the node itself answers
    ``StorageNode.locate`` from its index."""
    directory = PrivateDir.open(os.path.join(node_dir, "segments"), "node_dir", check_parent=False)
    files = DiskFiles(directory)
    found: list[tuple[str, int, int]] = []
    try:
        for name in segment_files(files):
            opened = open_segment(files, name)
            if opened is None:
                continue
            segment, scan = opened
            segment.close()
            records = scan.entries["record"]
            hits = (records["kind"] == SHARD) & (records["key"] == np.frombuffer(key, "V32")[0])
            for offset, body_len in zip(
                scan.entries["offset"][hits].tolist(),
                records["body_len"][hits].tolist(),
                strict=True,
            ):
                found.append((files.where(name), offset, RECORD_BYTES + body_len))
    finally:
        directory.close()
    return found
