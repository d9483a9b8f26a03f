"""Prometheus figures of a kvstore gateway: RPC latency and errors, plus the tiers' own stats.

Each server gets its own ``CollectorRegistry`` (no process-global registry: two servers in one
process, as in tests, do not collide). Tier figures come from the tier's ``stats()`` — which
asks every meta shard — at most once per ``max_age_s`` however many scrapers there are: a scrape
is served the last figures, so scraping cannot load the cluster (16 scrapers with a fan-out
each raised QueryHit p50 tenfold).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.tier.records import Stats, stat_number

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class CachedStats:
    """``stats()`` at most once per ``max_age_s``; callers in between get the last figures
    (one caller refreshes, the others do not wait for it)."""

    def __init__(self, stats: Callable[[], Stats], max_age_s: float = 5.0) -> None:
        self._stats = stats
        self._max_age_s = max_age_s
        self._last: tuple[float, Stats] | None = None
        self._refreshing = threading.Lock()

    def __call__(self) -> Stats:
        last = self._last
        if last is not None and time.monotonic() - last[0] < self._max_age_s:
            return last[1]
        if not self._refreshing.acquire(blocking=last is None):
            assert last is not None
            return last[1]  # another scrape is refreshing: serve what we have
        try:
            stats = self._stats()
            self._last = (time.monotonic(), stats)
            return stats
        finally:
            self._refreshing.release()


class _TierCollector(Collector):
    def __init__(self, stats: Callable[[], Stats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        try:
            stats = self._stats()
        except Exception:  # a scrape must not fail because the cluster is busy
            log.warning("stats unavailable for a metrics scrape", exc_info=True)
            return
        hit_rate = GaugeMetricFamily(
            "kvstore_block_hit_rate", "Hit blocks / looked-up blocks", labels=["traffic_class"]
        )
        lookups = CounterMetricFamily(
            "kvstore_block_lookups", "Blocks looked up", labels=["traffic_class", "result"]
        )
        misses = CounterMetricFamily(
            "kvstore_block_misses", "Missed blocks by reason", labels=["traffic_class", "reason"]
        )
        stored = GaugeMetricFamily(
            "kvstore_class_stored_bytes", "Logical block bytes by class", labels=["traffic_class"]
        )
        for name, figures in sorted(stats.classes.items()):
            hits = int(figures.get("hit_blocks", 0))
            missed = int(figures.get("miss_blocks", 0))
            hit_rate.add_metric([name], hits / (hits + missed) if hits + missed else 0.0)
            lookups.add_metric([name, "hit"], hits)
            lookups.add_metric([name, "miss"], missed)
            for reason, count in sorted(figures.get("miss_reasons", {}).items()):
                misses.add_metric([name, reason], int(count))
            stored.add_metric([name], int(figures.get("stored_bytes", 0)))
        tier = GaugeMetricFamily("kvstore_stored_bytes", "Bytes stored per tier", labels=["tier"])
        tier.add_metric(["block"], stats.block_bytes_stored)
        tier.add_metric(["swa"], stats.swa_bytes_stored)
        yield from (hit_rate, lookups, misses, stored, tier)
        yield CounterMetricFamily(
            "kvstore_degraded_reads",
            "Blocks rebuilt from parity on read",
            value=stats.degraded_reads,
        )
        repairs = GaugeMetricFamily("kvstore_repair_stripes", "Repair progress", labels=["state"])
        repairs.add_metric(["done"], stats.repairs_done)
        repairs.add_metric(["pending"], stats.repairs_pending)
        yield repairs
        yield from _repair_progress(stats.extra.get("repair"))
        nodes = GaugeMetricFamily("kvstore_storage_nodes", "Storage nodes", labels=["state"])
        nodes.add_metric(["live"], stats.live_storage_nodes)
        nodes.add_metric(["all"], stats.storage_nodes)
        yield nodes


def _repair_progress(repair: Any) -> Iterator[Any]:
    """Repair, drain and scrub figures of the repair actor (``Stats.extra["repair"]``). Each
    one the actor does not report (an older actor, one that did not answer) is left out rather
    than exported as 0: "no figure" must not read as "nothing left to repair"."""
    if not isinstance(repair, Mapping):
        return
    progress = repair.get("progress")
    simple = (
        (
            "kvstore_repair_bytes_left",
            "Shard bytes repair still has to restore or move",
            "bytes_left",
        ),
        (
            "kvstore_repair_rate_bytes_per_second",
            "Shard bytes repair restores or moves per second",
            "rate_bytes_per_s",
        ),
        ("kvstore_repair_eta_seconds", "Seconds until repair has nothing left", "eta_s"),
    )
    for name, documentation, key in simple:
        value = stat_number(progress, key)
        if value is not None:
            yield GaugeMetricFamily(name, documentation, value=value)
    left = GaugeMetricFamily(
        "kvstore_repair_stripes_left",
        "Stripes repair still has to restore (lost 2 or 1 shards) or move off draining nodes",
        labels=["lost"],
    )
    for label, key in (("2", "lost_2"), ("1", "lost_1"), ("moving", "moving")):
        value = stat_number(progress, key)
        if value is not None:
            left.add_metric([label], value)
    if left.samples:
        yield left
    scrub = repair.get("scrub")
    for name, documentation, key in (
        ("kvstore_scrub_bytes", "Shard bytes the background scrub verified", "bytes"),
        ("kvstore_scrub_corrupt_shards", "Corrupt shards the background scrub found", "corrupt"),
    ):
        value = stat_number(scrub, key)
        if value is not None:
            yield CounterMetricFamily(name, documentation, value=value)
    draining = repair.get("draining")
    if isinstance(draining, Mapping) and draining:
        nodes = GaugeMetricFamily(
            "kvstore_draining_stripes_left",
            "Stripes that still have a shard on a draining storage node",
            labels=["node"],
        )
        for node, entry in sorted(
            draining.items(), key=lambda item: (len(str(item[0])), str(item[0]))
        ):
            value = stat_number(entry, "stripes_left")
            if value is not None:
                nodes.add_metric([str(node)], value)
        if nodes.samples:
            yield nodes


class ApiMetrics:
    def __init__(
        self, stats: Callable[[], Stats] | None = None, stats_max_age_s: float = 5.0
    ) -> None:
        self.registry = CollectorRegistry()
        self._latency = Histogram(
            "kvstore_rpc_seconds",
            "gRPC handler latency",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._errors = Counter(
            "kvstore_rpc_errors",
            "gRPC calls answered with an error",
            ["method", "code"],
            registry=self.registry,
        )
        self._latency_of: dict[str, Any] = {}
        if stats is not None:
            self.registry.register(_TierCollector(CachedStats(stats, stats_max_age_s)))

    def observe(self, method: str, seconds: float) -> None:
        # labels() resolves its child under a lock on every call; keep each method's child.
        child = self._latency_of.get(method)
        if child is None:
            child = self._latency_of[method] = self._latency.labels(method=method)
        child.observe(seconds)

    def error(self, method: str, code: str) -> None:
        self._errors.labels(method=method, code=code).inc()

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` over HTTP; returns the bound port (port 0 picks a free one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
