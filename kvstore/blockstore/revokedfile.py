"""A storage node's revocations on disk (``REVOKED`` in its data dir), so that a restarted node
still refuses the read capabilities of leases released before it went down.

The tier tells every node once which leases were released (``kvstore.tier.revoke``); a node
keeps them in memory until each would have ended anyway (``capability.Revocations``). Memory
alone forgets them when the node's process dies: once Ray restarts it, a released lease's
capability would read again until its end. So each batch the node is told is also appended here,
one line of JSON (``{"until": end, "ids": [...]}``), and on stable storage before the call
returns; a node starting reads back the batches not yet ended and rewrites the file with those
alone (atomically). While it runs, the file is rewritten the same way once it has grown past
twice what was kept the last time (at least ``REWRITE_BYTES``): it holds about one lease
lifetime of releases, never the node's whole history.

A line that does not parse (a crash in the middle of an append) is skipped: that batch's call
never returned, and the tier's lease end still bounds it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence

from kvstore.privatefs import PrivateDir, write_all

log = logging.getLogger(__name__)

#: The file's name in the node's data dir.
NAME = "REVOKED"
#: The file is rewritten with its current batches alone once past twice what that left, and
#: never below this.
REWRITE_BYTES = 1 << 20

#: One batch: its lease ids and the end until which they stay refused.
Batch = tuple[list[str], float]


class RevokedFile:
    """The revocations of the node whose data dir is ``directory`` (held by that node);
    ``batches``: those read back at start, not ended at ``now``. Thread-safe."""

    def __init__(self, directory: PrivateDir, now: float) -> None:
        self._dir = directory
        self._lock = threading.Lock()
        self._fd = -1
        self.batches: list[Batch] = self._current(now)
        self._rewrite(self.batches)

    def append(self, lease_ids: Sequence[str], until: float, now: float) -> None:
        """Keep a batch of revocations (refused until ``until``) on stable storage."""
        line = _line(list(lease_ids), until)
        with self._lock:
            write_all(self._fd, [line])
            os.fdatasync(self._fd)
            self._size += len(line)
            if self._size > self._rewrite_at:
                self._rewrite(self._current(now))

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _current(self, now: float) -> list[Batch]:
        """The batches in the file that have not ended at ``now``."""
        try:
            raw = self._dir.read(NAME)
        except FileNotFoundError:
            return []
        kept: list[Batch] = []
        for number, line in enumerate(raw.splitlines(), 1):
            try:
                entry = json.loads(line)
                until = float(entry["until"])
                ids = [str(lease_id) for lease_id in entry["ids"]]
            except (ValueError, KeyError, TypeError):
                log.warning("%s: line %d is not a batch of revocations; skipped", NAME, number)
                continue
            if until > now:
                kept.append((ids, until))
        return kept

    def _rewrite(self, batches: list[Batch]) -> None:
        data = b"".join(_line(ids, until) for ids, until in batches)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._dir.write_atomically(NAME, [data], sync=True)
        self._fd = self._dir.open_write(NAME)
        os.lseek(self._fd, 0, os.SEEK_END)
        self._size = len(data)
        self._rewrite_at = max(REWRITE_BYTES, 2 * len(data))


def _line(lease_ids: list[str], until: float) -> bytes:
    return json.dumps({"until": until, "ids": lease_ids}, separators=(",", ":")).encode() + b"\n"
