"""The /dev/shm staging area between the fetcher process and the engine's swap-in thread.

One ``StagingArea`` is a file in ``/dev/shm`` (host shared memory) mapped by both processes. The
engine creates it once, so on CUDA it is registered as pinned memory once (registration costs
milliseconds, far too much per load), and hands out regions, one per load, from a first-fit free
list. A load's region is laid out by ``StageLayout``::

    [header: magic, job id, counts, done, per-layer ready words, per-block status bytes]
    [layer 0: n_blocks × layer-0 block bytes][layer 0 SWA window]
    [layer 1: ...]

**Layer-major**: everything layer i needs is one contiguous span, so swap-in copies a layer with
one transfer, and a layer can be published (its ready word set to the job id) while later layers
are still being written. Readiness is written in the shared memory itself (so either side can
inspect it, and a stale word from an earlier job in the same region never matches) and announced
through a pipe (``kvstore.engine.fetcher``), whose system calls also order the data writes before
the reader's loads.

Status of a block or of the state: PENDING, OK (bytes are exactly what the tier returned) or
FAILED (a miss: its bytes in staging are meaningless and are never copied to the pools).

**Where the file lives, and who may touch it** (issue 31). The file holds a tenant's KV, and
``/dev/shm`` is shared by every local user and, with ``--ipc=host``, by every container:

- It lives in ``<root>/kvstore-<euid>/`` (root: ``/dev/shm``, or the temp directory where there
  is none), a directory that only this user can enter: created 0700, and refused when it is a
  symlink or owned by anyone else (``kvstore.privatefs``), so nobody else can plant, swap or
  read an entry in it.
- The file is created ``O_CREAT | O_EXCL | O_NOFOLLOW``, 0600, relative to that directory's
  descriptor; an entry already at the name is left alone and another random name taken.
- The fetcher process inherits the open file (``pass_fds``) and maps that: nothing ever opens
  the area again by its name, so neither an unlinked name nor a file planted at it later can
  receive KV.
- A live area is one whose ``flock`` is held: its creator takes it on the open file and keeps
  it until ``close`` (the fetcher's inherited descriptor shares it). ``remove_stale_areas``
  removes only files whose lock it can take, never judging by a pid, which an engine in another
  PID namespace sharing ``/dev/shm`` sees as dead (or as someone else's).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from kvstore.engine.kvlayout import KVLayout
from kvstore.errors import InvalidArgument, StagingFull
from kvstore.privatefs import PrivateDir

PENDING = 0
OK = 1
FAILED = 2

_MAGIC = np.frombuffer(b"KVSTAGE1", dtype="<u8")[0]
#: Sections start on this boundary: whole cache lines, and good DMA alignment on a GPU.
ALIGN = 64
#: Regions start on page boundaries so each can be handed to a device independently.
REGION_ALIGN = 4096
_FIXED_HEADER = 64
#: New random names tried when something is already at one (never overwritten or unlinked).
_NAME_ATTEMPTS = 8


def round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


@dataclass(frozen=True)
class StageLayout:
    """Byte map of one load's region: header, then one contiguous section per layer."""

    kv: KVLayout
    n_blocks: int
    with_state: bool
    #: The blocks land in the engine's KV rows themselves (``kvstore.engine.sharedkv``): the
    #: region holds the header and the window state only.
    blocks_in_place: bool
    layer_ready_offset: int
    block_status_offset: int
    header_bytes: int
    #: Per layer: (section offset, offset of its SWA window inside the region, section bytes).
    sections: tuple[tuple[int, int, int], ...]
    total_bytes: int

    @classmethod
    def plan(
        cls, kv: KVLayout, n_blocks: int, with_state: bool, blocks_in_place: bool = False
    ) -> StageLayout:
        if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 0:
            raise InvalidArgument("n_blocks", f"must be an integer >= 0, got {n_blocks!r}")
        ready = _FIXED_HEADER
        status = ready + 8 * kv.num_layers
        header = round_up(status + n_blocks, ALIGN)
        offset = header
        sections = []
        for item in kv.layers:
            blocks = 0 if blocks_in_place else n_blocks * item.block_nbytes
            state_at = round_up(offset + blocks, ALIGN)
            state = item.state_nbytes if with_state else 0
            end = round_up(state_at + state, ALIGN) if state else state_at
            sections.append((offset, state_at, end - offset))
            offset = end
        return cls(
            kv,
            n_blocks,
            bool(with_state),
            bool(blocks_in_place),
            ready,
            status,
            header,
            tuple(sections),
            offset,
        )

    # --- data views ------------------------------------------------------------------------

    def layer_span(self, layer: int) -> tuple[int, int]:
        """(offset, bytes) of everything layer ``layer`` needs (blocks then window)."""
        offset, _, nbytes = self.sections[self.kv.layer(layer).layer]
        return offset, nbytes

    def blocks_view(self, region: np.ndarray, layer: int) -> np.ndarray:
        """Layer ``layer``'s block bytes as ``[n_blocks, layer block bytes]`` (a view)."""
        if self.blocks_in_place:
            raise InvalidArgument("layout", "its blocks land in the KV rows, not in staging")
        item = self.kv.layer(layer)
        offset = self.sections[item.layer][0]
        raw = region[offset : offset + self.n_blocks * item.block_nbytes]
        return raw.reshape(self.n_blocks, item.block_nbytes)

    def block_segments(self) -> tuple[tuple[int, int, int], ...]:
        """Where a block's bytes go: ``(offset in the block, bytes, offset of row 0's slice
        in the region)`` per layer with block KV, in block order; row r's slice of a layer is
        r slices further on (``kvstore.blockstore.readblocks.Spread``)."""
        if self.blocks_in_place:
            raise InvalidArgument("layout", "its blocks land in the KV rows, not in staging")
        return tuple(
            (item.block_offset, item.block_nbytes, self.sections[item.layer][0])
            for item in self.kv.layers
            if item.block_nbytes
        )

    def state_view(self, region: np.ndarray, layer: int) -> np.ndarray:
        """Layer ``layer``'s SWA window as ``window_shape`` (empty when not staged)."""
        item = self.kv.layer(layer)
        at = self.sections[item.layer][1]
        if not (self.with_state and item.state_nbytes):
            return region[at:at]
        return region[at : at + item.state_nbytes].reshape(self.kv.window_shape)

    # --- header ----------------------------------------------------------------------------

    def header(self, region: np.ndarray) -> StageHeader:
        return StageHeader(self, region)


