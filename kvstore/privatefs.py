"""Directories and files on local disk that only the service's own user can read or plant in.

Why (issue 15, a security review of ``kvstore up``): storage-node data dirs were 0755 and shard
files 0644, so any local user read another tenant's KV; and a data dir pre-created by another
user, with ``LIVE.tmp`` / ``NODE.tmp`` symlinked to a root-owned 0600 file, made a root storage
node overwrite that file (``mkdir(exist_ok=True)`` accepted the foreign dir, and temp files were
opened through the link). Every store keeping files on local disk (storage nodes, the
``DirectoryTier``) goes through this module instead, under these rules:

- **Modes, set explicitly.** Directories are made 0700, files created 0600, and both
  ``fchmod``-ed to exactly that (a umask like 0277 would otherwise leave 0400; the extra call is
  lost in the noise of creating a file). Not by ``umask(0o077)`` at start: the umask is per
  process, shared with whatever else runs in it (a Ray worker's logs and spill files, a test
  runner, an engine that embeds a ``DirectoryTier``), and changing it races their threads' own
  creates.
- **Whose directory.** A directory is used only if it is not a symlink, is owned by this
  process's effective uid, and is not group- or world-writable: anyone else who could write to
  it may have planted entries in it already, so it is refused (``ConfigError`` naming the path
  and what is wrong), never "fixed". One of ours that others may only read or enter (0755, what
  earlier versions created) is tightened to 0700 and used: nobody else could have written it.
  The directory above a store's own (a storage node's data root) is checked, not changed: it
  is the operator's.
- **No path is followed twice.** Once verified, a directory is held open and everything in it is
  reached relative to that descriptor with ``O_NOFOLLOW``, so a parent renamed or a symlink
  planted afterwards is never followed. New files are ``O_CREAT | O_EXCL``: an entry already at
  the name (a temp file a crash left, a planted symlink) is unlinked — the link itself, never its
  target — and the create tried once more; if something raced in again, the write fails cleanly.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError

DIR_MODE = 0o700
FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_SHARED_FILE = (_NEW_FILE & ~os.O_WRONLY) | os.O_RDWR
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class PrivateDir:
    """An open directory that passed the checks above (its mode is 0700); ``path`` is for
    messages and for processes that open it again (they check it again)."""

    __slots__ = ("fd", "path", "_field")

    def __init__(self, fd: int, path: Path, field: str) -> None:
        self.fd = fd
        self.path = path
        self._field = field

    @classmethod
    def open(cls, path: str | os.PathLike[str], field: str, *, check_parent: bool) -> PrivateDir:
        """The directory at ``path``, created 0700 if missing (its parents too). ``field``
        names the setting in errors; ``check_parent``: the directory above must pass the
        ownership rule as well (and must not be a symlink)."""
        where = Path(os.path.abspath(path))
        if not where.name:
            raise ConfigError(field, f"{where} cannot be a store's directory")
        parent = where.parent
        if not os.path.lexists(parent):
            os.makedirs(parent, mode=DIR_MODE, exist_ok=True)
        flags = _DIR_FLAGS | (os.O_NOFOLLOW if check_parent else 0)
        try:
            parent_fd = os.open(parent, flags)
        except OSError as error:
            raise ConfigError(field, _unusable(parent, error)) from None
        try:
            if check_parent:
                _check_owner(os.fstat(parent_fd), parent, field)
            return cls._open_at(parent_fd, where.name, where, field)
        finally:
            os.close(parent_fd)

    @classmethod
    def _open_at(cls, parent_fd: int, name: str, path: Path, field: str) -> PrivateDir:
        try:
            os.mkdir(name, DIR_MODE, dir_fd=parent_fd)
        except FileExistsError:
            pass  # checked below like any other
        try:
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
        except OSError as error:
            raise ConfigError(field, _unusable(path, error)) from None
        try:
            _check_owner(os.fstat(fd), path, field)
            os.fchmod(fd, DIR_MODE)  # exactly 0700, whatever the umask or an older version made
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path, field)

    def subdir(self, name: str) -> PrivateDir:
        """The directory ``name`` in this one, created or checked like this one."""
        return self._open_at(self.fd, name, self.path / name, self._field)

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # --- files -------------------------------------------------------------------------------

    def create(self, name: str) -> int:
        """A new 0600 file ``name`` opened for writing (the caller closes it). Whatever was at
        the name is unlinked first, never written through."""
        try:
            return self._new_file(name, _NEW_FILE)
        except FileExistsError:
            self.remove(name)  # the entry itself: a symlink's target is not touched
            return self._new_file(name, _NEW_FILE)

    def create_shared(self, name: str) -> int:
        """A new 0600 file ``name`` opened read-write, for mapping shared (the caller closes
        it). ``FileExistsError`` when anything is at the name, and that entry is left alone:
        where several live processes of ours keep files in one directory (the engine's staging
        areas) it may be another one's file, so the caller picks another name."""
        return self._new_file(name, _NEW_SHARED_FILE)

    def _new_file(self, name: str, flags: int) -> int:
        fd = os.open(name, flags, FILE_MODE, dir_fd=self.fd)
        try:
            os.fchmod(fd, FILE_MODE)  # exactly 0600, whatever the umask took away
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write_atomically(
        self, name: str, parts: Sequence[Any], *, sync: bool, temp: str | None = None
    ) -> None:
        """``name`` holds ``parts`` (buffers) in whole or keeps what it held: written to
        ``temp`` (default ``<name>.tmp``) and renamed over it. ``sync``: file and directory
        are on stable storage before this returns."""
        temporary = temp or f"{name}.tmp"
        fd = self.create(temporary)
        try:
            write_all(fd, parts)
            if sync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            self.remove(temporary)
            raise
        os.close(fd)
        try:
            self.replace(temporary, name)
        except BaseException:
            self.remove(temporary)
            raise
        if sync:
            self.fsync()

    def open_read(self, name: str) -> int:
        """``name`` opened for reading, never through a symlink (the caller closes it)."""
        return os.open(name, _READ, dir_fd=self.fd)

    def open_write(self, name: str) -> int:
        """The existing file ``name`` opened for writing, never through a symlink."""
        return os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)

    def read(self, name: str) -> bytes:
        """The whole of file ``name`` (``FileNotFoundError`` when absent)."""
        with os.fdopen(self.open_read(name), "rb", buffering=0) as handle:
            return handle.readall()

    def replace(self, name: str, new_name: str, into: PrivateDir | None = None) -> None:
        """Rename ``name`` to ``new_name`` in this directory or in ``into`` (atomic)."""
        target = self if into is None else into
        os.replace(name, new_name, src_dir_fd=self.fd, dst_dir_fd=target.fd)

    def remove(self, name: str) -> bool:
        """Unlink ``name`` (a symlink itself, not its target); False when it was not there."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def is_file(self, name: str) -> bool:
        """A regular file is at ``name`` (a symlink is not one)."""
        try:
            return stat.S_ISREG(self.lstat(name).st_mode)
        except OSError:
            return False

    def is_dir(self, name: str) -> bool:
        """A directory is at ``name`` (a symlink is not one)."""
        try:
            return stat.S_ISDIR(self.lstat(name).st_mode)
        except OSError:
            return False

    def entries(self) -> Iterator[os.DirEntry[str]]:
        """What is in this directory (``entry.stat(follow_symlinks=False)`` is relative to it)."""
        with os.scandir(self.fd) as found:
            yield from found

    def tighten(self, name: str, status: os.stat_result) -> None:
        """Make the regular file ``name`` (``status``: its lstat) 0600 if an older version left
        it looser."""
        if stat.S_ISREG(status.st_mode) and stat.S_IMODE(status.st_mode) != FILE_MODE:
            fd = self.open_read(name)
            try:
                os.fchmod(fd, FILE_MODE)
            finally:
                os.close(fd)

    def fsync(self) -> None:
        """Make this directory's entries (creates, renames, unlinks) durable."""
        try:
            os.fsync(self.fd)
        except OSError as error:  # some filesystems refuse fsync on directories
            if error.errno not in (errno.EINVAL, errno.EBADF):
                raise


