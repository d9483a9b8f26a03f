"""The in-flight byte budget of a server: how many request bytes it holds at once.

A connection reserves its request's size (known from the length prefix) before it reads the
body and gives it back once the reply is sent; with the budget spent it waits up to
``budget_wait_s`` (TCP holds the sender back meanwhile), then reads the body into nothing and
answers ``busy`` (as does a request larger than the whole budget): the caller's call fails
(``NodeUnavailable``), the connection and every other peer go on. A body must arrive, and a
reply be taken, within ``io_timeout_s`` (``frames.IO_TIMEOUT_S``), so a stalled peer gives its
bytes back. Replies are not counted: the served methods make them one at a time (the actor's
lock) and each lives only until it is sent, within the same bound.
"""

from __future__ import annotations

import threading

#: Request bytes a server holds at once, by default (a few of the largest batches).
INFLIGHT_BYTES = 256 << 20
#: How long a request waits for the budget before it is answered ``busy``: under the callers'
#: own send bound (``HANDSHAKE_TIMEOUT_S`` at the least), so they read "busy", not a timeout.
BUDGET_WAIT_S = 1.0


class Budget:
    """Request bytes a server holds at once, at most ``limit`` (see the module doc)."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"max_inflight_bytes must be positive, got {limit}")
        self.limit = limit
        self.held = 0
        self.peak = 0
        self.refused = 0
        self._changed = threading.Condition()

    def take(self, size: int, wait_s: float) -> bool:
        """Reserve ``size`` bytes, waiting up to ``wait_s`` for them; False: refused."""
        with self._changed:
            if size > self.limit or not self._changed.wait_for(
                lambda: self.held + size <= self.limit, wait_s
            ):
                self.refused += 1
                return False
            self.held += size
            self.peak = max(self.peak, self.held)
            return True

    def give(self, size: int) -> None:
        with self._changed:
            self.held -= size
            self._changed.notify_all()

    def refusal(self, size: int, wait_s: float) -> str:
        """Why a request of ``size`` bytes was refused (after waiting ``wait_s``)."""
        if size > self.limit:
            return f"a call of {size} bytes is over the in-flight budget of {self.limit}"
        return f"{self.held} of {self.limit} in-flight bytes held for {wait_s} s"
