"""A storage node: one failure domain's shards in a log of segment files, indexed in memory.

Disk layout under ``data_dir``::

    NODE                 the node id this directory belongs to (a dir is never served as another)
    LOCK                 held (``flock``) by the one process serving the dir (``dirlock.py``)
    segments/<seq>.seg   the log (``segments.py`` owns the format): shard records, commit marks,
                         delete marks, appended; sealed segments end in a footer

Only this service's user reads or writes here: directories 0700, files 0600, the data dir and its
parent checked for owner and mode, every file reached relative to a held directory descriptor
without following symlinks (``kvstore.privatefs``).

**Commit rule.** A shard is *committed* on this node when the log holds, durably (per the fsync
policy), its SHARD record and a later COMMIT record naming that record's LSN and writer token —
or a compaction copy of it flagged committed. ``put`` appends SHARD records (pending: not
readable) and acknowledges once they are on disk; ``commit`` appends the COMMIT records and
acknowledges once they are on disk; only then is the shard readable. The writer commits only after
every node of the stripe acknowledged its put (``client.py``), so a committed shard still proves
its whole stripe was durable, which is what a meta shard's rebuild relies on (``meta.py``). A
writer killed mid-put leaves pending records only: never readable, dropped from the index after
``orphan_grace_s`` (``reclaim_orphans``), their bytes reclaimed by compaction.

**Restart.** The index is rebuilt from the segments' footers (one read each) plus a scan of the
open segment, then every record is replayed in LSN order: SHARD makes a pending entry (or a
committed one, for a compaction copy), COMMIT turns the pending entry with its LSN and token
committed (replacing an older committed shard of the key), DELETE drops the committed shard with
its LSN. Aborts write nothing: an aborted shard comes back pending and is reclaimed as an orphan.

**Dead bytes and compaction.** A record no entry points at is dead (replaced, deleted, aborted,
scrubbed out). ``compact`` rewrites the live records of sealed segments whose live share fell
under ``compact_live_fraction`` into the open segment, with their LSNs, then removes the
segment. A COMMIT or DELETE record is live while a SHARD record with its target LSN is still in
some other segment (else a restart could replay that shard without the mark that acted on it).
Reads never race a move: one thread owns the node, and a moved shard has the same bytes.

Not thread-safe: one actor thread (or the lock of its shell) owns one node.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

from kvstore.blockstore.capacity import NodeDisk, allocated_bytes
from kvstore.blockstore.config import StorageNodeConfig
from kvstore.blockstore.dirlock import DirLock
from kvstore.blockstore.placement import meta_shard_of
from kvstore.blockstore.segments import (
    COMMIT,
    DELETE,
    FLAG_COMMITTED,
    RECORD_BYTES,
    SEGMENT_HEADER_BYTES,
    SHARD,
    Segment,
    entries_for,
    header_ok,
    open_segment,
    record_header,
    record_headers,
    segment_files,
    segment_name,
)
from kvstore.blockstore.shardindex import ShardIndex
from kvstore.clock import Clock, SystemClock
from kvstore.ec.shard import parse_shard
from kvstore.errors import ConfigError, CorruptShard, InvalidArgument, StoreError
from kvstore.keys import KEY_BYTES, BlockKey, check_key
from kvstore.privatefs import PrivateDir

log = logging.getLogger(__name__)

_NODE = "NODE"

MANIFEST_SCHEMA = pa.schema(
    [
        ("key", pa.binary(KEY_BYTES)),
        ("shard_index", pa.uint8()),
        ("payload_len", pa.int64()),
        ("class_id", pa.uint8()),
        ("created", pa.float64()),
        ("file_bytes", pa.int64()),
        ("stamp", pa.float64()),
        ("payload_hash", pa.binary(8)),
    ],
    metadata={"format": "kvstore.node_manifest.v2"},
)


class StorageNode:
    """The shards of one failure domain."""

    def __init__(
        self,
        node_id: int,
        data_dir: str | os.PathLike[str],
        config: StorageNodeConfig | None = None,
        clock: Clock | None = None,
        lock_timeout_s: float = 30.0,
    ) -> None:
        """``lock_timeout_s``: how long to wait for a previous process serving ``data_dir``
        to exit (``dirlock.py``)."""
        if not isinstance(node_id, int) or isinstance(node_id, bool) or node_id < 0:
            raise InvalidArgument("node_id", f"must be an integer >= 0, got {node_id!r}")
        self.node_id = node_id
        self.config = config or StorageNodeConfig()
        self._clock = clock or SystemClock()
        self._root = PrivateDir.open(data_dir, "data_dir", check_parent=True)
        self._lock = DirLock.take(self._root, f"storage node {node_id}", lock_timeout_s)
        self._check_owner()
        self._segdir = self._root.subdir("segments")
        self._disk = NodeDisk.of(
            self._root.fd, self.config.disk_reserve_fraction, self.config.disk_reserve_bytes
        )
        self._index = ShardIndex()
        self._committed = self._index.committed
        self._pending = self._index.pending
        self._live = self._index.live
        self._segments: dict[int, Segment] = {}
        self._next_lsn = 1
        #: (key, shard index) of committed shards found damaged; the next scrub reports them.
        self._damaged: list[tuple[bytes, int]] = []
        self._scrub_cursor = 0  # where the next scrub pass starts, round robin
        self._compacting: tuple[int, int] | None = None  # (segment seq, next entry) of a move
        self._counters = {
            "puts": 0,
            "put_refused": 0,
            "commits": 0,
            "gets": 0,
            "get_missing": 0,
            "deletes": 0,
            "corrupt_found": 0,
            "orphans_reclaimed": 0,
            "bytes_written": 0,
            "bytes_read": 0,
            "segments_compacted": 0,
            "bytes_compacted": 0,
            "damaged_records": 0,
        }
        self._replay()
        self._open = self._open_segment_for_appends()

    # --- start-up --------------------------------------------------------------------------

    def _check_owner(self) -> None:
        try:
            owner: str | None = self._root.read(_NODE).decode().strip()
        except FileNotFoundError:
            owner = None
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(
                "data_dir", f"{self._root.path / _NODE} is unreadable: {error}"
            ) from None
        if owner is None:
            self._root.write_atomically(_NODE, [f"{self.node_id}\n".encode()], sync=True)
        elif owner != str(self.node_id):
            raise ConfigError(
                "data_dir",
                f"{self._root.path} belongs to storage node {owner}, not {self.node_id}",
            )
        if self._root.is_dir("shards"):
            log.warning(
                "node %d: %s/shards holds shard files of the layout before the segment log; "
                "they are not served (a cache: the blocks are misses) and may be removed",
                self.node_id,
                self._root.path,
            )

    def _replay(self) -> None:
        """Rebuild the index from the log (see the module doc)."""
        tables = []
        for name in sorted(segment_files(self._segdir)):
            found = open_segment(self._segdir, name)
            if found is None:
                continue
            segment, scan = found
            for offset, reason in scan.damaged:
                self._counters["damaged_records"] += 1
                log.warning("node %d: %s at %d: %s", self.node_id, name, offset, reason)
            self._segments[segment.seq] = segment
            self._live[segment.seq] = 0
            self._next_lsn = max(self._next_lsn, segment.first_lsn)
            if scan.entries.size:
                tables.append((segment.seq, scan.entries))
        if tables:
            self._next_lsn = max(self._next_lsn, self._index.replay(tables))

    def _open_segment_for_appends(self) -> Segment:
        """The newest unsealed segment, made ready for appends; or a new one. Older unsealed
        segments (a node that died mid-roll) are sealed now."""
        unsealed = sorted(seq for seq, seg in self._segments.items() if not seg.sealed)
        for seq in unsealed:
            segment = self._segments[seq]
            segment.write_fd = self._segdir.open_write(segment_name(seq))
            os.ftruncate(segment.write_fd, segment.size)  # cut a torn tail off
            if seq != unsealed[-1]:
                segment.seal(self._syncs)
        if unsealed:
            return self._segments[unsealed[-1]]
        return self._new_segment()

    def _new_segment(self) -> Segment:
        seq = max(self._segments, default=0) + 1
        segment = Segment.create(self._segdir, seq, self._next_lsn, self._clock.now())
        if self.config.fsync == "always":
            self._segdir.fsync()
        self._segments[seq] = segment
        self._live[seq] = 0
        return segment

    @property
    def _syncs(self) -> bool:
        return self.config.fsync != "never"

    def _take_lsns(self, count: int) -> int:
        first = self._next_lsn
        self._next_lsn += count
        return first

    def _start_batch(self, size: int) -> int:
        """Where a batch of ``size`` bytes goes in the open segment: sealed and replaced first
        when the batch would take it past ``segment_bytes`` (a batch larger than that gets a
        segment of its own)."""
        if (
            self._open.size > SEGMENT_HEADER_BYTES
            and self._open.size + size > self.config.segment_bytes
        ):
            self._open.seal(self._syncs)
            self._open = self._new_segment()
        return self._open.size

    # --- write path ------------------------------------------------------------------------

    def put(
        self,
        token: int,
        keys: Sequence[bytes],
        shards: Sequence[np.ndarray],
        class_ids: Sequence[int],
        created: Sequence[float],
    ) -> list[bool]:
        """Append shards as *pending* under writer ``token``; True per durably written shard.

        A shard is refused (False) when it fails its checksum, does not belong to its key, or
        the node is full. Nothing becomes readable before ``commit``. The batch is one append
        (headers built at once) and at most one flush.
        """
        count = len(keys)
        for name, values in (("shards", shards), ("class_ids", class_ids), ("created", created)):
            if len(values) != count:
                raise InvalidArgument(name, f"has {len(values)} entries for {count} keys")
        now = self._clock.now()
        room = self._room()
        positions: list[int] = []
        indices: list[int] = []
        digests: list[int] = []
        lengths: list[int] = []
        payload_lens: list[int] = []
        size = 0
        for position, (key, shard) in enumerate(zip(keys, shards, strict=True)):
            key = check_key(key)
            try:
                parsed = parse_shard(shard)
                if parsed.key != key:
                    raise CorruptShard(f"shard belongs to another block than {key.hex()[:16]}")
            except CorruptShard as error:
                log.warning("node %d: refusing shard: %s", self.node_id, error)
                continue
            record = RECORD_BYTES + parsed.shard_len
            if size + record > room:
                continue
            size += record
            positions.append(position)
            indices.append(parsed.index)
            lengths.append(parsed.shard_len)
            payload_lens.append(parsed.payload_len)
            digests.append(parsed.payload_hash)
        results = [False] * count
        self._counters["put_refused"] += count - len(positions)
        if not positions:
            return results
        chosen = [bytes(keys[p]) for p in positions]
        bodies = [shards[p] for p in positions]
        born = np.asarray(created, np.float64)[positions]
        kinds = np.asarray(class_ids, np.int64)[positions]
        first_lsn = self._take_lsns(len(positions))
        heads = record_headers(
            SHARD,
            first_lsn,
            chosen,
            token=token,
            class_id=kinds,
            index=indices,
            created=born,
            stamp=now,
            body_len=lengths,
        )
        start = self._start_batch(size)
        offsets = (start + np.cumsum([0, *(RECORD_BYTES + n for n in lengths[:-1])])).tolist()
        view = memoryview(heads)
        parts: list[object] = []
        for n, body in enumerate(bodies):
            parts += (view[n * RECORD_BYTES : (n + 1) * RECORD_BYTES], body)
        try:
            segment = self._open
            segment.append(parts, [entries_for(offsets, heads, bodies)], self._syncs)
        except OSError as error:
            log.warning("node %d: appending %d shards failed: %s", self.node_id, len(chosen), error)
            self._counters["put_refused"] += len(chosen)
            return results
        rows = self._index.add_many(
            len(chosen),
            seg=segment.seq,
            offset=offsets,
            body_len=lengths,
            index=indices,
            class_id=kinds,
            created=born,
            stamp=now,
            lsn=np.arange(first_lsn, first_lsn + len(chosen), dtype=np.uint64),
            payload_len=payload_lens,
            payload_hash=[_raw_word(d) for d in digests],
        )
        pending = self._pending
        for position, key, row in zip(positions, chosen, rows, strict=True):
            previous = pending.pop((key, token), None)  # a retried put replaces its shard
            if previous is not None:
                self._index.drop(previous)
            pending[(key, token)] = row
            results[position] = True
        self._live[segment.seq] += size
        self._counters["puts"] += len(chosen)
        self._counters["bytes_written"] += size
        return results

    def _room(self) -> int:
        """Bytes this node may still add: up to its set capacity, which counts what the blocks
        take (live records, as the GC does: ``capacity.py``), or what the disk has beyond its
        reserve."""
        if self.config.capacity_bytes is not None:
            return self.config.capacity_bytes - sum(self._live.values())
        return self._disk.headroom(self._root.fd)

    def _disk_bytes(self) -> int:
        return sum(segment.size for segment in self._segments.values())

    def _marks(self, kind: int, targets: list[tuple[bytes, int, int]]) -> bool:
        """Append COMMIT or DELETE records for ``targets`` (key, token, target lsn) in one
        write; False (logged) when the write failed."""
        if not targets:
            return True
        keys, tokens, lsns = zip(*targets, strict=True)
        size = RECORD_BYTES * len(targets)
        heads = record_headers(
            kind, self._take_lsns(len(targets)), keys, token=tokens, target_lsn=lsns
        )
        start = self._start_batch(size)
        offsets = range(start, start + size, RECORD_BYTES)
        try:
            self._open.append(
                [heads], [entries_for(offsets, heads, [b""] * len(targets))], self._syncs
            )
        except OSError as error:
            log.warning("node %d: appending %d marks failed: %s", self.node_id, len(targets), error)
            return False
        return True

    def commit(self, token: int, keys: Sequence[bytes]) -> list[bool]:
        """Make ``token``'s pending shards of ``keys`` readable (a durable COMMIT record each).

        A committed shard of the same key (an older write of it) is replaced.
        """
        checked = [bytes(check_key(key)) for key in keys]
        targets = [
            (key, token, self._index.get("lsn", self._pending[(key, token)]))
            for key in dict.fromkeys(checked)
            if (key, token) in self._pending
        ]
        if not self._marks(COMMIT, targets):
            return [False] * len(checked)
        done = set()
        for key, _, _ in targets:
            self._index.set_committed(key, self._pending.pop((key, token)))
            done.add(key)
        self._counters["commits"] += len(done)
        return [key in done for key in checked]

    def abort(self, token: int, keys: Sequence[bytes]) -> int:
        """Drop ``token``'s pending shards of ``keys``; returns how many were dropped."""
        dropped = 0
        for key in keys:
            row = self._pending.pop((check_key(key), token), None)
            if row is not None:
                self._index.drop(row)
                dropped += 1
        return dropped

    # --- read path -------------------------------------------------------------------------

    def get(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The codec shards of committed ``keys``, end to end in one uint8 array, and each
        one's length (-1 = not held): one buffer, sent in one piece (``split_shards`` cuts it
        back into views). The reader verifies the bytes."""
        self._counters["gets"] += len(keys)
        rows = [self._committed.get(bytes(key)) for key in keys]
        held = [row for row in rows if row is not None]
        columns = self._index.columns
        lengths = np.full(len(keys), -1, np.int64)
        if not held:
            self._counters["get_missing"] += len(keys)
            return np.zeros(0, np.uint8), lengths
        at = np.array(held, np.int64)
        segs = columns["seg"][at].tolist()
        offsets = (columns["offset"][at] + RECORD_BYTES).tolist()
        sizes = columns["body_len"][at].tolist()
        buffer = np.empty(sum(sizes), np.uint8)
        view = memoryview(buffer)  # type: ignore[arg-type]
        position = 0
        n = 0
        lost: list[int] = []
        for i, row in enumerate(rows):
            if row is None:
                continue
            size = sizes[n]
            segment = self._segments.get(segs[n])
            if segment is not None and segment.read(offsets[n], size, view[position:]):
                lengths[i] = size
                position += size
            else:
                lost.append(i)
            n += 1
        for i in lost:  # gone behind our back: report it, so repair re-creates the shard
            key = bytes(keys[i])
            row = self._committed.pop(key)
            self._damaged.append((key, self._index.get("index", row)))
            self._index.drop(row)
        self._counters["get_missing"] += len(keys) - len(held) + len(lost)
        self._counters["bytes_read"] += position
        return buffer[:position], lengths

    def read_shards(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """Like ``get`` but one array per key (None = not held)."""
        return split_shards(self.get(keys))

    # --- delete, usage, manifest -----------------------------------------------------------

    def delete(self, keys: Sequence[bytes], not_after: float | None = None) -> int:
        """Delete committed shards of ``keys``; returns how many were deleted.

        ``not_after``: keep shards whose block was created after this time (a newer put of the
        same key that raced the removal).
        """
        chosen: list[bytes] = []
        for key in dict.fromkeys(bytes(key) for key in keys):
            row = self._committed.get(key)
            if row is None:
                continue
            if not_after is not None and float(self._index.columns["created"][row]) > not_after:
                continue
            chosen.append(key)
        self._forget(chosen)
        self._counters["deletes"] += len(chosen)
        return len(chosen)

    def _forget(self, keys: list[bytes]) -> None:
        """Drop committed shards, with DELETE marks so a restart does not bring them back. If
        the marks cannot be written the shards are forgotten anyway (a restart may then serve
        one again: its bytes are still whole and checked by every reader)."""
        targets = [(key, 0, self._index.get("lsn", self._committed[key])) for key in keys]
        self._marks(DELETE, targets)
        for key in keys:
            self._index.drop(self._committed.pop(key))

    def ping(self) -> int:
        return self.node_id

    def close(self) -> None:
        """Stop serving (the open segment stays unsealed: a restart scans its tail)."""
        for segment in self._segments.values():
            segment.close()
        self._lock.release()

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        return [bytes(key) in self._committed for key in keys]

    def usage(self) -> dict[str, int]:
        """Disk bytes held (the segment files' blocks) and capacity. Nodes on one filesystem
        share its headroom: sum replies with ``capacity.tier_usage``, which counts each
        ``filesystem`` once."""
        headroom = self._disk.headroom(self._root.fd)
        explicit = self.config.capacity_bytes
        used = sum(
            allocated_bytes(os.fstat(segment.read_fd)) for segment in self._segments.values()
        )
        live = sum(self._live.values())
        return {
            "node_id": self.node_id,
            "bytes_used": used,
            "capacity_bytes": explicit if explicit is not None else used + headroom,
            "capacity_from_disk": int(explicit is None),
            "filesystem": self._disk.filesystem,
            "headroom_bytes": headroom,
            "shards": len(self._committed),
            "pending": len(self._pending),
            "segments": len(self._segments),
            "live_bytes": live,
            "dead_bytes": max(0, self._disk_bytes() - live),
        }

    def stats(self) -> dict[str, object]:
        return {**self.usage(), **self._counters, "pid": os.getpid()}

    def manifest(
        self, meta_shard: int | None = None, num_meta_shards: int | None = None
    ) -> pa.Table:
        """Committed shards as a table (optionally only keys owned by one meta shard)."""
        keys = list(self._committed)
        if meta_shard is not None:
            if num_meta_shards is None:
                raise InvalidArgument("num_meta_shards", "required with meta_shard")
            owners = meta_shard_of(keys, num_meta_shards) if keys else np.zeros(0, np.int64)
            keys = [key for key, owner in zip(keys, owners, strict=True) if owner == meta_shard]
        rows = np.array([self._committed[key] for key in keys], np.int64)
        columns = self._index.columns
        digests = columns["payload_hash"][rows].astype("<u8").tobytes()
        return pa.table(
            {
                "key": pa.array(keys, type=pa.binary(KEY_BYTES)),
                "shard_index": pa.array(columns["index"][rows], pa.uint8()),
                "payload_len": pa.array(columns["payload_len"][rows].astype(np.int64), pa.int64()),
                "class_id": pa.array(columns["class_id"][rows], pa.uint8()),
                "created": pa.array(columns["created"][rows], pa.float64()),
                "file_bytes": pa.array(columns["body_len"][rows].astype(np.int64), pa.int64()),
                "stamp": pa.array(columns["stamp"][rows], pa.float64()),
                "payload_hash": pa.array(
                    [digests[8 * i : 8 * i + 8] for i in range(len(keys))], pa.binary(8)
                ),
            },
            schema=MANIFEST_SCHEMA,
        )

    # --- scrub, orphans, compaction --------------------------------------------------------

    def scrub(self, limit: int = 1024) -> dict[str, object]:
        """Verify up to ``limit`` committed shards (round robin across calls).

        A corrupt shard is forgotten (with a DELETE mark): readers then see it missing and the
        repair re-creates it. Returns ``checked`` and ``corrupt`` [(key, shard_index)].
        """
        corrupt, self._damaged = self._damaged, []  # found missing by reads since
        keys = list(self._committed)
        chosen: list[bytes] = []
        if keys:
            start = self._scrub_cursor % len(keys)
            chosen = (keys[start:] + keys[:start])[: max(0, limit)]
            self._scrub_cursor = start + len(chosen)
        bad: list[bytes] = []
        for key in chosen:
            row = self._committed[key]
            index = self._index.get("index", row)
            try:
                self._check_record(key, row)
            except CorruptShard as error:
                log.warning("node %d: scrub found %s corrupt: %s", self.node_id, key.hex(), error)
                bad.append(key)
                corrupt.append((key, index))
        self._forget(bad)
        self._counters["corrupt_found"] += len(corrupt)
        return {"checked": len(chosen), "corrupt": corrupt}

    def _check_record(self, key: bytes, row: int) -> None:
        """Verify one committed shard's whole record, header and body (``CorruptShard``)."""
        columns = self._index.columns
        segment = self._segments.get(int(columns["seg"][row]))
        record = np.empty(self._index.record_bytes(row), np.uint8)
        view = memoryview(record)  # type: ignore[arg-type]
        if segment is None or not segment.read(int(columns["offset"][row]), record.size, view):
            raise CorruptShard("unreadable (the segment is shorter than the index says)")
        head = view[:RECORD_BYTES]
        if not header_ok(head) or bytes(head[56:88]) != key:
            raise CorruptShard("its record header is damaged")
        if int.from_bytes(head[8:16], "little") != int(columns["lsn"][row]):
            raise CorruptShard("its record header names another write")
        parsed = parse_shard(view[RECORD_BYTES:])
        if parsed.key != key or parsed.index != int(columns["index"][row]):
            raise CorruptShard("shard names another block or stripe position")

    def locate(self, keys: Sequence[bytes]) -> list[tuple[str, int, int] | None]:
        """Where each committed shard's record is on disk: (segment file, offset of the record,
        record bytes), None when not held. For tools and fault injection."""
        out: list[tuple[str, int, int] | None] = []
        for key in keys:
            row = self._committed.get(bytes(key))
            if row is None:
                out.append(None)
                continue
            path = self._segdir.path / segment_name(self._index.get("seg", row))
            out.append((str(path), self._index.get("offset", row), self._index.record_bytes(row)))
        return out

    def reclaim_orphans(
        self,
        referenced: Callable[[list[BlockKey]], Sequence[bool]],
        grace_s: float,
        batch: int = 4096,
    ) -> dict[str, int]:
        """Drop shards no committed block needs, once older than ``grace_s``.

        - pending shards: a put never lasts that long, so their writer died (or gave up);
        - committed shards whose key no meta shard maps to this node (``referenced`` answers
          for a list of keys): left by a writer that died between commit and index insert, by a
          GC delete that never arrived, or by a repair that moved the shard elsewhere.
        """
        cutoff = self._clock.now() - grace_s
        stamps = self._index.columns["stamp"]
        stale_pending = [pk for pk, row in self._pending.items() if stamps[row] < cutoff]
        for key, token in stale_pending:
            self.abort(token, [key])
        candidates = [key for key, row in self._committed.items() if stamps[row] < cutoff]
        deleted = 0
        for start in range(0, len(candidates), batch):
            chunk = [BlockKey(key) for key in candidates[start : start + batch]]
            answers = referenced(chunk)
            if len(answers) != len(chunk):
                raise StoreError(
                    f"orphan check answered {len(answers)} of {len(chunk)} keys; nothing deleted"
                )
            gone = [
                key
                for key, used in zip(chunk, answers, strict=True)
                if not used and key in self._committed and stamps[self._committed[key]] < cutoff
            ]
            self._forget([bytes(key) for key in gone])
            deleted += len(gone)
        self._counters["orphans_reclaimed"] += deleted + len(stale_pending)
        return {"pending_reclaimed": len(stale_pending), "committed_reclaimed": deleted}

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
        others = [s.all_entries() for q, s in self._segments.items() if q != seq]
        shard_lsns = np.concatenate(
            [e["record"]["lsn"][e["record"]["kind"] == SHARD] for e in others]
            or [np.zeros(0, np.uint64)]
        )
        marks_live = np.isin(entries["record"]["target_lsn"], shard_lsns)
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
        return size, finished

    def _remove_segment(self, seq: int) -> None:
        segment = self._segments.pop(seq)
        del self._live[seq]
        segment.close()
        self._segdir.remove(segment_name(seq))
        if self.config.fsync == "always":
            self._segdir.fsync()


def _raw_word(payload_hash: int) -> int:
    """A codec payload hash (the int of its big-endian bytes) as the index column keeps it: its
    raw 8 bytes read as a little-endian word, so the column's bytes are the hash's bytes."""
    return int.from_bytes(payload_hash.to_bytes(8, "big"), "little")


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


def split_shards(batch: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray | None]:
    """Cut ``StorageNode.get``'s (buffer, lengths) back into one view per key (None = absent)."""
    buffer, lengths = batch
    out: list[np.ndarray | None] = []
    offset = 0
    for length in lengths.tolist():
        if length < 0:
            out.append(None)
            continue
        out.append(buffer[offset : offset + length])
        offset += length
    if offset != buffer.size:
        raise StoreError(f"shard batch of {buffer.size} bytes, lengths sum to {offset}")
    return out
