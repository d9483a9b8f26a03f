"""The files a storage node's segment log is made of, behind the few calls the log makes.

Why an interface: the log's rules (record framing, torn tails cut back, replay, rolling,
compaction) are about bytes at offsets, not about descriptors. With its file access behind
``LogFiles``/``LogFile`` the whole log runs over ``MemoryFiles`` in a unit test, as LevelDB's
log tests run over a string: write records, reopen, read them back, tear or damage bytes in
place and see what a reopen makes of them. ``DiskFiles`` is the one the node serves from:
every file reached relative to its held segments directory, never through a symlink
(``kvstore.privatefs``), with the same calls the log made on descriptors before.

A segment file has a reader always and a writer while it is the open segment (``start_writes``
... ``end_writes``): a sealed segment is never written again.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from kvstore.blockstore.capacity import allocated_bytes
from kvstore.privatefs import PrivateDir, write_all


class LogFile(Protocol):
    """One segment file."""

    def size(self) -> int: ...

    def allocated_bytes(self) -> int: ...

    def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer at the end of the file)."""
        ...

    def read_into(self, offset: int, into: memoryview) -> int:
        """Fill ``into`` from ``offset``; returns the bytes read (fewer at the end)."""
        ...

    def reader(self) -> int | None:
        """A new read descriptor of this file, the caller's to close; None where the file has
        none (in memory). It stays valid after the file is closed and removed here."""
        ...

    def start_writes(self) -> None:
        """Open the file for writing (the open segment of a restarted log)."""
        ...

    def write(self, parts: Sequence[Any], offset: int) -> None:
        """Write the buffers ``parts`` end to end at ``offset``: one call (``OSError``)."""
        ...

    def truncate(self, size: int) -> None: ...

    def reserve(self, offset: int, length: int) -> None:
        """Have the file system allocate blocks for these bytes now, the size unchanged:
        appends into them then skip the block allocation each flush would otherwise make
        (advice: where the file system cannot, nothing happens; ``truncate`` to the size
        gives back what was not written)."""
        ...

    def sync(self) -> None:
        """Make what was written durable (``fdatasync``)."""
        ...

    def end_writes(self) -> None: ...

    def drop_cached(self, offset: int, length: int) -> None:
        """Let the page cache drop these bytes (advice: pages still dirty stay)."""
        ...

    def close(self) -> None: ...


class LogFiles(Protocol):
    """The directory of a log's segment files."""

    def names(self) -> list[str]:
        """The regular files in it (a symlink is not one)."""
        ...

    def create(self, name: str) -> LogFile:
        """A new empty file ``name``, open for writing; whatever was at the name is replaced."""
        ...

    def open(self, name: str) -> LogFile:
        """The existing file ``name``, for reading (``OSError`` when absent or not a file)."""
        ...

    def remove(self, name: str) -> None: ...

    def sync(self) -> None:
        """Make creates and removes durable (the directory's ``fsync``)."""
        ...

    def where(self, name: str) -> str:
        """``name`` as a person finds it (a path), for logs and tools."""
        ...


_FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _keep_size_fallocate(fd: int, offset: int, length: int) -> None:
    """``fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length)``, failures ignored: Python's
    ``os.posix_fallocate`` takes no flags, and it would grow the file's size, which is where
    a restarted log stops reading."""
    if _libc is not None:
        _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, ctypes.c_long(offset), ctypes.c_long(length))