class StageHeader:
    """Typed access to a region's header words (shared memory: both processes see writes)."""

    def __init__(self, layout: StageLayout, region: np.ndarray) -> None:
        if region.size < layout.total_bytes:
            raise InvalidArgument(
                "region", f"has {region.size} bytes, the layout needs {layout.total_bytes}"
            )
        words = region[:_FIXED_HEADER].view("<u8")
        self._magic = words[0:1]
        self._job = words[1:2]
        self._counts = region[16:24].view("<u4")
        self._flags = region[24:32].view("<u8")
        self._done = words[4:5]
        self._state_status = region[40:41]
        self._statuses_final = words[6:7]
        n = layout.kv.num_layers
        self._ready = region[layout.layer_ready_offset : layout.layer_ready_offset + 8 * n].view(
            "<u8"
        )
        self._block_status = region[
            layout.block_status_offset : layout.block_status_offset + layout.n_blocks
        ]
        self.layout = layout

    def initialise(self, job_id: int) -> None:
        """Clear every word for a new job (the engine does this before handing the region out)."""
        self._ready[:] = 0
        self._block_status[:] = PENDING
        self._state_status[0] = PENDING
        self._done[0] = 0
        self._statuses_final[0] = 0
        self._counts[0] = self.layout.kv.num_layers
        self._counts[1] = self.layout.n_blocks
        self._flags[0] = int(self.layout.with_state)
        self._job[0] = job_id
        self._magic[0] = _MAGIC

    def check(self, job_id: int) -> None:
        """Raise when this region is not laid out for ``job_id`` (a mixed-up region)."""
        if self._magic[0] != _MAGIC or int(self._job[0]) != job_id:
            raise InvalidArgument("region", f"staging header does not belong to job {job_id}")
        if (int(self._counts[0]), int(self._counts[1])) != (
            self.layout.kv.num_layers,
            self.layout.n_blocks,
        ):
            raise InvalidArgument("region", "staging header counts differ from the layout")

    @property
    def job_id(self) -> int:
        return int(self._job[0])

    # Fetcher side ------------------------------------------------------------------------

    def set_state_status(self, state_ok: bool) -> None:
        """Set before the first layer is published."""
        self._state_status[0] = OK if state_ok else FAILED

    def set_block_statuses(self, block_ok: np.ndarray) -> None:
        """Set before the first layer with block bytes is published."""
        self._block_status[:] = np.where(block_ok, OK, FAILED)
        self._statuses_final[0] = self._job[0]

    def fail_blocks(self, failed: np.ndarray) -> None:
        """Blocks that failed after their first layers were published (a read that hands
        layers on as they arrive, ``kvstore.engine.directfetch``): OK only ever turns FAILED,
        before the last layer is published, so the statuses the engine reads once the last
        layer is in are the final ones."""
        self._block_status[np.flatnonzero(failed)] = FAILED

    def set_statuses(self, block_ok: np.ndarray, state_ok: bool | None) -> None:
        if state_ok is not None:
            self.set_state_status(state_ok)
        self.set_block_statuses(block_ok)

    def publish_layer(self, layer: int) -> None:
        self._ready[layer] = self._job[0]

    def publish_done(self) -> None:
        self._done[0] = self._job[0]

    # Engine side -------------------------------------------------------------------------

    def layer_ready(self, layer: int) -> bool:
        return bool(self._ready[layer] == self._job[0])

    def ready_layers(self) -> np.ndarray:
        return np.asarray(self._ready == self._job[0])

    @property
    def done(self) -> bool:
        return bool(self._done[0] == self._job[0])

    @property
    def statuses_final(self) -> bool:
        return bool(self._statuses_final[0] == self._job[0])

    def block_status(self) -> np.ndarray:
        return np.array(self._block_status, copy=True)

    @property
    def state_status(self) -> int:
        return int(self._state_status[0])


