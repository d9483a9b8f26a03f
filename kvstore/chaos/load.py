"""Bounded background read/write load on a ``ChaosTier``, every read checked against the ledger.

Writers put fresh blocks (``payload_for`` bytes) and add what was acknowledged to the ledger;
readers read random committed blocks and classify each read: bit-exact, a miss, or wrong. Each
thread has its own tier facade (``ChaosTier.facade``: the seam engines use, over a block client of
its own). Loops are bounded by a stop event, a deadline and an operation budget, and an exception
escaping a tier call — the tier promises never to raise for node failures — is counted, never
swallowed silently.

Every put call is logged with its time and outcome (``PutRecord``: stored, of which
under-redundant, failed) and every get call with its latency, so a scenario can count what
happened in a window of its own (``LoadStats.puts_between``, ``percentile_ms(since, until)``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import TracebackType

import numpy as np

from kvstore.chaos.tier import ChaosTier
from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadConfig:
    writers: int = 1
    readers: int = 2
    put_batch: int = 4
    get_batch: int = 8
    traffic_class: str = "default"
    #: Pause between two operations of one thread (keeps a 2-core box responsive).
    pause_s: float = 0.02
    max_seconds: float = 300.0
    max_operations: int = 200_000

    def __post_init__(self) -> None:
        for name in ("writers", "readers", "max_operations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(name, f"must be an integer >= 0, got {value!r}")
        for name in ("put_batch", "get_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(name, f"must be a positive integer, got {value!r}")
        if self.pause_s < 0 or self.max_seconds <= 0:
            raise InvalidArgument("pause_s", "pause_s must be >= 0 and max_seconds > 0")


@dataclass(frozen=True)
class PutRecord:
    """One put call of the load: when, and what became of its blocks."""

    started: float  # monotonic
    ended: float
    #: Committed by this put (full or under-redundant) ...
    stored: int
    #: ... of which with fewer than the stripe's width of shards (the tier's ``PutAnswer``
    #: counts them once ``min_write_shards`` lets a put commit on fewer live failure domains).
    under_redundant: int
    #: Not stored (failed or busy): not visible.
    failed: int
    #: The keys this put made visible (the ledger's new entries).
    keys: tuple[BlockKey, ...]


@dataclass(frozen=True)
class PutCounts:
    """Blocks of the put calls in a window: fully redundant, under-redundant, failed."""

    calls: int = 0
    ok: int = 0
    under_redundant: int = 0
    failed: int = 0

    @property
    def attempted(self) -> int:
        return self.ok + self.under_redundant + self.failed

    @property
    def stored_fraction(self) -> float | None:
        """Share of the attempted blocks stored (under-redundant ones count as stored)."""
        if not self.attempted:
            return None
        return (self.ok + self.under_redundant) / self.attempted

    def as_dict(self) -> dict[str, object]:
        fraction = self.stored_fraction
        return {
            "calls": self.calls,
            "ok": self.ok,
            "under_redundant": self.under_redundant,
            "failed": self.failed,
            "stored_fraction": None if fraction is None else round(fraction, 4),
        }


@dataclass
class LoadStats:
    puts_ok: int = 0
    puts_under_redundant: int = 0
    puts_failed: int = 0
    reads_ok: int = 0
    read_misses: int = 0
    wrong_bytes: int = 0
    errors: int = 0
    operations: int = 0
    error_messages: list[str] = field(default_factory=list)
    missed_keys: list[BlockKey] = field(default_factory=list)
    #: (monotonic start, seconds) of the get call of each missed key, in the same order: when
    #: a scenario's misses happened, and whether the call ran into its deadline.
    missed_in: list[tuple[float, float]] = field(default_factory=list)
    #: Why each missed key missed, as the tier said (``BlockRead.miss_detail``), same order.
    missed_why: list[str | None] = field(default_factory=list)
    #: (monotonic start, seconds) of every get call.
    get_latencies: list[tuple[float, float]] = field(default_factory=list)
    #: Every put call, in the order they ended.
    put_log: list[PutRecord] = field(default_factory=list)

    def latencies(self, since: float | None = None, until: float | None = None) -> list[float]:
        """Seconds of the get calls that started in ``[since, until)`` (open ends: all)."""
        return [
            s
            for t, s in self.get_latencies
            if (since is None or t >= since) and (until is None or t < until)
        ]

    def percentile_ms(
        self, q: float, since: float | None = None, until: float | None = None
    ) -> float | None:
        samples = self.latencies(since, until)
        if not samples:
            return None
        return float(np.percentile(samples, q) * 1e3)

    def puts_between(
        self, since: float, until: float | None = None, *, running: bool = False
    ) -> PutCounts:
        """The put calls that started in ``[since, until)``, their blocks counted; with
        ``running``, those running at some moment of it (a put in flight when a fault
        strikes ends short too)."""
        calls = ok = under = failed = 0
        for record in self.put_log:
            first = record.ended if running else record.started
            if first < since or (until is not None and record.started >= until):
                continue
            calls += 1
            ok += record.stored - record.under_redundant
            under += record.under_redundant
            failed += record.failed
        return PutCounts(calls, ok, under, failed)

    def keys_put_between(self, since: float, until: float | None = None) -> list[BlockKey]:
        """Keys committed by put calls that started in ``[since, until)``."""
        return [
            key
            for record in self.put_log
            if record.started >= since and (until is None or record.started < until)
            for key in record.keys
        ]

    def as_dict(self) -> dict[str, object]:
        return {
            "puts_ok": self.puts_ok,
            "puts_under_redundant": self.puts_under_redundant,
            "puts_failed": self.puts_failed,
            "reads_ok": self.reads_ok,
            "read_misses": self.read_misses,
            "wrong_bytes": self.wrong_bytes,
            "errors": self.errors,
            "operations": self.operations,
            "get_p50_ms": self.percentile_ms(50),
            "get_p99_ms": self.percentile_ms(99),
            "error_messages": self.error_messages[:5],
        }


class LoadGenerator:
    """``with LoadGenerator(tier, LoadConfig()) as load: ...`` then ``load.stats``."""

    def __init__(self, tier: ChaosTier, config: LoadConfig | None = None, seed: int = 0) -> None:
        self._tier = tier
        self._config = config or LoadConfig()
        self._seed = seed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.stats = LoadStats()
        self._deadline = 0.0

    def __enter__(self) -> LoadGenerator:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        self._deadline = time.monotonic() + self._config.max_seconds
        for index in range(self._config.writers):
            self._spawn(self._write_loop, f"chaos-writer-{index}", index)
        for index in range(self._config.readers):
            self._spawn(self._read_loop, f"chaos-reader-{index}", index)

    def _spawn(self, target: Callable[[int], None], name: str, index: int) -> None:
        thread = threading.Thread(target=target, args=(index,), name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def stop(self) -> LoadStats:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self._tier.config.call_timeout_s * 4 + 10)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            self._error(f"load threads still running after stop: {alive}")
        self._threads = []
        return self.stats

    def snapshot(self) -> LoadStats:
        """A consistent copy of the figures so far (the load keeps running)."""
        with self._lock:
            stats = self.stats
            return replace(
                stats,
                error_messages=list(stats.error_messages),
                missed_keys=list(stats.missed_keys),
                missed_in=list(stats.missed_in),
                missed_why=list(stats.missed_why),
                get_latencies=list(stats.get_latencies),
                put_log=list(stats.put_log),
            )

    def _running(self) -> bool:
        return (
            not self._stop.is_set()
            and time.monotonic() < self._deadline
            and self.stats.operations < self._config.max_operations
        )

    def _error(self, message: str) -> None:
        with self._lock:
            self.stats.errors += 1
            if len(self.stats.error_messages) < 20:
                self.stats.error_messages.append(message)

    def _write_loop(self, index: int) -> None:
        writer = self._tier.facade()  # through the tier seam, as an engine writes
        rng = random.Random(self._seed * 1000 + index)
        while self._running():
            keys = [BlockKey(rng.randbytes(32)) for _ in range(self._config.put_batch)]
            started = time.monotonic()
            try:
                answer = self._tier.put(keys, self._config.traffic_class, writer)
            except Exception as error:  # the tier must not raise for node failures
                self._error(f"put raised {type(error).__name__}: {error}")
                continue
            failed = len(answer.failed_keys) + len(answer.busy_keys)
            under = answer.under_redundant
            record = PutRecord(
                started,
                time.monotonic(),
                answer.stored,
                under,
                failed,
                tuple(answer.committed_keys(keys)),
            )
            with self._lock:
                self.stats.operations += len(keys)
                self.stats.puts_ok += answer.stored
                self.stats.puts_under_redundant += under
                self.stats.puts_failed += failed
                self.stats.put_log.append(record)
            self._stop.wait(self._config.pause_s)

    def _read_loop(self, index: int) -> None:
        reader = self._tier.facade()  # through the tier seam, as an engine reads
        rng = random.Random(self._seed * 1000 + 500 + index)
        ledger = self._tier.ledger
        while self._running():
            keys = ledger.sample(self._config.get_batch, rng)
            if not keys:
                self._stop.wait(0.05)
                continue
            started = time.monotonic()
            try:
                got = reader.get_blocks(keys)
            except Exception as error:
                self._error(f"get raised {type(error).__name__}: {error}")
                continue
            seconds = time.monotonic() - started
            check = ledger.check(keys, [read.payload for read in got])
            why = {read.key: read.miss_detail for read in got if read.payload is None}
            with self._lock:
                self.stats.operations += len(keys)
                self.stats.reads_ok += check.ok
                self.stats.read_misses += check.misses
                self.stats.wrong_bytes += check.wrong
                self.stats.missed_keys.extend(check.missed_keys)
                self.stats.missed_in.extend([(started, seconds)] * len(check.missed_keys))
                self.stats.missed_why.extend(why.get(key) for key in check.missed_keys)
                self.stats.get_latencies.append((started, seconds))
            self._stop.wait(self._config.pause_s)
