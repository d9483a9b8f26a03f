"""The disk line of ``benchmarks/blockstore.py``: what the disk itself takes of a put, written
by one process with none of the tier around it.

Each put batch's stripes (every shard of every block, as the 12 storage nodes write them) are
appended to one file in the run's data root: one write and, unless ``fsync`` is ``never``, one
``fdatasync`` a batch, as a node's log appends a batch. Like the nodes' logs it keeps only its
newest ``cached`` bytes in the page cache (the nodes' ``cached_log_bytes``, all of them
together), letting older pages go after their flush, so both write into memory they gave back
rather than memory the machine never touched (which costs several times as much on a VM whose
host reclaims unused guest memory: ``kvstore/blockstore/segmentlog.py``).
"""

from __future__ import annotations

import os
from collections import deque

import numpy as np


class DiskLine:
    def __init__(self, path: str, fsync: str, cached: int | None) -> None:
        """``fsync``: the nodes' policy; ``cached``: bytes kept in the page cache (None: no
        bound)."""
        self._path = path
        self._fsync = fsync
        self._cached = cached
        self._fd = -1
        self._size = 0
        self._held: deque[tuple[int, int]] = deque()  # (offset, length), oldest first
        self._held_bytes = 0

    def append(self, data: np.ndarray) -> None:
        if self._fd < 0:
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        written = os.pwrite(self._fd, data, self._size)  # type: ignore[arg-type]
        if written != data.nbytes:
            raise OSError(f"{self._path}: a short write ({written} of {data.nbytes} bytes)")
        if self._fsync != "never":
            os.fdatasync(self._fd)
        self._held.append((self._size, written))
        self._held_bytes += written
        self._size += written
        while self._cached is not None and self._held_bytes > self._cached:
            offset, length = self._held.popleft()
            self._held_bytes -= length
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1
