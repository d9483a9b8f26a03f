"""Prometheus figures of a kvstore gateway: RPC latency and errors, plus the tiers' own stats.

Each server gets its own ``CollectorRegistry`` (no process-global registry: two servers in one
process, as in tests, do not collide). Tier figures are read from the tier's ``stats()`` at
scrape time, so the endpoint and ``kvstore stats`` always show the same numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.tier.records import Stats

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


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
        nodes = GaugeMetricFamily("kvstore_storage_nodes", "Storage nodes", labels=["state"])
        nodes.add_metric(["live"], stats.live_storage_nodes)
        nodes.add_metric(["all"], stats.storage_nodes)
        yield nodes


class ApiMetrics:
    def __init__(self, stats: Callable[[], Stats] | None = None) -> None:
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
            self.registry.register(_TierCollector(stats))

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