@dataclass(frozen=True)
class StagingRegion:
    """A slice of a staging area: ``nbytes`` at ``offset``."""

    offset: int
    nbytes: int


class StagingArea:
    """A shared-memory file both processes map; regions handed out first-fit, freed on finish.

    ``directory`` is the root the private ``kvstore-<euid>`` directory is made in (None:
    ``default_staging_root()``). ``fileno()`` is the open, locked file the fetcher inherits.
    """

    def __init__(
        self,
        capacity_bytes: int,
        directory: str | os.PathLike[str] | None = None,
        *,
        name_prefix: str = "kvstore-staging",
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise InvalidArgument("capacity_bytes", "must be an integer")
        if capacity_bytes < REGION_ALIGN:
            raise InvalidArgument(
                "capacity_bytes", f"must be at least {REGION_ALIGN}, got {capacity_bytes}"
            )
        self.capacity = round_up(capacity_bytes, REGION_ALIGN)
        root = Path(default_staging_root() if directory is None else directory)
        if not root.is_dir():
            raise InvalidArgument("directory", f"{root} is not a directory")
        self._dir = private_staging_dir(root)  # ConfigError when not ours alone
        self._fd = -1
        try:
            remove_stale_areas(self._dir, name_prefix)
            self._fd, self._name = _create_locked(self._dir, name_prefix)
            self.path = self._dir.path / self._name
            os.ftruncate(self._fd, self.capacity)
            # Reserve every page now: a full /dev/shm is an error here, not a SIGBUS in the
            # fetcher mid-load, and the first load does not pay for page allocation.
            try:
                os.posix_fallocate(self._fd, 0, self.capacity)
            except OSError as error:
                raise InvalidArgument(
                    "capacity_bytes",
                    f"{root} has no room for {self.capacity} B of staging ({error.strerror})",
                ) from None
            self._mmap: mmap.mmap | None = _map(self._fd, self.capacity)
        except BaseException:
            self._unlink_and_close()
            raise
        self.buffer = np.frombuffer(self._mmap, dtype=np.uint8)
        self._lock = threading.Lock()
        # Free extents (offset, nbytes), sorted by offset, coalesced on free.
        self._free: list[tuple[int, int]] = [(0, self.capacity)]
        self._used: dict[int, int] = {}

    def fileno(self) -> int:
        """The area's open file (read-write, holding its lock): what the fetcher maps."""
        if self._fd < 0:
            raise InvalidArgument("area", f"staging area {self.path.name} is closed")
        return self._fd

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)

    @property
    def used_regions(self) -> int:
        with self._lock:
            return len(self._used)

    def allocate(self, nbytes: int) -> StagingRegion:
        """A region of at least ``nbytes`` (page-rounded). Raises ``StagingFull`` when no free
        extent is large enough right now."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument("nbytes", f"must be a positive integer, got {nbytes!r}")
        size = round_up(nbytes, REGION_ALIGN)
        with self._lock:
            for index, (offset, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + size, free - size)
                    self._used[offset] = size
                    return StagingRegion(offset, size)
            largest = max((free for _, free in self._free), default=0)
        raise StagingFull(
            f"staging area {self.path.name} has no free extent of {size} B "
            f"(largest {largest} B of {self.capacity} B)"
        )

    def free(self, region: StagingRegion) -> None:
        with self._lock:
            if self._used.get(region.offset) != region.nbytes:
                raise InvalidArgument("region", f"{region} is not an allocated region")
            del self._used[region.offset]
            self._free.append((region.offset, region.nbytes))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for offset, size in self._free:
                if merged and merged[-1][0] + merged[-1][1] == offset:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((offset, size))
            self._free = merged

    def view(self, region: StagingRegion) -> np.ndarray:
        return self.buffer[region.offset : region.offset + region.nbytes]

    def close(self) -> None:
        """Unmap and remove the file. Idempotent."""
        self._unlink_and_close()
        if self._mmap is None:
            return
        mapping, self._mmap = self._mmap, None
        self.buffer = np.zeros(0, dtype=np.uint8)
        try:
            mapping.close()
        except BufferError:
            # A view (e.g. a tensor wrapping the buffer) is still alive; the mapping goes with it.
            pass

    def _unlink_and_close(self) -> None:
        if self._fd >= 0:
            # Unlinked while still locked, so no remover ever sees our live file unlocked; and
            # only if the name is still our file (it is in a directory only we can write).
            if _names(self._dir, self._name, self._fd):
                self._dir.remove(self._name)
            fd, self._fd = self._fd, -1
            os.close(fd)  # releases the lock unless the fetcher still holds the file
        self._dir.close()

    def __enter__(self) -> StagingArea:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def default_staging_root() -> str:
    """``/dev/shm`` (memory, never written back to a disk) where there is one, else the temp
    directory (still a private file, only slower if it is on disk)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def private_staging_dir(root: str | os.PathLike[str]) -> PrivateDir:
    """This user's ``<root>/kvstore-<euid>``, created 0700, held open; refused (``ConfigError``)
    when it is a symlink, someone else's, or writable by others: whoever could write to it
    could have planted or swapped an area's file."""
    where = Path(root) / f"kvstore-{os.geteuid()}"
    return PrivateDir.open(where, "staging_dir", check_parent=False)


