"""A storage node: one failure domain's shard files on local disk, a RAM read cache, a manifest.

Disk layout under ``data_dir``::

    NODE              the node id this directory belongs to (a dir is never served as another)
    LIVE              held locked while a node serves the dir: co-located clients read shard
                      files directly while it is (``localread.py``)
    pending/<key>.<token>   shards written by a put that has not committed yet
    shards/<key>            committed shards (one per key: a stripe never has two shards here)
    quarantine/             shard files a scrub found corrupt (kept for post-mortems)
    manifest.arrow          snapshot of the manifest (speeds up start; the directory is the truth)

Only this service's user reads or writes here: directories 0700, files 0600, the data dir and its
parent checked for owner and mode, every file reached relative to a held directory descriptor
without following symlinks (``kvstore.privatefs``). Usage counts the disk blocks files take;
capacity is the operator's or the disk's (``kvstore.blockstore.capacity``).

Crash safety: a shard file is written whole under ``pending/`` (fsynced when ``fsync=always``)
and only ever enters ``shards/`` by ``rename`` — atomic on POSIX — when the writer commits, after
every shard of its stripe was acknowledged (the all-or-nothing rule, see ``client.py``). So a
file in ``shards/`` is always complete, and a committed shard is evidence that its whole stripe
was durably written: that is what a meta shard's rebuild relies on. Pending files of writers
that died are reclaimed after a grace period.

Not thread-safe: one actor thread owns one node.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from kvstore.blockstore.capacity import NodeDisk, allocated_bytes
from kvstore.blockstore.config import StorageNodeConfig
from kvstore.blockstore.localread import LiveLock, LocalReadGrant
from kvstore.blockstore.placement import meta_shard_of
from kvstore.blockstore.shardfile import (
    NODE_HEADER_BYTES,
    NodeHeader,
    parse_node_header,
    peek_shard,
)
from kvstore.clock import Clock, SystemClock
from kvstore.ec.shard import parse_shard
from kvstore.errors import ConfigError, CorruptShard, InvalidArgument, StoreError
from kvstore.keys import KEY_BYTES, BlockKey, check_key
from kvstore.privatefs import PrivateDir, write_all

log = logging.getLogger(__name__)

_NODE = "NODE"
_MANIFEST = "manifest.arrow"

MANIFEST_SCHEMA = pa.schema(
    [
        ("key", pa.binary(KEY_BYTES)),
        ("shard_index", pa.uint8()),
        ("payload_len", pa.int64()),
        ("class_id", pa.uint8()),
        ("created", pa.float64()),
        ("file_bytes", pa.int64()),
        ("stamp", pa.float64()),
        ("payload_hash", pa.binary(16)),
    ],
    metadata={"format": "kvstore.node_manifest.v1"},
)


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """What a node remembers about one shard file."""

    shard_index: int
    payload_len: int
    class_id: int
    created: float
    file_bytes: int
    #: When this node received the file (or its mtime after a restart): orphan grace basis,
    #: and the newer of two copies of one shard wins a meta rebuild (a repaired copy).
    stamp: float
    #: Payload hash of the write this shard belongs to (tells writes of one key apart).
    digest: bytes
    #: Bytes the file takes on disk (its blocks): what usage and capacity count.
    disk_bytes: int


class StorageNode:
    """Shard files of one failure domain."""

    def __init__(
        self,
        node_id: int,
        data_dir: str | os.PathLike[str],
        config: StorageNodeConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
        if not isinstance(node_id, int) or isinstance(node_id, bool) or node_id < 0:
            raise InvalidArgument("node_id", f"must be an integer >= 0, got {node_id!r}")
        self.node_id = node_id
        self.config = config or StorageNodeConfig()
        self._clock = clock or SystemClock()
        self._root = PrivateDir.open(data_dir, "data_dir", check_parent=True)
        self._shards = self._root.subdir("shards")
        self._pending_dir = self._root.subdir("pending")
        self._quarantine = self._root.subdir("quarantine")
        self._disk = NodeDisk.of(
            self._root.fd, self.config.disk_reserve_fraction, self.config.disk_reserve_bytes
        )
        self._committed: dict[bytes, ShardEntry] = {}
        self._pending: dict[tuple[bytes, int], ShardEntry] = {}
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_bytes = 0
        self._bytes_used = 0
        self._scrub_cursor = 0
        #: (key, shard index) of committed shards a read found deleted; the next scrub reports them.
        self._vanished: list[tuple[bytes, int]] = []
        self._counters = {
            "puts": 0,
            "put_refused": 0,
            "commits": 0,
            "gets": 0,
            "get_missing": 0,
            "cache_hits": 0,
            "deletes": 0,
            "corrupt_found": 0,
            "orphans_reclaimed": 0,
            "bytes_written": 0,
            "bytes_read": 0,
        }
        self._open_directory()
        self._live = LiveLock.take(self._root, node_id)

    # --- start-up --------------------------------------------------------------------------

    def _open_directory(self) -> None:
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
        snapshot = self._load_snapshot()
        for entry, status in _regular_files(self._shards):
            key = _key_from_name(entry.name)
            if key is None:
                continue
            known = snapshot.get(key)
            if known is not None and known.file_bytes == status.st_size:
                self._committed[key] = replace(known, disk_bytes=allocated_bytes(status))
            else:
                loaded = self._read_entry(self._shards, entry.name, status)
                if loaded is not None:
                    self._committed[key] = loaded
        for entry, status in _regular_files(self._pending_dir):
            parsed = _pending_from_name(entry.name)
            if parsed is None:
                continue
            loaded = self._read_entry(self._pending_dir, entry.name, status)
            if loaded is not None:
                self._pending[parsed] = loaded
        self._bytes_used = sum(e.disk_bytes for e in self._committed.values()) + sum(
            e.disk_bytes for e in self._pending.values()
        )

    def _read_entry(
        self, directory: PrivateDir, name: str, status: os.stat_result
    ) -> ShardEntry | None:
        """Entry of a file found on disk at start-up; an unreadable one goes to quarantine."""
        try:
            fd = directory.open_read(name)
            try:
                head = os.read(fd, NODE_HEADER_BYTES + 64)
            finally:
                os.close(fd)
            header = parse_node_header(head)
            index, payload_len = peek_shard(head)
        except (OSError, CorruptShard) as error:
            path = directory.path / name
            log.warning("node %d: quarantining unreadable %s: %s", self.node_id, path, error)
            self._to_quarantine(directory, name)
            return None
        return ShardEntry(
            index,
            payload_len,
            header.class_id,
            header.created,
            status.st_size,
            status.st_mtime,
            header.payload_hash,
            allocated_bytes(status),
        )

    def _load_snapshot(self) -> dict[bytes, ShardEntry]:
        """Entries of the last snapshot (their ``disk_bytes`` come from the scan)."""
        try:
            with ipc.open_file(pa.py_buffer(self._root.read(_MANIFEST))) as reader:
                table = reader.read_all()
        except FileNotFoundError:
            return {}
        except (OSError, pa.ArrowInvalid) as error:
            log.warning("node %d: ignoring unreadable manifest snapshot: %s", self.node_id, error)
            return {}
        if "payload_hash" not in table.column_names:
            return {}  # an older snapshot format: rescan the directory instead
        columns = table.to_pydict()
        return {
            key: ShardEntry(index, payload_len, class_id, created, file_bytes, stamp, digest, 0)
            for key, index, payload_len, class_id, created, file_bytes, stamp, digest in zip(
                columns["key"],
                columns["shard_index"],
                columns["payload_len"],
                columns["class_id"],
                columns["created"],
                columns["file_bytes"],
                columns["stamp"],
                columns["payload_hash"],
                strict=True,
            )
        }

    # --- write path ------------------------------------------------------------------------

    def put(
        self,
        token: int,
        keys: Sequence[bytes],
        shards: Sequence[np.ndarray],
        payload_hashes: Sequence[bytes],
        class_ids: Sequence[int],
        created: Sequence[float],
    ) -> list[bool]:
        """Write shards as *pending* under writer ``token``; True per durably written shard.

        A shard is refused (False) when it fails its checksum, does not belong to its key, or
        the node is full. Nothing becomes readable before ``commit``.
        """
        count = len(keys)
        for name, values in (
            ("shards", shards),
            ("payload_hashes", payload_hashes),
            ("class_ids", class_ids),
            ("created", created),
        ):
            if len(values) != count:
                raise InvalidArgument(name, f"has {len(values)} entries for {count} keys")
        now = self._clock.now()
        results: list[bool] = []
        written = False
        room = self._room()  # disk bytes this batch may still add
        for key, shard, digest, class_id, born in zip(
            keys, shards, payload_hashes, class_ids, created, strict=True
        ):
            key = check_key(key)
            digest = bytes(digest)
            if len(digest) != 16:
                raise InvalidArgument("payload_hashes", f"must be 16 bytes, got {len(digest)}")
            try:
                parsed = parse_shard(shard)
                if parsed.key != key:
                    raise CorruptShard(f"shard belongs to another block than {key.hex()[:16]}")
            except CorruptShard as error:
                log.warning("node %d: refusing shard: %s", self.node_id, error)
                self._counters["put_refused"] += 1
                results.append(False)
                continue
            size = NODE_HEADER_BYTES + parsed.shard_len
            previous = self._pending.get((key, token))  # a retried put: its file is replaced
            freed = previous.disk_bytes if previous is not None else 0
            if self._disk.blocks_for(size) > room + freed:
                self._counters["put_refused"] += 1
                results.append(False)
                continue
            header = NodeHeader(int(class_id), float(born), bytes(digest), int(token)).pack()
            name = _pending_name(key, token)
            if previous is not None:
                del self._pending[(key, token)]
                self._bytes_used -= freed
                room += freed
            try:
                disk_bytes = self._write_file(name, header, shard)
            except OSError as error:
                path = self._pending_dir.path / name
                log.warning("node %d: writing %s failed: %s", self.node_id, path, error)
                self._counters["put_refused"] += 1
                results.append(False)
                continue
            self._pending[(key, token)] = ShardEntry(
                parsed.index,
                parsed.payload_len,
                int(class_id),
                float(born),
                size,
                now,
                digest,
                disk_bytes,
            )
            self._bytes_used += disk_bytes
            room -= disk_bytes
            self._counters["puts"] += 1
            self._counters["bytes_written"] += size
            results.append(True)
            written = True
        if written:
            self._flush(self._pending_dir)
        return results

    def _room(self) -> int:
        """Disk bytes this node may still add: up to its set capacity, or what the disk has
        beyond its reserve."""
        if self.config.capacity_bytes is not None:
            return self.config.capacity_bytes - self._bytes_used
        return self._disk.headroom(self._root.fd)

    def _flush(self, *directories: PrivateDir) -> None:
        """Make this batch's file writes and renames durable, per the fsync policy."""
        if self.config.fsync == "always":
            for directory in directories:
                directory.fsync()
        elif self.config.fsync == "batch":
            _syncfs(directories[0].fd)

    def _write_file(self, name: str, header: bytes, shard: np.ndarray) -> int:
        """Write pending shard file ``name`` (a new 0600 file, never through a link planted at
        the name); returns the disk bytes it takes. A failed write leaves no file behind."""
        fd = self._pending_dir.create(name)
        try:
            write_all(fd, [header, shard])
            if self.config.fsync == "always":
                os.fsync(fd)
            return allocated_bytes(os.fstat(fd))  # delayed allocation included (ext4, xfs)
        except OSError:
            self._pending_dir.remove(name)
            raise
        finally:
            os.close(fd)

    def commit(self, token: int, keys: Sequence[bytes]) -> list[bool]:
        """Make ``token``'s pending shards of ``keys`` readable (atomic rename each).

        A committed shard of the same key (an older write of it) is replaced.
        """
        results: list[bool] = []
        renamed = False
        for key in keys:
            key = check_key(key)
            entry = self._pending.pop((key, token), None)
            if entry is None:
                results.append(False)
                continue
            try:
                self._pending_dir.replace(_pending_name(key, token), key.hex(), self._shards)
            except OSError as error:
                log.warning("node %d: commit rename failed: %s", self.node_id, error)
                self._bytes_used -= entry.disk_bytes
                results.append(False)
                continue
            old = self._committed.get(key)
            if old is not None:
                self._bytes_used -= old.disk_bytes
                self._drop_cached(key)
            self._committed[key] = entry
            self._counters["commits"] += 1
            results.append(True)
            renamed = True
        if renamed:
            self._flush(self._shards, self._pending_dir)
        return results

    def abort(self, token: int, keys: Sequence[bytes]) -> int:
        """Drop ``token``'s pending shards of ``keys``; returns how many were dropped."""
        dropped = 0
        for key in keys:
            key = check_key(key)
            entry = self._pending.pop((key, token), None)
            if entry is None:
                continue
            self._pending_dir.remove(_pending_name(key, token))
            self._bytes_used -= entry.disk_bytes
            dropped += 1
        return dropped

    # --- read path -------------------------------------------------------------------------

    def get(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Whole shard files (node header + codec shard) of committed ``keys``, end to end in
        one uint8 array, and each file's length (-1 = not held). One buffer, not one object
        per shard: Ray ships it in one piece (``split_files`` cuts it back into views).
        The reader verifies the bytes."""
        files = self.read_files(keys)
        lengths = np.array([-1 if f is None else f.size for f in files], dtype=np.int64)
        present = [f for f in files if f is not None]
        buffer = np.concatenate(present) if present else np.zeros(0, dtype=np.uint8)
        return buffer, lengths

    def read_files(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """Like ``get`` but one array per key (None = not held)."""
        out: list[np.ndarray | None] = []
        self._counters["gets"] += len(keys)
        for key in keys:
            key = bytes(key)
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._counters["cache_hits"] += 1
                out.append(cached)
                continue
            if key not in self._committed:
                self._counters["get_missing"] += 1
                out.append(None)
                continue
            try:
                data = self._shards.read(key.hex())
            except FileNotFoundError:
                # Deleted behind our back: the next scrub reports it, so repair re-creates it
                # (forgetting it silently would leave the stripe at 11 shards for good).
                self._vanished.append((key, self._committed[key].shard_index))
                self._forget(key)
                self._counters["get_missing"] += 1
                out.append(None)
                continue
            array = np.frombuffer(data, dtype=np.uint8)
            self._counters["bytes_read"] += array.size
            self._remember(key, array)
            out.append(array)
        return out

    def _remember(self, key: bytes, array: np.ndarray) -> None:
        budget = self.config.read_cache_bytes
        if array.size > budget:
            return
        self._cache[key] = array
        self._cache_bytes += array.size
        while self._cache_bytes > budget:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= evicted.size

    def _drop_cached(self, key: bytes) -> None:
        cached = self._cache.pop(key, None)
        if cached is not None:
            self._cache_bytes -= cached.size

    # --- delete, usage, manifest -----------------------------------------------------------

    def delete(self, keys: Sequence[bytes], not_after: float | None = None) -> int:
        """Delete committed shards of ``keys``; returns how many were deleted.

        ``not_after``: keep shards whose block was created after this time (a newer put of the
        same key that raced the removal).
        """
        deleted = 0
        for key in keys:
            key = bytes(key)
            entry = self._committed.get(key)
            if entry is None:
                continue
            if not_after is not None and entry.created > not_after:
                continue
            self._shards.remove(key.hex())
            self._forget(key)
            deleted += 1
        self._counters["deletes"] += deleted
        return deleted

    def _forget(self, key: bytes) -> None:
        entry = self._committed.pop(key, None)
        if entry is not None:
            self._bytes_used -= entry.disk_bytes
        self._drop_cached(key)

    def ping(self) -> int:
        return self.node_id

    def local_read_grant(self) -> LocalReadGrant | None:
        """What a client on this machine needs to read this node's shard files directly
        (None: it may not, e.g. another node object serves this directory)."""
        return self._live.grant if self._live is not None else None

    def close(self) -> None:
        """Stop serving: co-located clients stop reading this directory directly (as when
        the process dies). The node object is not used afterwards."""
        if self._live is not None:
            self._live.release()

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        return [bytes(key) in self._committed for key in keys]

    def usage(self) -> dict[str, int]:
        """Disk bytes held and capacity. Nodes on one filesystem share its headroom: sum
        replies with ``capacity.tier_usage``, which counts each ``filesystem`` once."""
        headroom = self._disk.headroom(self._root.fd)
        explicit = self.config.capacity_bytes
        return {
            "node_id": self.node_id,
            "bytes_used": self._bytes_used,
            "capacity_bytes": explicit if explicit is not None else self._bytes_used + headroom,
            "capacity_from_disk": int(explicit is None),
            "filesystem": self._disk.filesystem,
            "headroom_bytes": headroom,
            "shards": len(self._committed),
            "pending": len(self._pending),
        }

    def stats(self) -> dict[str, object]:
        return {**self.usage(), **self._counters, "cache_bytes": self._cache_bytes}

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
        entries = [self._committed[key] for key in keys]
        return pa.table(
            {
                "key": pa.array(keys, type=pa.binary(KEY_BYTES)),
                "shard_index": pa.array([e.shard_index for e in entries], pa.uint8()),
                "payload_len": pa.array([e.payload_len for e in entries], pa.int64()),
                "class_id": pa.array([e.class_id for e in entries], pa.uint8()),
                "created": pa.array([e.created for e in entries], pa.float64()),
                "file_bytes": pa.array([e.file_bytes for e in entries], pa.int64()),
                "stamp": pa.array([e.stamp for e in entries], pa.float64()),
                "payload_hash": pa.array([e.digest for e in entries], pa.binary(16)),
            },
            schema=MANIFEST_SCHEMA,
        )

    def snapshot(self) -> int:
        """Write the manifest snapshot (temp file + rename); returns the entries written."""
        table = self.manifest()
        temporary = f"{_MANIFEST}.tmp"
        try:
            with os.fdopen(self._root.create(temporary), "wb") as sink:
                with ipc.new_file(sink, table.schema) as writer:
                    writer.write_table(table)
                sink.flush()
                if self.config.fsync == "always":
                    os.fsync(sink.fileno())
            self._root.replace(temporary, _MANIFEST)
        except BaseException:
            self._root.remove(temporary)
            raise
        return table.num_rows

    # --- scrub and orphans -----------------------------------------------------------------

    def scrub(self, limit: int = 1024) -> dict[str, object]:
        """Verify up to ``limit`` committed shards (round robin across calls).

        A corrupt shard goes to quarantine and is forgotten: readers then see it missing and
        the repair re-creates it. Returns ``checked`` and ``corrupt`` [(key, shard_index)].
        """
        keys = sorted(self._committed)
        corrupt: list[tuple[bytes, int]] = self._vanished  # found missing by reads since
        self._vanished = []
        if not keys:
            self._counters["corrupt_found"] += len(corrupt)
            return {"checked": 0, "corrupt": corrupt}
        start = self._scrub_cursor % len(keys)
        chosen = (keys[start:] + keys[:start])[: max(0, limit)]
        self._scrub_cursor = start + len(chosen)
        for key in chosen:
            entry = self._committed[key]
            name = key.hex()
            try:
                data = self._shards.read(name)
                parse_node_header(data)
                shard = parse_shard(memoryview(data)[NODE_HEADER_BYTES:])
                if shard.key != key or shard.index != entry.shard_index:
                    raise CorruptShard("shard names another block or stripe position")
            except (OSError, CorruptShard) as error:
                log.warning("node %d: scrub found %s corrupt: %s", self.node_id, name, error)
                self._to_quarantine(self._shards, name)
                self._forget(key)
                corrupt.append((key, entry.shard_index))
        self._counters["corrupt_found"] += len(corrupt)
        return {"checked": len(chosen), "corrupt": corrupt}

    def reclaim_orphans(
        self,
        referenced: Callable[[list[BlockKey]], Sequence[bool]],
        grace_s: float,
        batch: int = 4096,
    ) -> dict[str, int]:
        """Delete shards no committed block needs, once older than ``grace_s``.

        - pending shards: a put never lasts that long, so their writer died (or gave up);
        - committed shards whose key no meta shard maps to this node (``referenced`` answers
          for a list of keys): left by a writer that died between commit and index insert, by a
          GC delete that never arrived, or by a repair that moved the shard elsewhere.
        """
        now = self._clock.now()
        cutoff = now - grace_s
        stale_pending = [pk for pk, entry in self._pending.items() if entry.stamp < cutoff]
        for key, token in stale_pending:
            self.abort(token, [key])
        candidates = [key for key, entry in self._committed.items() if entry.stamp < cutoff]
        deleted = 0
        for start in range(0, len(candidates), batch):
            chunk = [BlockKey(key) for key in candidates[start : start + batch]]
            answers = referenced(chunk)
            if len(answers) != len(chunk):
                raise StoreError(
                    f"orphan check answered {len(answers)} of {len(chunk)} keys; nothing deleted"
                )
            for key, used in zip(chunk, answers, strict=True):
                entry = self._committed.get(key)
                if not used and entry is not None and entry.stamp < cutoff:
                    self._shards.remove(key.hex())
                    self._forget(key)
                    deleted += 1
        self._counters["orphans_reclaimed"] += deleted + len(stale_pending)
        return {"pending_reclaimed": len(stale_pending), "committed_reclaimed": deleted}

    # --- paths -----------------------------------------------------------------------------

    def _to_quarantine(self, directory: PrivateDir, name: str) -> None:
        try:
            directory.replace(name, f"{name}.{int(self._clock.now())}", self._quarantine)
        except OSError:
            directory.remove(name)


def _pending_name(key: bytes, token: int) -> str:
    return f"{key.hex()}.{token:016x}"


def _regular_files(directory: PrivateDir) -> list[tuple[os.DirEntry[str], os.stat_result]]:
    """The regular files in ``directory`` with their lstat, made 0600 where an older version
    left them looser; anything else (a symlink, a directory) is no shard and is left alone."""
    found = []
    for entry in directory.entries():
        status = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(status.st_mode):
            directory.tighten(entry.name, status)
            found.append((entry, status))
    return found


def _key_from_name(name: str) -> bytes | None:
    if len(name) != 2 * KEY_BYTES:
        return None
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None


def _pending_from_name(name: str) -> tuple[bytes, int] | None:
    key_part, _, token_part = name.partition(".")
    key = _key_from_name(key_part)
    if key is None or len(token_part) != 16:
        return None
    try:
        return key, int(token_part, 16)
    except ValueError:
        return None


def _syncfs(fd: int) -> None:
    """Flush the filesystem holding directory ``fd`` (Linux ``syncfs``); its fsync elsewhere."""
    if _LIBC is None or _LIBC.syncfs(fd) != 0:
        os.fsync(fd)


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syncfs  # noqa: B018  (present on Linux only)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def split_files(batch: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray | None]:
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
