"""The one time source of kvstore's control loops, injected so tests move time without sleeping.

Nothing in kvstore patches or reads ``time.time`` directly for policy decisions (TTL, leases,
health deadlines); it asks a ``Clock``. Production uses ``SystemClock``; tests use ``ManualClock``
and ``advance()`` by days.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the Unix epoch (wall time: comparable across processes)."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"seconds: cannot move a clock backwards ({seconds})")
        self._now += seconds
        return self._now

    def set(self, when: float) -> None:
        if when < self._now:
            raise ValueError(f"when: cannot move a clock backwards ({when} < {self._now})")
        self._now = float(when)
