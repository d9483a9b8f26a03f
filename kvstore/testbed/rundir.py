"""A testbed's run directory: made fresh and private, and checked again before secrets go in.

The run directory holds the Ray token, the gateway's bearer token and its TLS key and
certificate, made by root (the testbed needs it for its namespaces) under ``/tmp``, where every
local user may create entries. It used to be ``/tmp/kvstore-testbed/<name>``: a name known in
advance, in a parent anyone could have made first. Another user could then put a link to a
directory of theirs in its place before the gateway's secrets were made, and root served TLS
with that user's certificate. So:

- the run directory is ``mkdtemp``'s (``make_run_dir``): a name no one knew, made 0700 in one
  step that fails rather than reuse or follow anything already there, in a parent whose entries
  only its owner (this user or root) can change: not writable by others, or sticky like /tmp;
- before anything secret is written into it, it is checked again (``check_private``): a
  directory, not a link, this user's, mode 0700, so nothing can have been put in its place.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from kvstore.errors import ConfigError


def make_run_dir(root: Path, name: str) -> Path:
    """A new private directory for testbed ``name`` in ``root`` (``<name>-<random>``); raises
    ``ConfigError`` when ``root`` lets another user replace what is made in it."""
    root = Path(os.path.realpath(root))  # checked as it is now: a link in it cannot be swapped
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.stat(root)
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError("run_root", f"{root} is not a directory")
    if info.st_uid not in (0, os.geteuid()):
        raise ConfigError(
            "run_root",
            f"{root} belongs to uid {info.st_uid}, who could replace a run directory made in it "
            "(choose a directory of this user's or root's)",
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise ConfigError(
            "run_root",
            f"{root} is writable by others and not sticky (mode {stat.S_IMODE(info.st_mode):o}):"
            " anyone could replace a run directory made in it (chmod o-w or +t it)",
        )
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    check_private(run_dir)
    return run_dir


def check_private(path: Path) -> None:
    """Raise ``ConfigError`` unless ``path`` is a directory (not a link) of this user's, mode
    0700: what a secret may be written into."""
    info = os.lstat(path)
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ConfigError("run_dir", f"{path} is not a directory (a link?): no secret goes there")
    if info.st_uid != os.geteuid() or mode != 0o700:
        raise ConfigError(
            "run_dir",
            f"{path} is uid {info.st_uid}'s with mode {mode:o}, not this user's with 0700: "
            "no secret goes there",
        )


def is_ours(path: Path) -> bool:
    """Whether ``path`` is a directory (not a link) of this user's: a run directory another
    user planted is neither attached to nor removed."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
