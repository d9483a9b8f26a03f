"""How the client reaches nodes and meta shards: submit calls, wait for some, read outcomes.

The client's logic (which nodes to ask, hedging, decoding, the write protocol) is written
against this small protocol so it runs unchanged over Ray (``kvstore.runtime.fanout.RayFanout``)
and in-process over plain objects (``LocalFanout``, for unit tests, with switches to make a
target dead or hung).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any, Protocol

from kvstore.errors import NodeUnavailable

#: ("node", node_id) or ("meta", shard_id).
Target = tuple[str, int]
NODE = "node"
META = "meta"


class Fanout(Protocol):
    def submit(self, target: Target, method: str, *args: Any) -> Any:
        """Start ``method(*args)`` on ``target``; returns a ticket (hashable)."""
        ...

    def wait(self, tickets: Collection[Any], timeout: float, all_of: bool = False) -> list[Any]:
        """Tickets of ``tickets`` that are done, waiting up to ``timeout`` s for at least one
        (``all_of``: for all of them)."""
        ...

    def result(self, ticket: Any) -> Any:
        """Outcome of a done ticket; raises ``NodeUnavailable`` when the target failed."""
        ...


class LocalFanout:
    """Runs calls synchronously on plain objects; ``dead`` targets fail, ``hung`` never answer."""

    def __init__(self, targets: Mapping[Target, object]) -> None:
        self.targets = dict(targets)
        self.dead: set[Target] = set()
        self.hung: set[Target] = set()
        self.calls: list[tuple[Target, str]] = []
        self._outcomes: dict[int, tuple[bool, Any]] = {}
        self._never: set[int] = set()
        self._ids = itertools.count()
        # The plain objects behind it are single-threaded (like an actor); the block client's
        # release flusher thread calls in too.
        self._lock = threading.RLock()

    def submit(self, target: Target, method: str, *args: Any) -> int:
        with self._lock:
            return self._submit(target, method, *args)

    def _submit(self, target: Target, method: str, *args: Any) -> int:
        ticket = next(self._ids)
        self.calls.append((target, method))
        if target in self.hung:
            self._never.add(ticket)
            return ticket
        if target in self.dead or target not in self.targets:
            self._outcomes[ticket] = (False, NodeUnavailable(f"{target} is down"))
            return ticket
        try:
            self._outcomes[ticket] = (True, getattr(self.targets[target], method)(*args))
        except Exception as error:  # the remote side raised: the caller sees a failed target
            self._outcomes[ticket] = (False, NodeUnavailable(f"{target}.{method}: {error!r}"))
        return ticket

    def wait(self, tickets: Collection[int], timeout: float, all_of: bool = False) -> list[int]:
        ready = [ticket for ticket in tickets if ticket not in self._never]
        hung = len(ready) < len(tickets)
        if hung and timeout > 0 and (all_of or not ready):
            time.sleep(timeout)  # a hung ticket never becomes ready: waiting is all one can do
        return ready

    def result(self, ticket: int) -> Any:
        with self._lock:
            ok, value = self._outcomes.pop(ticket)
        if not ok:
            raise value
        return value