def _create_locked(directory: PrivateDir, name_prefix: str) -> tuple[int, str]:
    """A new area file in ``directory``, open read-write and locked: (fd, name)."""
    for _ in range(_NAME_ATTEMPTS):
        name = f"{name_prefix}-{_random_suffix()}"
        try:
            fd = directory.create_shared(name)
        except FileExistsError:
            continue  # whatever is there stays untouched: it may be another live area
        try:
            # Blocks only while a remover in another process holds it: between our create and
            # this lock, the file was new and unlocked, so it may have just been unlinked.
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _names(directory, name, fd):
                return fd, name
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise InvalidArgument("directory", f"no free staging file name in {directory.path}")


def _random_suffix() -> str:
    return secrets.token_hex(8)


def _names(directory: PrivateDir, name: str, fd: int) -> bool:
    """Whether ``name`` in ``directory`` is (still) the file open as ``fd``."""
    try:
        entry = directory.lstat(name)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (entry.st_dev, entry.st_ino) == (mine.st_dev, mine.st_ino)


def remove_stale_areas(
    directory: PrivateDir | str | os.PathLike[str], name_prefix: str = "kvstore-staging"
) -> list[Path]:
    """Remove staging files left by engine processes that died without closing them.

    ``directory`` holds the areas (``private_staging_dir``'s). A file is stale when its lock
    can be taken: every live area's is held by its creator (and the fetcher that inherited
    it), in whatever PID namespace they run; a process's death releases it.
    """
    held = (
        directory
        if isinstance(directory, PrivateDir)
        else PrivateDir.open(directory, "staging_dir", check_parent=False)
    )
    removed = []
    try:
        for entry in held.entries():
            if not entry.name.startswith(f"{name_prefix}-"):
                continue
            if not entry.is_file(follow_symlinks=False):
                continue  # not something we make; opening a FIFO would block
            try:
                fd = held.open_read(entry.name)
            except OSError:
                continue  # gone meanwhile
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive
                # Unlinked while we hold its lock: a creator that made it a moment ago and
                # locks it after us sees the name gone and takes another.
                if _names(held, entry.name, fd):
                    held.remove(entry.name)
                    removed.append(held.path / entry.name)
            finally:
                os.close(fd)
    finally:
        if held is not directory:
            held.close()
    return removed


