"""The repair control loop: health checks, repair rounds paced to a byte cap, drains, scrub.

One ``tick`` = the health checks when ``health_interval_s`` has passed since the last (the dead
set is published to the meta shards when it changes), the scrub's share of bytes when due, and
one repair round. ``pace_s`` says how long to wait before the next tick so the restored bytes
stay under ``repair_bytes_per_s`` (a token bucket: a round runs at once, the next waits for its
bytes' worth of time; a short burst is allowed so small rounds do not wait at all). A driver
(``kvstore.runtime.blockstore_actors.RepairActor``) runs ticks back to back while there is a
backlog and every ``health_interval_s`` otherwise.

Drains: a node is draining when it says so in its health check (its flag is kept on its disk,
so a drain survives restarts of the node and of this loop) or when ``drain`` asked for it. A
drain is *done* when, in a queue rescanned at least ``2 * call_timeout_s`` after the drain
began (so a put that placed a shard on the node just before it drained has committed), no
stripe has a shard on the node.

``tick`` never raises: a failing step is logged and counted, the next tick tries again.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from kvstore.blockstore.repair import HealthTracker, Repairer
from kvstore.clock import Clock, SystemClock
from kvstore.errors import InvalidArgument

log = logging.getLogger(__name__)

#: Seconds of repair bytes a round may run ahead of the cap (a burst).
BURST_S = 0.25
#: Window the restored-bytes rate is measured over (seconds).
RATE_WINDOW_S = 10.0


class RepairLoop:
    """See the module doc. ``checker`` (a ``Repairer`` on a fanout of its own, default
    ``repairer``) makes the health checks: a driver may run ``check_health`` in a thread of
    its own, so a check waiting on a node that just died never holds up a round."""

    def __init__(
        self,
        repairer: Repairer,
        health: HealthTracker,
        clock: Clock | None = None,
        checker: Repairer | None = None,
    ):
        self.repairer = repairer
        self.health = health
        self._checker = checker or repairer
        self._clock = clock or SystemClock()
        config = repairer.config
        self._interval = config.health_interval_s
        self._settle_s = 2 * config.call_timeout_s
        self.repair_bytes_per_s = config.repair_bytes_per_s
        self.scrub_bytes_per_s = config.scrub_bytes_per_s
        self._published: set[int] | None = None
        self._probed_at: float | None = None
        self._scrubbed_at: float | None = None
        self._reported: set[int] = set()  # draining, as the nodes said at the last probe
        self._drains: dict[int, float] = {}  # node -> when this loop saw its drain begin
        self._done: set[int] = set()
        self._refresh = False
        self._debt_until = 0.0  # the token bucket: when the bytes restored so far are paid
        self._restored: deque[tuple[float, float]] = deque()  # (time, bytes) in the window
        self.ticks = 0
        self.errors = 0
        self.last_step: dict[str, float] = {}

    # --- the loop --------------------------------------------------------------------------

    def check_health(self) -> set[int]:
        """Health checks of every node now; the dead set goes to the meta shards when it
        changed. Returns the dead set."""
        self._probed_at = self._clock.now()
        self._reported = self._checker.probe(self.health)
        dead = self.health.dead
        if dead != self._published:
            self._checker.publish_down(dead)
            self._published = dead
        return dead

    def tick(self, check_health: bool = True) -> dict[str, float]:
        """One cycle: the health checks when due (unless a driver runs them itself:
        ``check_health`` False), the scrub when due, one repair round."""
        self.ticks += 1
        try:
            now = self._clock.now()
            due = self._probed_at is None or now - self._probed_at >= self._interval
            if check_health and due:
                self.check_health()
            dead = self.health.dead
            if dead != self._published:  # not yet told the meta shards: no repair before
                self.last_step = {}
                return self.last_step
            self._scrub(dead, now)
            draining = self.draining()
            refresh, self._refresh = self._refresh, False
            step = self.repairer.round(dead, draining, refresh=refresh)
            self._after_round(step, draining, refresh, now)
            self.last_step = step
        except Exception:  # a control loop survives a failing step
            self.errors += 1
            log.exception("repair tick failed")
            self.last_step = {}
        return self.last_step

    def pace_s(self) -> float:
        """How long to wait before the next round (0: go on at once)."""
        return max(0.0, self._debt_until - self._clock.now() - BURST_S)

    def backlog(self) -> bool:
        """Whether the last round found work (the driver then ticks again without the
        health interval's pause)."""
        return bool(self.last_step.get("stripes") or self.last_step.get("unrecoverable"))

    def _scrub(self, dead: set[int], now: float) -> None:
        if not self.scrub_bytes_per_s:
            return
        if self._scrubbed_at is None:
            self._scrubbed_at = now
            return
        elapsed = now - self._scrubbed_at
        if elapsed < self._interval:
            return
        self._scrubbed_at = now
        self.repairer.scrub(dead, int(self.scrub_bytes_per_s * min(elapsed, 10 * self._interval)))

    def _after_round(
        self, step: dict[str, float], draining: set[int], refresh: bool, started: float
    ) -> None:
        restored = step.get("bytes", 0.0)
        now = self._clock.now()
        if restored:
            self._debt_until = max(self._debt_until, now) + restored / self.repair_bytes_per_s
            self._restored.append((now, restored))
        while self._restored and now - self._restored[0][0] > RATE_WINDOW_S:
            self._restored.popleft()
        queue = self.repairer.queue
        left = queue.get("draining", {})
        for node in draining:
            empty = queue.get("complete") and int(left.get(str(node), 0)) == 0
            if not empty:
                self._done.discard(node)
            elif refresh and started - self._drains.get(node, started) >= self._settle_s:
                self._done.add(node)
            elif node not in self._done:
                self._refresh = True  # confirm on a fresh scan

    # --- drains ----------------------------------------------------------------------------

    def draining(self) -> set[int]:
        """Nodes being drained (those that said so, and those asked here), minus dead ones."""
        now = self._clock.now()
        nodes = (self._reported | set(self._drains)) - self.health.dead
        for node in nodes:
            self._drains.setdefault(node, now)
        for node in set(self._drains) - nodes - self.health.dead:
            self._drains.pop(node, None)
            self._done.discard(node)
        return nodes

    def drain(self, node: int, flag: bool = True) -> dict[str, Any]:
        """Start (or, with ``flag`` False, stop) draining ``node``; returns its status."""
        if node not in self.repairer.nodes:
            raise InvalidArgument(
                "node_id", f"no storage node {node} (known: {self.repairer.nodes})"
            )
        self.repairer.set_draining(node, flag)
        if flag:
            self._reported.add(node)
            self._drains.setdefault(node, self._clock.now())
        else:
            self._reported.discard(node)
            self._drains.pop(node, None)
            self._done.discard(node)
        return self.drain_status(node)

    def drain_status(self, node: int) -> dict[str, Any]:
        queue = self.repairer.queue
        return {
            "node": node,
            "draining": node in self._drains,
            "stripes_left": queue.get("draining", {}).get(str(node)),
            "bytes_left": queue.get("draining_bytes", {}).get(str(node)),
            "done": node in self._done,
        }

    # --- figures ---------------------------------------------------------------------------

    def rate(self) -> float:
        """Shard bytes restored per second over the last ``RATE_WINDOW_S``."""
        if not self._restored:
            return 0.0
        span = max(self._clock.now() - self._restored[0][0], self._interval)
        return sum(size for _, size in self._restored) / span

    def progress(self) -> dict[str, Any]:
        queue = self.repairer.queue
        rate = self.rate()
        left = int(queue.get("bytes_left", 0))
        return {
            "stripes_left": int(queue.get("stripes_left", 0)),
            "bytes_left": left,
            "lost_2": int(queue.get("lost_2", 0)),
            "lost_1": int(queue.get("lost_1", 0)),
            "moving": int(queue.get("moving", 0)),
            "rate_bytes_per_s": rate,
            "eta_s": (left / rate if rate else None) if left else 0.0,
            "cap_bytes_per_s": self.repair_bytes_per_s,
        }

    def stats(self) -> dict[str, object]:
        counters = self.repairer.counters
        seconds = counters.get("seconds", 0.0)
        left = self.repairer.queue.get("draining", {})
        left_bytes = self.repairer.queue.get("draining_bytes", {})
        return {
            **counters,
            "throughput_bytes_per_s": counters.get("bytes", 0.0) / seconds if seconds else 0.0,
            "phase_s": {name: round(value, 3) for name, value in self.repairer.phase_s.items()},
            "progress": self.progress(),
            "draining": {
                str(node): {
                    "stripes_left": int(left.get(str(node), 0)),
                    "bytes_left": int(left_bytes.get(str(node), 0)),
                    "done": node in self._done,
                }
                for node in sorted(self._drains)
            },
            "scrub": {
                "shards": int(counters.get("scrub_shards", 0)),
                "bytes": int(counters.get("scrub_bytes", 0)),
                "corrupt": int(counters.get("corrupt_shards", 0)),
                "rate_bytes_per_s": self.scrub_bytes_per_s,
            },
            "dead_nodes": sorted(self.health.dead),
            "failing_nodes": sorted(self.health.failing()),
            "ticks": self.ticks,
            "errors": self.errors,
            "last_step": dict(self.last_step),
        }

    def set_rates(
        self, repair_bytes_per_s: int | None = None, scrub_bytes_per_s: int | None = None
    ) -> dict[str, int]:
        if repair_bytes_per_s is not None:
            if repair_bytes_per_s <= 0:
                raise InvalidArgument(
                    "repair_bytes_per_s", f"must be > 0, got {repair_bytes_per_s}"
                )
            self.repair_bytes_per_s = int(repair_bytes_per_s)
        if scrub_bytes_per_s is not None:
            if scrub_bytes_per_s < 0:
                raise InvalidArgument("scrub_bytes_per_s", f"must be >= 0, got {scrub_bytes_per_s}")
            self.scrub_bytes_per_s = int(scrub_bytes_per_s)
        return {
            "repair_bytes_per_s": self.repair_bytes_per_s,
            "scrub_bytes_per_s": self.scrub_bytes_per_s,
        }
