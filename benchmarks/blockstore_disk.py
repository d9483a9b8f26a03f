"""The disk line of ``benchmarks/blockstore.py``: what the disk itself takes of a put, written
by one process with none of the tier around it.

Each put batch's stripes (every shard of every block, as the 12 storage nodes write them) are
appended to one file in the run's data root: one write and, unless ``fsync`` is ``never``, one
``fdatasync`` a batch, as a node's log appends a batch. Like the nodes' logs it keeps only its
newest ``cached`` bytes in the page cache (the nodes' ``cached_log_bytes``, all of them
together; ``kvstore/blockstore/segmentlog.py`` says why), letting older pages go after their
flush.
"""

from __future__ import annotations

import os

import numpy as np

from kvstore.blockstore.logfiles import CacheBound


class DiskLine:
    def __init__(self, path: str, fsync: str, cached: int | None) -> None:
        """``fsync``: the nodes' policy; ``cached``: bytes kept in the page cache (None: no
        bound)."""
        self._path = path
        self._fsync = fsync
        self._fd = -1
        self._size = 0
        self._cached = CacheBound(cached)

    def append(self, data: np.ndarray) -> None:
        if self._fd < 0:
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        written = os.pwrite(self._fd, data, self._size)  # type: ignore[arg-type]
        if written != data.nbytes:
            raise OSError(f"{self._path}: a short write ({written} of {data.nbytes} bytes)")
        if self._fsync != "never":
            os.fdatasync(self._fd)
        for _, offset, length in self._cached.appended(0, self._size, written):
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)
        self._size += written

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1