def _map(fd: int, size: int) -> mmap.mmap:
    """Map shared, read-write, page tables filled at once (Linux ``MAP_POPULATE``)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def map_staging_fd(fd: int) -> tuple[mmap.mmap, np.ndarray]:
    """Map the staging file open as ``fd`` read-write (the fetcher process's side: it inherits
    the engine's descriptor and never opens the area by name). Refuses anything but a regular
    file of this user (a wrong descriptor number, not an attack: the descriptor is ours)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        raise InvalidArgument("fd", f"descriptor {fd} is not a staging file of this user")
    mapping = _map(fd, info.st_size)
    return mapping, np.frombuffer(mapping, dtype=np.uint8)


class StagedSource(Protocol):
    """What swap-in reads: staged layers, announced one by one, and which blocks are good."""

    layout: StageLayout

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Block until ``layer`` is staged (or the fetch failed); False on timeout."""
        ...

    def region(self) -> np.ndarray:
        """The region's bytes (valid until ``release``)."""
        ...

    def block_ok(self) -> np.ndarray:
        """Bool per block: its staged bytes are exactly what the tier returned."""
        ...

    def state_ok(self) -> bool: ...

    @property
    def failure(self) -> str | None:
        """Why the whole fetch failed (fetcher died, ...), else None."""
        ...

    def release(self) -> None:
        """Give the region back; called once swap-in no longer reads it."""
        ...


class PreparedStage:
    """A staged load whose bytes are already in place (no fetcher): every layer is ready.

    Used when the engine fills a region itself (from a local host cache) and by the benchmark.
    """

    def __init__(
        self,
        area: StagingArea,
        layout: StageLayout,
        *,
        block_ok: np.ndarray | None = None,
        state_ok: bool = True,
    ) -> None:
        self.layout = layout
        self._area = area
        self._region: StagingRegion | None = area.allocate(layout.total_bytes)
        self._view = area.view(self._region)[: layout.total_bytes]
        self._block_ok = (
            np.ones(layout.n_blocks, dtype=bool) if block_ok is None else np.asarray(block_ok)
        )
        self._state_ok = bool(state_ok and layout.with_state)
        header = layout.header(self._view)
        header.initialise(job_id=1)

    def region(self) -> np.ndarray:
        return self._view

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        return True

    def block_ok(self) -> np.ndarray:
        return self._block_ok

    def state_ok(self) -> bool:
        return self._state_ok

    @property
    def failure(self) -> str | None:
        return None

    def release(self) -> None:
        if self._region is not None:
            self._area.free(self._region)
            self._region = None