class DiskFile:
    """A segment file on disk: a read descriptor, and a write descriptor while open."""

    def __init__(self, directory: PrivateDir, name: str, read_fd: int, write_fd: int = -1) -> None:
        self._directory = directory
        self._name = name
        self._read_fd = read_fd
        self._write_fd = write_fd

    def size(self) -> int:
        return os.fstat(self._read_fd).st_size

    def allocated_bytes(self) -> int:
        return allocated_bytes(os.fstat(self._read_fd))

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self._read_fd, size, offset)

    def read_into(self, offset: int, into: memoryview) -> int:
        return os.preadv(self._read_fd, [into], offset)

    def reader(self) -> int | None:
        return os.dup(self._read_fd)

    def start_writes(self) -> None:
        self._write_fd = self._directory.open_write(self._name)

    def write(self, parts: Sequence[Any], offset: int) -> None:
        write_all(self._write_fd, parts, offset)

    def truncate(self, size: int) -> None:
        os.ftruncate(self._write_fd, size)

    def reserve(self, offset: int, length: int) -> None:
        _keep_size_fallocate(self._write_fd, offset, length)

    def sync(self) -> None:
        os.fdatasync(self._write_fd)

    def end_writes(self) -> None:
        if self._write_fd >= 0:
            os.close(self._write_fd)
        self._write_fd = -1

    def drop_cached(self, offset: int, length: int) -> None:
        os.posix_fadvise(self._read_fd, offset, length, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self.end_writes()
        if self._read_fd >= 0:
            os.close(self._read_fd)
        self._read_fd = -1


class DiskFiles:
    """Segment files in a held private directory (``kvstore.privatefs``)."""

    def __init__(self, directory: PrivateDir) -> None:
        self.directory = directory

    def names(self) -> list[str]:
        return [e.name for e in self.directory.entries() if e.is_file(follow_symlinks=False)]

    def create(self, name: str) -> DiskFile:
        write_fd = self.directory.create(name)
        try:
            read_fd = self.directory.open_read(name)
        except OSError:
            os.close(write_fd)
            self.directory.remove(name)
            raise
        return DiskFile(self.directory, name, read_fd, write_fd)

    def open(self, name: str) -> DiskFile:
        return DiskFile(self.directory, name, self.directory.open_read(name))

    def remove(self, name: str) -> None:
        self.directory.remove(name)

    def sync(self) -> None:
        self.directory.fsync()

    def where(self, name: str) -> str:
        return str(self.directory.path / name)


class MemoryFile:
    """A segment file held in a ``bytearray`` (shared by every opening of the name)."""

    def __init__(self, files: MemoryFiles, name: str, writable: bool) -> None:
        self._files = files
        self._name = name
        self._writable = writable
        self._closed = False

    @property
    def _data(self) -> bytearray:
        if self._closed:
            raise OSError(errno.EBADF, f"{self._name} is closed")
        return self._files.data[self._name]

    def size(self) -> int:
        return len(self._data)

    def allocated_bytes(self) -> int:
        return len(self._data)

    def read(self, offset: int, size: int) -> bytes:
        return bytes(self._data[offset : offset + size])

    def read_into(self, offset: int, into: memoryview) -> int:
        chunk = self._data[offset : offset + len(into)]
        into[: len(chunk)] = chunk
        return len(chunk)

    def reader(self) -> int | None:
        return None

    def start_writes(self) -> None:
        self._writable = True

    def _writer(self) -> bytearray:
        if not self._writable:
            raise OSError(errno.EBADF, f"{self._name} is not open for writing")
        return self._data

    def write(self, parts: Sequence[Any], offset: int) -> None:
        data = self._writer()
        blob = b"".join(memoryview(part).cast("B") for part in parts)
        self._files.writes += 1
        if self._files.fail_writes:
            raise OSError(errno.ENOSPC, "no space left (MemoryFiles.fail_writes)")
        if offset > len(data):
            data.extend(bytes(offset - len(data)))
        data[offset : offset + len(blob)] = blob

    def truncate(self, size: int) -> None:
        data = self._writer()
        if size < len(data):
            del data[size:]
        else:
            data.extend(bytes(size - len(data)))

    def reserve(self, offset: int, length: int) -> None:
        self._writer()
        self._files.reserved.append((self._name, offset, length))

    def sync(self) -> None:
        self._writer()

    def end_writes(self) -> None:
        self._writable = False

    def drop_cached(self, offset: int, length: int) -> None:
        self._data  # noqa: B018  # a closed file raises, as a descriptor would
        self._files.dropped.append((self._name, offset, length))

    def close(self) -> None:
        self._closed = True


class MemoryFiles:
    """A directory of segment files in memory: what the log's unit tests run it over. Tests
    reach the bytes through ``data`` (tear a tail, flip a byte) and count ``writes``;
    ``fail_writes`` makes every write raise, as a full disk does; ``dropped`` lists the
    (name, offset, length) the log let the page cache drop, ``reserved`` those it had
    allocated ahead of its appends."""

    def __init__(self) -> None:
        self.data: dict[str, bytearray] = {}
        self.writes = 0
        self.fail_writes = False
        self.dropped: list[tuple[str, int, int]] = []
        self.reserved: list[tuple[str, int, int]] = []

    def names(self) -> list[str]:
        return sorted(self.data)

    def create(self, name: str) -> MemoryFile:
        self.data[name] = bytearray()
        return MemoryFile(self, name, writable=True)

    def open(self, name: str) -> MemoryFile:
        if name not in self.data:
            raise FileNotFoundError(errno.ENOENT, f"no file {name}")
        return MemoryFile(self, name, writable=False)

    def remove(self, name: str) -> None:
        self.data.pop(name, None)

    def sync(self) -> None:
        pass

    def where(self, name: str) -> str:
        return f"memory:{name}"


class CacheBound:
    """Which appends to keep in the page cache: the newest ``bound`` bytes (None: all).
    ``appended`` notes one append (to file ``file``: any id the caller uses) and returns the
    oldest appends now past the bound, whose pages the caller lets go (``segmentlog.py`` says
    why)."""

    def __init__(self, bound: int | None) -> None:
        self._bound = bound
        self._held: deque[tuple[int, int, int]] = deque()  # (file, offset, length), oldest first
        self._held_bytes = 0

    def appended(self, file: int, offset: int, length: int) -> list[tuple[int, int, int]]:
        if self._bound is None:
            return []
        self._held.append((file, offset, length))
        self._held_bytes += length
        past = []
        while self._held_bytes > self._bound:
            past.append(self._held.popleft())
            self._held_bytes -= past[-1][2]
        return past
