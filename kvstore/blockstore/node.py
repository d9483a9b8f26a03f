"""A storage node: one failure domain's shards in a log of segment files, indexed in memory.

Disk layout under ``data_dir``::

    NODE                 the node id this directory belongs to (a dir is never served as another)
    LOCK                 held (``flock``) by the one process serving the dir (``dirlock.py``)
    DRAINING             present while the node is draining (``set_draining``): it takes no new
                         shards; a restarted node is still draining
    REVOKED              released leases whose read capabilities the node still refuses
                         (``revokedfile.py``, kept by the node's actor)
    segments/<seq>.seg   the log (``segments.py`` owns the format): shard records, commit marks,
                         delete marks, appended; sealed segments end in a footer

Only this service's user reads or writes here: directories 0700, files 0600, the data dir and its
parent checked for owner and mode, every file reached relative to a held directory descriptor
without following symlinks (``kvstore.privatefs``).

**Commit rule.** A shard is *committed* on this node when the log holds, durably (per the fsync
policy), its SHARD record flagged committed (a put with ``commit``, the client's one write round,
or a compaction copy of a committed shard), or a pending SHARD record and a later COMMIT record
naming that record's LSN and writer token (``put`` then ``commit``). ``put`` acknowledges once
its records are on disk, ``commit`` once its marks are; a committed shard is readable, a pending
one is not. What a committed shard proves is only that its own bytes are durable: a meta shard's
rebuild counts the shards of a write that agree on its payload hash (``meta.py``), and the
client's write rule (``client.py``) says why a write committed as it is written is safe. A
writer killed mid-put leaves shards no placement names: pending ones are dropped from the index
after ``orphan_grace_s``, committed ones once no meta shard maps them to this node
(``reclaim_orphans``), their bytes reclaimed by compaction.

**Restart.** The index is rebuilt from the segments' footers (one read each) plus a scan of the
open segment, then every record is replayed in LSN order: SHARD makes a pending entry (or a
committed one, when flagged committed), COMMIT turns the pending entry with its LSN and token
committed (replacing an older committed shard of the key), DELETE drops the committed shard with
its LSN. Aborts write nothing: an aborted shard comes back pending and is reclaimed as an orphan.

**Dead bytes and compaction.** A record no entry points at is dead (replaced, deleted, aborted,
scrubbed out). ``compact`` rewrites the live records of sealed segments whose live share fell
under ``compact_live_fraction`` into the open segment, with their LSNs, then removes the
segment. A COMMIT or DELETE record is live while a SHARD record with its target LSN is still in
some other segment (else a restart could replay that shard without the mark that acted on it).
Reads never race a move: one thread owns the node, and a moved shard has the same bytes.

**Parts.** The node serves calls and composes three collaborators, each owning its state: the
segment log (``segmentlog.py``: segment files, the open one, LSNs, appends, reading back), the
index (``shardindex.py``: rows, committed and pending maps, live bytes per segment) and
compaction (``compaction.py``). The node keeps what is about serving: the data dir, the drain
flag, capacity, scrub's cursor, the counters.

Not thread-safe: one actor thread (or the lock of its shell) owns one node.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import pyarrow as pa

from kvstore.blockstore.capacity import NodeDisk
from kvstore.blockstore.compaction import Compaction
from kvstore.blockstore.config import StorageNodeConfig
from kvstore.blockstore.dirlock import DirLock
from kvstore.blockstore.logfiles import DiskFiles
from kvstore.blockstore.placement import meta_shard_of
from kvstore.blockstore.records import split_shards
from kvstore.blockstore.segmentlog import AppendFailed, SegmentLog
from kvstore.blockstore.segments import (
    COMMIT,
    DELETE,
    FLAG_COMMITTED,
    RECORD_BYTES,
    SHARD,
    header_ok,
    record_headers,
)
from kvstore.blockstore.shardindex import ShardIndex
from kvstore.clock import Clock, SystemClock
from kvstore.ec.shard import ShardHeader, parse_rows, parse_shard
from kvstore.errors import ConfigError, CorruptShard, InvalidArgument, NodeDraining, StoreError
from kvstore.keys import KEY_BYTES, BlockKey, check_key, check_keys
from kvstore.privatefs import PrivateDir

if TYPE_CHECKING:
    from kvstore.blockstore.calls import StorageNodeCalls

log = logging.getLogger(__name__)

_NODE = "NODE"
_DRAINING = "DRAINING"

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


_MANIFEST_COLUMNS = (
    "index",
    "payload_len",
    "class_id",
    "created",
    "body_len",
    "stamp",
    "payload_hash",
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
        self._draining = self._read_draining()
        segments = self._root.subdir("segments")
        self._disk = NodeDisk.of(
            self._root.fd, self.config.disk_reserve_fraction, self.config.disk_reserve_bytes
        )
        #: (key, shard index) of committed shards found damaged; the next scrub reports them.
        self._damaged: list[tuple[bytes, int]] = []
        self._scrub_cursor = 0  # where the next scrub pass starts, round robin
        self._counters = {
            "puts": 0,
            "put_refused": 0,
            "commits": 0,
            "gets": 0,
            "get_missing": 0,
            "deletes": 0,
            "corrupt_found": 0,
            "scrubbed_shards": 0,
            "scrubbed_bytes": 0,
            "scrub_passes": 0,
            "orphans_reclaimed": 0,
            "bytes_written": 0,
            "bytes_read": 0,
            "segments_compacted": 0,
            "bytes_compacted": 0,
            "damaged_records": 0,
        }
        started = time.monotonic()
        label = f"node {node_id}"
        self._segments_dir = segments
        self._log = SegmentLog(
            DiskFiles(segments),
            segment_bytes=self.config.segment_bytes,
            fsync=self.config.fsync,
            clock=self._clock,
            label=label,
            cached_bytes=self.config.cached_log_bytes,
        )
        self._counters["damaged_records"] = self._log.damaged_records
        self._index = ShardIndex()
        tables = self._log.entry_tables()
        if tables:
            self._index.replay(tables)
        self._committed = self._index.committed  # read-only views, always current
        self._pending = self._index.pending
        self._compaction = Compaction(
            self._log, self._index, self.config.compact_live_fraction, label
        )
        #: How long reading the log took at start (a restart's share that is the node's own).
        self._replay_s = time.monotonic() - started

    @property
    def root(self) -> PrivateDir:
        """The node's data dir (held by it), for what the node's process keeps beside the log
        (``revokedfile``)."""
        return self._root

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

    def _read_draining(self) -> bool:
        try:
            status = self._root.lstat(_DRAINING)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(status.st_mode):
            # Refuse to guess: serving puts from a node an operator meant to drain (or the
            # reverse) is worse than not starting.
            raise ConfigError(
                "data_dir", f"{self._root.path / _DRAINING} is not a regular file; remove it"
            )
        return True

    # --- draining --------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        """The node takes no new shards (``put`` raises ``NodeDraining``); it still commits,
        serves, aborts and deletes what it holds."""
        return self._draining

    def set_draining(self, flag: bool) -> bool:
        """Start (True) or end (False) a drain; returns the new state. Durable whatever the
        fsync policy (file and directory synced): a drain is an operator's decision, and a
        node that forgot it on restart would take new shards meant to go elsewhere."""
        if not isinstance(flag, bool):
            raise InvalidArgument("flag", f"must be a bool, got {flag!r}")
        if flag and not self._draining:
            self._root.write_atomically(
                _DRAINING, [f"storage node {self.node_id} is draining\n".encode()], sync=True
            )
        elif not flag and self._draining:
            self._root.remove(_DRAINING)
            self._root.fsync()
        if flag != self._draining:
            log.info("node %d: %s draining", self.node_id, "started" if flag else "stopped")
        self._draining = flag
        return flag

    # --- write path ------------------------------------------------------------------------

    def put(
        self,
        token: int,
        keys: Sequence[bytes],
        shards: Sequence[np.ndarray] | np.ndarray,
        class_ids: Sequence[int] | np.ndarray,
        created: Sequence[float] | np.ndarray,
        commit: bool = False,
    ) -> list[bool]:
        """Append shards under writer ``token``; True per durably written shard.

        The shards are *pending* (not readable before ``commit``), or with ``commit`` committed
        as they are written: each SHARD record flagged committed, so the write is its own
        commit mark (the client's write rule, ``client.py``, says why that is safe). A shard is
        refused (False) when it fails its checksum, does not belong to its key, or the node is
        full. The batch is one append (headers built at once) and at most one flush. A
        draining node refuses the whole batch with ``NodeDraining`` (the writer places the
        shards elsewhere).
        """
        count = len(keys)
        for name, values in (("shards", shards), ("class_ids", class_ids), ("created", created)):
            if len(values) != count:
                raise InvalidArgument(name, f"has {len(values)} entries for {count} keys")
        if self._draining:
            self._counters["put_refused"] += count
            raise NodeDraining(
                f"storage node {self.node_id} is draining: it takes no new shards "
                "(it still serves reads, commits and deletes)"
            )
        checked = check_keys(keys)
        now = self._clock.now()
        taken = self._accepted(checked, shards)
        positions = taken.positions.tolist()
        results = [False] * count
        self._counters["put_refused"] += count - len(positions)
        if not positions:
            return results
        whole = len(positions) == count
        chosen = checked if whole else [checked[p] for p in positions]
        # A whole 2-D batch goes to the log as it is (its headers' fields cut out at once).
        # (an array is a sequence of its rows; numpy's stubs do not say so)
        bodies: Sequence[object] = (
            shards if whole and isinstance(shards, np.ndarray) else [shards[p] for p in positions]  # type: ignore[assignment]
        )
        born = np.asarray(created, np.float64)[taken.positions]
        kinds = np.asarray(class_ids, np.int64)[taken.positions]
        first_lsn = self._log.take_lsns(len(positions))
        heads = record_headers(
            SHARD,
            first_lsn,
            chosen,
            token=token,
            class_id=kinds,
            index=taken.stripe,
            created=born,
            stamp=now,
            body_len=taken.length,
            flags=FLAG_COMMITTED if commit else 0,
        )
        try:
            seq, offsets = self._log.append(heads, bodies)
        except AppendFailed as error:
            log.warning("node %d: appending %d shards failed: %s", self.node_id, len(chosen), error)
            self._counters["put_refused"] += len(chosen)
            return results
        self._index.add(
            token,
            chosen,
            committed=commit,
            seg=seq,
            offset=offsets,
            body_len=taken.length,
            index=taken.stripe,
            class_id=kinds,
            created=born,
            stamp=now,
            lsn=np.arange(first_lsn, first_lsn + len(chosen), dtype=np.uint64),
            payload_len=taken.payload_len,
            payload_hash=taken.payload_hash,
        )
        if whole:
            results = [True] * count
        else:
            for position in positions:
                results[position] = True
        self._counters["puts"] += len(chosen)
        self._counters["commits"] += len(chosen) if commit else 0
        self._counters["bytes_written"] += len(chosen) * RECORD_BYTES + int(taken.length.sum())
        return results

    def _accepted(self, keys: list[BlockKey], shards: Sequence[np.ndarray] | np.ndarray) -> _Taken:
        """The shards of a put this node takes, in order. Refused: a shard that fails its
        checksum or is another block's (logged), and what does not fit."""
        room = self._room()
        if isinstance(shards, np.ndarray) and shards.ndim == 2 and len(keys) == len(shards):
            # The client's batch: one array, checked as a whole (``parse_rows``).
            words = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), KEY_BYTES)
            parsed = parse_rows(np.ascontiguousarray(shards), words)
            if not parsed.ok.all():
                for position in np.flatnonzero(~parsed.ok).tolist():
                    self._refuse(keys[position], shards[position])
            record = RECORD_BYTES + shards.shape[1]
            chosen = np.flatnonzero(parsed.ok)[: max(0, room) // record]
            return _Taken(
                chosen,
                parsed.index[chosen],
                np.full(len(chosen), shards.shape[1], np.int64),
                parsed.payload_len[chosen],
                parsed.payload_hash_raw[chosen],
            )
        taken: list[tuple[int, int, int, int, int]] = []
        size = 0
        for position, (key, shard) in enumerate(zip(keys, shards, strict=True)):
            parsed_one = self._refuse(key, shard)
            if parsed_one is None or size + RECORD_BYTES + parsed_one.shard_len > room:
                continue
            size += RECORD_BYTES + parsed_one.shard_len
            word = _raw_word(parsed_one.payload_hash)
            taken.append(
                (position, parsed_one.index, parsed_one.shard_len, parsed_one.payload_len, word)
            )
        columns = np.array(taken, np.uint64).reshape(len(taken), 5).T
        return _Taken(*columns[:3].astype(np.int64), *columns[3:])

    def _refuse(self, key: BlockKey, shard: np.ndarray) -> ShardHeader | None:
        """The header of ``shard`` if it is whole and ``key``'s; else None, the reason logged."""
        try:
            parsed = parse_shard(shard)
            if parsed.key != key:
                raise CorruptShard(f"shard belongs to another block than {key.hex()[:16]}")
        except CorruptShard as error:
            log.warning("node %d: refusing shard: %s", self.node_id, error)
            return None
        return parsed

    def _room(self) -> int:
        """Bytes this node may still add: up to its set capacity, which counts what the blocks
        take (live records, as the GC does: ``capacity.py``), or what the disk has beyond its
        reserve."""
        if self.config.capacity_bytes is not None:
            return self.config.capacity_bytes - self._index.live_total()
        return self._disk.headroom(self._root.fd)

    def _marks(
        self,
        kind: int,
        keys: Sequence[bytes],
        tokens: Sequence[int] | np.ndarray | int,
        rows: list[int],
    ) -> bool:
        """Append COMMIT or DELETE records for ``keys`` (with their writer tokens, one or one
        each) aimed at the records of index ``rows`` in one write; False (logged) when the
        write failed."""
        if not keys:
            return True
        lsns = self._index.column("lsn")[rows]
        heads = record_headers(
            kind, self._log.take_lsns(len(keys)), keys, token=tokens, target_lsn=lsns
        )
        try:
            self._log.append(heads, [b""] * len(keys))
        except AppendFailed as error:
            log.warning("node %d: appending %d marks failed: %s", self.node_id, len(keys), error)
            return False
        return True

    def commit(self, token: int, keys: Sequence[bytes]) -> list[bool]:
        """Make ``token``'s pending shards of ``keys`` readable (a durable COMMIT record each).

        A committed shard of the same key (an older write of it) is replaced.
        """
        checked = [bytes(check_key(key)) for key in keys]
        pending = self._pending
        found = [key for key in dict.fromkeys(checked) if (key, token) in pending]
        if not self._marks(COMMIT, found, token, [pending[(key, token)] for key in found]):
            return [False] * len(checked)
        self._index.commit_many(found, token)
        self._counters["commits"] += len(found)
        done = set(found)
        return [key in done for key in checked]

    def abort(self, token: int, keys: Sequence[bytes]) -> int:
        """Drop ``token``'s pending shards of ``keys``; returns how many were dropped."""
        return sum(self._index.abort(bytes(check_key(key)), token) for key in keys)

    # --- read path -------------------------------------------------------------------------

    def get(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The codec shards of committed ``keys``, end to end in one uint8 array, and each
        one's length (-1 = not held): one buffer, sent in one piece (``split_shards`` cuts it
        back into views). The reader verifies the bytes."""
        self._counters["gets"] += len(keys)
        rows = [self._committed.get(bytes(key)) for key in keys]
        held = [row for row in rows if row is not None]
        lengths = np.full(len(keys), -1, np.int64)
        if not held:
            self._counters["get_missing"] += len(keys)
            return np.zeros(0, np.uint8), lengths
        at = np.array(held, np.int64)
        index = self._index
        segs = index.column("seg")[at].tolist()
        offsets = (index.column("offset")[at] + RECORD_BYTES).tolist()
        sizes = index.column("body_len")[at].tolist()
        buffer = np.empty(sum(sizes), np.uint8)
        view = memoryview(buffer)  # type: ignore[arg-type]
        position = 0
        n = 0
        lost: list[int] = []
        for i, row in enumerate(rows):
            if row is None:
                continue
            size = sizes[n]
            if self._log.read(segs[n], offsets[n], size, view[position:]):
                lengths[i] = size
                position += size
            else:
                lost.append(i)
            n += 1
        for i in lost:  # gone behind our back: report it, so repair re-creates the shard
            key = bytes(keys[i])
            self._damaged.append((key, self._index.get("index", self._committed[key])))
            self._index.forget(key)
        self._counters["get_missing"] += len(keys) - len(held) + len(lost)
        self._counters["bytes_read"] += position
        return buffer[:position], lengths

    def shard_sizes(self, keys: Sequence[bytes]) -> list[int]:
        """Bytes ``get`` would answer for each key (-1: not held), from the index alone: what
        the engine read socket reserves of its reply budget before it reads
        (``readserver``)."""
        rows = [self._committed.get(bytes(key)) for key in keys]
        sizes = self._index.column("body_len")
        return [-1 if row is None else int(sizes[row]) for row in rows]

    def shard_extents(
        self, keys: Sequence[bytes]
    ) -> tuple[np.ndarray, np.ndarray, dict[int, int]] | None:
        """Where the committed shards of ``keys`` are: which keys are held (a bool each), and
        for the held ones, in order, a row (segment, offset of its codec shard, bytes) of an
        int64 array; and a new read descriptor of each segment named (``SegmentLog.reader``),
        the caller's to close. For sending the bytes straight from the segment files
        (``readserver``, ``sendfile``) once the node's lock is let go: a record's bytes
        never change (the log is only appended to), and a descriptor keeps its segment
        readable even if compaction removes it meanwhile. None where a segment has no
        descriptor (the log in memory): use ``get``."""
        self._counters["gets"] += len(keys)
        row_of = self._committed.get
        rows = np.array([row_of(key, -1) for key in keys], np.int64)
        held = rows >= 0
        at = rows[held]
        places = self._index.places(at)
        places[:, 1] += RECORD_BYTES
        readers: dict[int, int] = {}
        try:
            for seq in sorted(set(places[:, 0].tolist())):  # a few: np.unique costs more
                fd = self._log.reader(seq)
                if fd is None:
                    raise LookupError(seq)
                readers[seq] = fd
        except LookupError:
            for fd in readers.values():
                os.close(fd)
            return None
        self._counters["get_missing"] += len(keys) - len(at)
        self._counters["bytes_read"] += int(places[:, 2].sum())
        return held, places, readers

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
            if not_after is not None and float(self._index.column("created")[row]) > not_after:
                continue
            chosen.append(key)
        self._forget(chosen)
        self._counters["deletes"] += len(chosen)
        return len(chosen)

    def _forget(self, keys: list[bytes]) -> None:
        """Drop committed shards, with DELETE marks so a restart does not bring them back. If
        the marks cannot be written the shards are forgotten anyway (a restart may then serve
        one again: its bytes are still whole and checked by every reader)."""
        self._marks(DELETE, keys, 0, [self._committed[key] for key in keys])
        for key in keys:
            self._index.forget(key)

    def ping(self) -> int:
        return self.node_id

    def status(self) -> dict[str, int]:
        """What the repair loop's health check learns: the node answers, and whether it is
        draining (a drain outlives restarts of the node and of the repair loop)."""
        return {"node_id": self.node_id, "draining": int(self.draining)}

    def close(self) -> None:
        """Stop serving (the open segment stays unsealed: a restart scans its tail) and give
        back every descriptor: the segments, the lock and both directories. Closing twice is
        harmless."""
        self._log.close()
        self._lock.release()
        self._segments_dir.close()
        self._root.close()

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        return [bytes(key) in self._committed for key in keys]

    def usage(self) -> dict[str, int]:
        """Disk bytes held (the segment files' blocks) and capacity. Nodes on one filesystem
        share its headroom: sum replies with ``capacity.tier_usage``, which counts each
        ``filesystem`` once."""
        headroom = self._disk.headroom(self._root.fd)
        explicit = self.config.capacity_bytes
        used = self._log.allocated_bytes()
        live = self._index.live_total()
        return {
            "node_id": self.node_id,
            "bytes_used": used,
            "capacity_bytes": explicit if explicit is not None else used + headroom,
            "capacity_from_disk": int(explicit is None),
            "filesystem": self._disk.filesystem,
            "headroom_bytes": headroom,
            "shards": len(self._committed),
            "pending": len(self._pending),
            "segments": len(self._log),
            "live_bytes": live,
            "dead_bytes": max(0, self._log.disk_bytes() - live),
            "draining": int(self._draining),
        }

    def stats(self) -> dict[str, object]:
        return {
            **self.usage(),
            **self._counters,
            "replay_s": round(self._replay_s, 3),
            "pid": os.getpid(),
        }

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
        columns = {name: self._index.column(name)[rows] for name in _MANIFEST_COLUMNS}
        digests = columns["payload_hash"].astype("<u8").tobytes()
        return pa.table(
            {
                "key": pa.array(keys, type=pa.binary(KEY_BYTES)),
                "shard_index": pa.array(columns["index"], pa.uint8()),
                "payload_len": pa.array(columns["payload_len"].astype(np.int64), pa.int64()),
                "class_id": pa.array(columns["class_id"], pa.uint8()),
                "created": pa.array(columns["created"], pa.float64()),
                "file_bytes": pa.array(columns["body_len"].astype(np.int64), pa.int64()),
                "stamp": pa.array(columns["stamp"], pa.float64()),
                "payload_hash": pa.array(
                    [digests[8 * i : 8 * i + 8] for i in range(len(keys))], pa.binary(8)
                ),
            },
            schema=MANIFEST_SCHEMA,
        )

    # --- scrub, orphans, compaction --------------------------------------------------------

    def scrub(self, limit: int = 1024, budget_bytes: int | None = None) -> dict[str, object]:
        """Verify committed shards, round robin across calls: up to ``limit`` of them and, with
        ``budget_bytes``, until that many record bytes were read (at least one shard a call,
        so a budget smaller than a record still makes progress).

        A corrupt shard is forgotten (with a DELETE mark): readers then see it missing and the
        repair re-creates it. Returns ``checked``, ``bytes``, ``passes`` (times the round robin
        has wrapped, ever) and ``corrupt`` [(key, shard_index)].
        """
        corrupt, self._damaged = self._damaged, []  # found missing by reads since
        keys = list(self._committed)
        checked = 0
        read = 0
        bad: list[bytes] = []
        if keys:
            start = self._scrub_cursor % len(keys)
            for step in range(min(max(0, limit), len(keys))):
                if budget_bytes is not None and step and read >= budget_bytes:
                    break
                key = keys[(start + step) % len(keys)]
                row = self._committed[key]
                index = self._index.get("index", row)
                read += self._index.record_bytes(row)
                checked += 1
                try:
                    self._check_record(key, row)
                except CorruptShard as error:
                    log.warning(
                        "node %d: scrub found %s corrupt: %s", self.node_id, key.hex(), error
                    )
                    bad.append(key)
                    corrupt.append((key, index))
            if start + checked >= len(keys):
                self._counters["scrub_passes"] += 1
            self._scrub_cursor = (start + checked) % len(keys)
        self._forget(bad)
        self._counters["corrupt_found"] += len(corrupt)
        self._counters["scrubbed_shards"] += checked
        self._counters["scrubbed_bytes"] += read
        return {
            "checked": checked,
            "bytes": read,
            "passes": self._counters["scrub_passes"],
            "corrupt": corrupt,
        }

    def _check_record(self, key: bytes, row: int) -> None:
        """Verify one committed shard's whole record, header and body (``CorruptShard``)."""
        index = self._index
        record = np.empty(index.record_bytes(row), np.uint8)
        view = memoryview(record)  # type: ignore[arg-type]
        if not self._log.read(index.get("seg", row), index.get("offset", row), record.size, view):
            raise CorruptShard("unreadable (the segment is shorter than the index says)")
        head = view[:RECORD_BYTES]
        if not header_ok(head) or bytes(head[56:88]) != key:
            raise CorruptShard("its record header is damaged")
        if int.from_bytes(head[8:16], "little") != index.get("lsn", row):
            raise CorruptShard("its record header names another write")
        parsed = parse_shard(view[RECORD_BYTES:])
        if parsed.key != key or parsed.index != index.get("index", row):
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
            path = self._log.where(self._index.get("seg", row))
            out.append((path, self._index.get("offset", row), self._index.record_bytes(row)))
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
        stamps = self._index.column("stamp")
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
        remove each segment once emptied; resumes where the last call stopped
        (``compaction.py``)."""
        done = self._compaction.compact(budget_bytes)
        self._counters["bytes_compacted"] += done["bytes_moved"]
        self._counters["segments_compacted"] += done["segments_removed"]
        return done


class _Taken(NamedTuple):
    """The shards of a put a node takes (``StorageNode._accepted``), an entry each, in order."""

    positions: np.ndarray  # int64: where in the call's batch
    stripe: np.ndarray  # int64: stripe index
    length: np.ndarray  # int64: shard (record body) bytes
    payload_len: np.ndarray  # uint64
    payload_hash: np.ndarray  # uint64: the hash's 8 bytes as the index keeps them (_raw_word)


def _raw_word(payload_hash: int) -> int:
    """A codec payload hash (the int of its big-endian bytes) as the index column keeps it: its
    raw 8 bytes read as a little-endian word, so the column's bytes are the hash's bytes."""
    return int.from_bytes(payload_hash.to_bytes(8, "big"), "little")


if TYPE_CHECKING:
    # The plain object answers every call a client makes through a fanout (``calls.py``).
    _calls: type[StorageNodeCalls] = StorageNode
