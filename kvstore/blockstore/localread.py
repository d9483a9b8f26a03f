"""Short-circuit reads: a client reads the shard files of a storage node on its own machine
straight from the node's directory, like HDFS short-circuit local reads.

Why: a node's ``get`` over Ray costs ~1-1.5 ms of CPU per call on the node and the caller,
whatever the payload; a 64-block read asks all 12 nodes, so on a small machine hosting the
nodes the calls, not the bytes, bound the read (profiled: ~21 ms per 64 x 111 KiB batch, of
which ~5 ms is 12 bare pings). Reading the same files directly costs ~6 us per shard.

The protocol, and why each guarantee still holds:

- *Same machine, same directory.* A node hands out a ``LocalReadGrant``: its data dir and a
  random nonce it wrote into ``<data_dir>/LIVE`` when it started. A client adopts the grant only
  if it can open that path and read the same nonce there, so a path that names another
  directory (another machine, another mount namespace) is never read.
- *Only while the node lives.* The node holds an exclusive ``flock`` on ``LIVE`` for as long as
  its process lives (the kernel drops it when the process dies, however it dies). Before every
  read the client tries a shared lock without blocking: if it gets one, the node is gone (or
  restarted: a new incarnation writes a new ``LIVE`` file, so the old one is unlocked), the
  grant is dropped and reads go over Ray, where the node's death shows as it always did. A
  killed node is therefore a degraded read, as before, not a silent local one.
- *Never wrong bytes.* Committed shard files are immutable: written whole under ``pending/``,
  then renamed into ``shards/``; a newer write of a key renames a new file over it, GC and scrub
  unlink or rename it away. A file opened before any of that keeps its whole old contents (the
  inode lives while it is open); one opened after is the new file or absent. So a reader sees
  one complete file, an absent one, or (damage in place, torn writes) bytes the client's checks
  reject: every shard read here goes through the same verification as one read over Ray
  (payload hash of the whole block against the hash every shard carries; per-shard checksums
  and payload-hash groups on the slow path).
- *Only the service's user.* The data dir is 0700 and its files 0600 (``kvstore.privatefs``):
  clients read directly only as the user the nodes run as (every Ray worker of the cluster), and
  open nothing through a symlink.
- *Misses stay the node's business.* A file absent or of the wrong size locally is asked of
  the node over Ray, which answers with its own view (its RAM cache, and a note for its scrub
  when a committed file vanished behind its back).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.privatefs import PrivateDir, write_all

log = logging.getLogger(__name__)

#: File in a node's data dir that the serving node process holds locked.
LIVE_NAME = "LIVE"
_LIVE_TEMP = LIVE_NAME + ".tmp"
#: Clients open a node's files without following symlinks, as the node itself does.
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class LocalReadGrant:
    """What a node tells clients so they may read its shard files directly."""

    node_id: int
    data_dir: str
    nonce: str

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, int) or self.node_id < 0:
            raise InvalidArgument("node_id", f"must be an integer >= 0, got {self.node_id!r}")
        if not os.path.isabs(self.data_dir):
            raise InvalidArgument("data_dir", f"must be an absolute path, got {self.data_dir!r}")
        if len(self.nonce) != 32:
            raise InvalidArgument("nonce", "must be 32 hex digits")

    def live_bytes(self) -> bytes:
        """The exact contents of the node's ``LIVE`` file."""
        return f"{self.node_id} {self.nonce}\n".encode()


class LiveLock:
    """The node side: ``LIVE`` written fresh and held locked while this object is open."""

    def __init__(self, fd: int, grant: LocalReadGrant) -> None:
        self._fd = fd
        self._grant = grant

    @classmethod
    def take(cls, directory: PrivateDir, node_id: int) -> LiveLock | None:
        """Write a new ``LIVE`` (new inode: readers of a previous incarnation's file see it
        unlocked), locked before it is renamed into place. None when that fails: the node then
        serves over Ray only."""
        grant = LocalReadGrant(node_id, str(directory.path.resolve()), secrets.token_hex(16))
        try:
            fd = directory.create(_LIVE_TEMP)  # O_EXCL | O_NOFOLLOW: never a planted link
        except OSError as error:
            log.warning("node %d: no short-circuit reads (%s)", node_id, error)
            return None
        try:
            write_all(fd, [grant.live_bytes()])
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh inode: nobody holds it
            directory.replace(_LIVE_TEMP, LIVE_NAME)
        except OSError as error:
            os.close(fd)
            directory.remove(_LIVE_TEMP)
            log.warning("node %d: no short-circuit reads (%s)", node_id, error)
            return None
        return cls(fd, grant)

    @property
    def grant(self) -> LocalReadGrant | None:
        return self._grant if self._fd >= 0 else None

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the file drops the lock
            self._fd = -1

    def __del__(self) -> None:
        self.release()


def open_live(data_dir: str | os.PathLike[str]) -> IO[bytes] | None:
    """A node directory's current ``LIVE`` file, opened to watch its lock (``wait_unlocked``),
    or None when it is not visible from here (another machine) or was never written."""
    try:
        return os.fdopen(os.open(os.path.join(data_dir, LIVE_NAME), _READ), "rb")
    except OSError:
        return None


