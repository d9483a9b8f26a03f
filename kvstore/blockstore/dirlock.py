"""One serving process per storage node directory: an exclusive ``flock`` on ``<data_dir>/LOCK``.

Why: a node appends to its log (``kvstore.blockstore.segments``). Two processes appending to one
segment would interleave records and tear each other's writes. That can happen without a bug of
ours: ``ray.kill`` is asynchronous, and Ray may start the restarted actor while the old process
still runs. So a node takes the lock before it reads or writes anything, waiting a bounded while
for a previous holder to exit, and holds it for as long as its process lives (the kernel drops
it when the process dies, however it dies). Tools that kill a node wait for the lock to be free
(``wait_unlocked``) before they count the node as gone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from typing import IO

from kvstore.errors import StoreError
from kvstore.privatefs import PrivateDir

LOCK_NAME = "LOCK"
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class DirLock:
    """The held lock of one node directory."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @classmethod
    def take(cls, directory: PrivateDir, owner: str, timeout_s: float = 30.0) -> DirLock:
        """Lock ``directory`` for this process, waiting up to ``timeout_s`` for another holder
        to exit; ``StoreError`` naming the directory when it does not."""
        try:
            fd = directory.open_read(LOCK_NAME)
        except FileNotFoundError:
            fd = -1
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            directory.remove(
                LOCK_NAME
            )  # a symlink planted at the name: the link goes, not its target
            fd = -1
        if fd < 0:
            try:
                fd = directory.create(LOCK_NAME)  # O_EXCL | O_NOFOLLOW: never a planted link
            except FileExistsError:  # another starter made it in between
                fd = directory.open_read(LOCK_NAME)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return cls(fd)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise StoreError(
                        f"{directory.path} is held by another process serving it ({owner}); "
                        f"waited {timeout_s:.0f} s for it to exit"
                    ) from None
                time.sleep(0.02)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the file drops the lock
            self._fd = -1

    def __del__(self) -> None:
        self.release()


def open_lock(data_dir: str | os.PathLike[str]) -> IO[bytes] | None:
    """A node directory's ``LOCK`` file, opened to watch it (``wait_unlocked``), or None when it
    is not visible from here (another machine) or was never made."""
    try:
        return os.fdopen(os.open(os.path.join(data_dir, LOCK_NAME), _READ), "rb")
    except OSError:
        return None


def wait_unlocked(lock: IO[bytes], timeout_s: float, poll_s: float = 0.01) -> bool:
    """Wait until no process holds ``lock``, i.e. the node process that did is gone; True if so
    within ``timeout_s``. Closes ``lock``."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(poll_s)
                continue
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
            return True
    finally:
        lock.close()