def write_all(fd: int, parts: Sequence[Any], offset: int | None = None) -> int:
    """Write the buffers ``parts`` to ``fd`` in order, finishing short writes; returns bytes.
    ``offset``: write there (``pwritev``) instead of at the file position. At most 1,000 buffers
    go to one call (IOV_MAX is 1,024 on Linux)."""
    views = [memoryview(part).cast("B") for part in parts]
    views = [view for view in views if len(view)]
    total = sum(len(view) for view in views)
    while views:
        batch = views[:1000]
        if offset is None:
            done = os.writev(fd, batch)
        else:
            done = os.pwritev(fd, batch, offset)
            offset += done
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]
    return total


def check_private_file(path: Path, what: str) -> None:
    """Refuse a secret file that is a symlink, not ours, or readable by group or others."""
    try:
        info = os.lstat(path)
    except OSError as error:
        raise ConfigError(what, f"cannot read {path}: {error.strerror}") from error
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise ConfigError(what, f"{path} must be a regular file, not a link")
    if info.st_mode & 0o077:
        raise ConfigError(
            what,
            f"{path} is readable by group or others (mode {stat.S_IMODE(info.st_mode):04o}); "
            f"chmod 600 it",
        )
    if info.st_uid != os.geteuid():
        raise ConfigError(what, f"{path} is owned by uid {info.st_uid}, not by this service")


def create_private_file(path: Path, content: bytes, what: str) -> None:
    """Make ``path`` (0600) holding ``content`` unless it exists; never overwrites. Written
    whole under a private name (mkstemp: 0600), then linked into place: no reader sees it
    half-written, and of two processes starting at once the first one wins."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as error:
        raise ConfigError(what, f"cannot create {path}: {error.strerror}") from error
    try:
        write_all(fd, [content])
        os.fsync(fd)
        os.close(fd)
        fd = -1
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError as error:
            raise ConfigError(what, f"cannot create {path}: {error.strerror}") from error
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)


def _check_owner(status: os.stat_result, path: Path, field: str) -> None:
    uid = os.geteuid()
    if status.st_uid != uid:
        raise ConfigError(
            field,
            f"{path} is owned by uid {status.st_uid}, not by this service's uid {uid}: its "
            "owner could have planted files in it (chown it to the service user, or choose "
            "another directory)",
        )
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            field,
            f"{path} is group- or world-writable (mode {stat.S_IMODE(status.st_mode):o}): "
            "others could have planted files in it (make it 0700 or 0755 after checking what "
            "is in it, or choose another directory)",
        )


def _unusable(path: Path, error: OSError) -> str:
    if error.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
        return f"{path} is a symlink: give the real directory instead"
    if error.errno == errno.ENOTDIR:
        return f"{path} is not a directory"
    return f"cannot open {path}: {error.strerror or error}"