def wait_unlocked(live: IO[bytes], timeout_s: float, poll_s: float = 0.01) -> bool:
    """Wait until no process holds ``live`` locked, i.e. the node process that did is gone
    (killing an actor is asynchronous); True if so within ``timeout_s``. Closes ``live``."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(live.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(poll_s)
                continue
            return True
    finally:
        live.close()


class _Granted:
    """A client's open view of one co-located node: its ``LIVE`` file and ``shards/`` dir.

    Closed when the last reference goes, never explicitly: a reader in another thread may still
    be opening files relative to ``shards_fd`` when the node is forgotten, and a closed (then
    reused) descriptor would point its reads at whatever was opened next.
    """

    __slots__ = ("live", "shards_fd")

    def __init__(self, live: IO[bytes], shards_fd: int) -> None:
        self.live = live
        self.shards_fd = shards_fd

    def __del__(self) -> None:
        os.close(self.shards_fd)  # ``live`` closes itself

    def alive(self) -> bool:
        """True while the node process still holds its lock on ``LIVE``."""
        try:
            fcntl.flock(self.live.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # held exclusively: by the node
        except OSError:
            return False
        fcntl.flock(self.live.fileno(), fcntl.LOCK_UN)
        return False


class LocalShardReader:
    """The client side: which nodes it may read directly, and the reads themselves."""

    def __init__(self) -> None:
        self._nodes: dict[int, _Granted] = {}
        #: A one-byte tail for every read: a file longer than expected fills it (its contents
        #: are never looked at, so threads reading at once may share it).
        self._probe = bytearray(1)

    @property
    def nodes(self) -> list[int]:
        return sorted(self._nodes)

    def adopt(self, grant: LocalReadGrant) -> bool:
        """Start reading ``grant``'s node directly if its directory is visible here, it is the
        incarnation that granted, and it is alive. False (nothing kept) otherwise."""
        self.forget(grant.node_id)
        live = open_live(grant.data_dir)
        if live is None:
            return False  # not on this machine (or not at this path here)
        try:
            if live.read(256) != grant.live_bytes():
                live.close()
                return False
            shards_fd = os.open(os.path.join(grant.data_dir, "shards"), _READ | os.O_DIRECTORY)
        except OSError:
            live.close()
            return False
        granted = _Granted(live, shards_fd)
        if not granted.alive():
            return False
        self._nodes[grant.node_id] = granted
        return True

    def forget(self, node_id: int) -> None:
        self._nodes.pop(node_id, None)

    def serving(self, node_id: int) -> bool:
        """True if ``node_id`` is granted and alive (a dead one is forgotten)."""
        granted = self._nodes.get(node_id)
        if granted is None:
            return False
        if granted.alive():
            return True
        self.forget(node_id)
        return False

    def read_shards(
        self, key: bytes, nodes: Sequence[int], vectors: Sequence[list[Any]], length: int
    ) -> bool:
        """Read the shard file of block ``key`` held by each of ``nodes`` in one ``preadv``
        into the buffers ``vectors[i]`` (headers, then where its fragment's bytes should land:
        straight into a block, a parity staging row, a padding scratch). False as soon as one
        is not exactly ``length`` bytes (the buffers then hold partial, unverified bytes). The
        nodes must have been seen ``serving`` by the caller; the bytes are unverified.
        """
        name = key.hex()
        probe = self._probe
        granted = self._nodes
        for node, buffers in zip(nodes, vectors, strict=True):
            view = granted.get(node)  # held while its descriptor is in use
            if view is None:
                return False
            try:
                fd = os.open(name, _READ, dir_fd=view.shards_fd)
            except OSError:
                return False
            try:
                read = os.preadv(fd, [*buffers, probe], 0)
            except OSError:
                return False
            finally:
                os.close(fd)
            if read != length:
                return False
        return True

    def read(
        self,
        node_id: int,
        keys: list[bytes],
        lengths: list[int],
        into: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Shard files of ``keys`` in ``StorageNode.get``'s packed form (one buffer, a length
        per key, -1 = not read), or None when ``node_id`` cannot be read directly now.

        A file is read only if it is exactly ``lengths[i]`` bytes (the size of a shard of the
        block as located); anything else (absent, shorter, longer, unreadable) is -1 and left
        to the node. The bytes are unverified: the client checks them as any node's answer.
        ``into``: where to put them (at least ``sum(lengths)`` bytes; default a new array).
        """
        view = self._nodes.get(node_id)  # held while its descriptor is in use
        if view is None or not self.serving(node_id):
            return None
        shards_fd = view.shards_fd
        total = sum(lengths)
        if into is None:
            buffer = np.empty(total, dtype=np.uint8)
        elif into.dtype != np.uint8 or into.ndim != 1 or into.size < total:
            raise InvalidArgument("into", f"must be a flat uint8 array of >= {total} bytes")
        else:
            buffer = into
        got = np.full(len(keys), -1, dtype=np.int64)
        probe = self._probe
        offset = 0
        open_, preadv, close = os.open, os.preadv, os.close
        for i, (key, length) in enumerate(zip(keys, lengths, strict=True)):
            try:
                fd = open_(key.hex(), _READ, dir_fd=shards_fd)
            except OSError:
                continue
            vectors: list[Any] = [buffer[offset : offset + length], probe]
            try:
                read = preadv(fd, vectors, 0)
            except OSError:
                read = -1
            finally:
                close(fd)
            if read == length:
                got[i] = length
                offset += length
        return buffer[:offset], got
