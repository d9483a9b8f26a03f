"""Which storage nodes an engine reader leaves out: for now, those that failed it lately; for
the rest of a read, those far behind the others (``Stragglers``).

A node that failed an exchange (``readlinks.NodeLinks``: not reached, timed out, not a reply)
rests: the reads that follow leave it out, so their blocks come from parity at once instead of
each waiting out its deadline on a host that was cut off or a process that froze. Once its rest
is over it is dialed in the background, and it is back when that dial succeeds (the new
connection is the reader's to pool). Each failure in a row, a failed background dial included,
doubles the next rest, up to ``REST_MAX_S``; a reply that comes whole ends the row. A frozen
process still takes a dial (its kernel accepts), so the doubling is what keeps it from costing
every read its deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

#: A straggler's grace (``Stragglers``): this many times what the exchange took so far, at least
#: ``HEDGE_MIN_S``. A node that lags that far behind the others is slow, not jittery: the
#: read decodes around it rather than wait out its deadline.
HEDGE_FACTOR = 4.0
HEDGE_MIN_S = 0.5
#: A node's first rest after a failure, in seconds; doubled per failure in a row.
REST_S = 1.0
REST_MAX_S = 30.0

C = TypeVar("C")  # what a background dial gets: a connection, closed with ``close``


class _Rest(Generic[C]):
    __slots__ = ("until", "check", "conn")

    def __init__(self, until: float) -> None:
        self.until = until
        self.check: threading.Thread | None = None
        self.conn: C | None = None  # what the dial got, read once it is over


class NodeRests(Generic[C]):
    """``dial(node)`` makes a connection to ``node`` (bounded; raises ``OSError`` or
    ``ValueError`` when it cannot), ``close(conn)`` closes one. Not thread-safe: one reader's."""

    def __init__(self, dial: Callable[[int], C], close: Callable[[C], object]) -> None:
        self._dial = dial
        self._close = close
        self._strikes: dict[int, int] = {}  # failures in a row, per node
        self._resting: dict[int, _Rest[C]] = {}
        self._closed = False

    def failed(self, node: int) -> bool:
        """``node`` failed an exchange: it rests (True when it was not resting yet)."""
        if node in self._resting:
            return False
        self._resting[node] = _Rest(time.monotonic() + self._strike(node))
        return True

    def answered(self, node: int) -> None:
        """A reply of ``node`` came whole: its failures in a row are over."""
        self._strikes.pop(node, None)

    def resting(self) -> tuple[set[int], dict[int, C]]:
        """The nodes to leave out now, and those back, each with the connection its background
        dial made. A node whose rest is over is dialed in the background now; a failed dial
        starts a longer rest."""
        now = time.monotonic()
        back: dict[int, C] = {}
        for node, rest in self._resting.items():
            if rest.check is not None and not rest.check.is_alive():
                rest.check = None  # over: ``rest.conn`` is what it got
                if rest.conn is not None:
                    back[node] = rest.conn
                    continue
                rest.until = now + self._strike(node)
            if rest.check is None and now >= rest.until:
                rest.check = threading.Thread(target=self._check, args=(node, rest), daemon=True)
                rest.check.start()
        for node in back:
            del self._resting[node]
        return set(self._resting), back

    def close(self) -> None:
        """The reader is done: a background dial still out closes what it gets."""
        self._closed = True
        for rest in self._resting.values():
            if rest.check is not None and not rest.check.is_alive() and rest.conn is not None:
                self._close(rest.conn)
        self._resting.clear()

    def _check(self, node: int, rest: _Rest[C]) -> None:
        """A resting node's background dial (its own thread)."""
        try:
            conn: C | None = self._dial(node)
        except (OSError, ValueError):
            conn = None
        if conn is not None and self._closed:
            self._close(conn)
            conn = None
        rest.conn = conn

    def _strike(self, node: int) -> float:
        """One more failure of ``node`` in a row: the rest it earns, in seconds."""
        strikes = self._strikes[node] = self._strikes.get(node, 0) + 1
        return float(min(REST_MAX_S, REST_S * 2 ** (strikes - 1)))


class Stragglers:
    """When an exchange (``readlinks.NodeLinks.exchange``) gives up on its stragglers.
    ``spare``: how many of the ``asked`` replies it can do without (what the blocks' parity
    can stand in for: a node holds one shard of a block). Once no more than that many are out,
    and some are in, they get ``HEDGE_FACTOR`` times what the exchange took so far
    (``HEDGE_MIN_S`` at the least); then they count as down for the read, as at the deadline,
    and their blocks are decoded around them. The usual replies' C call
    (``_recvpieces.take_replies``) applies the same rule to the ones it takes."""

    def __init__(self, spare: int, asked: int, deadline: float) -> None:
        self.spare = spare if asked > spare else 0  # none in: nothing to be behind
        self.asked = asked
        self.deadline = deadline
        self.min_s, self.factor = HEDGE_MIN_S, HEDGE_FACTOR
        self.started = time.monotonic()
        self._give_up: float | None = None

    def lose(self) -> None:
        """A node was lost (failed, or given up on): its blocks use up one of the spare."""
        self.spare = max(0, self.spare - 1)

    def until(self, out: int) -> float:
        """When to stop waiting, with ``out`` of the ``asked`` replies still out."""
        if not 0 < out <= self.spare or out >= self.asked:
            self._give_up = None  # not down to the stragglers (or back up: a node caught up)
            return self.deadline
        if self._give_up is None:
            now = time.monotonic()
            self._give_up = now + max(self.min_s, self.factor * (now - self.started))
        return min(self.deadline, self._give_up)
