"""The gRPC gateway in front of a tier, on its own asyncio loop in a background thread.

So a synchronous program (``kvstore up``, the demo, a benchmark, a test) can serve any
``kvstore.tier.protocols.Tier`` — the deployed cluster's ``ClusterTier``, or an in-process stand-in
in the unit tests — without running an event loop itself.
"""

from __future__ import annotations

import asyncio
import gc
import threading

from kvstore.api.metrics import ApiMetrics
from kvstore.api.server import ServerOptions, create_server
from kvstore.tenants import TenantDirectory
from kvstore.tier.protocols import Tier


class Gateway:
    """``metrics_port``: serve Prometheus figures there, on ``metrics_host`` (loopback unless
    told otherwise: the figures describe every tenant's traffic). ``tenants``: who may call
    (default: what ``options`` name)."""

    def __init__(
        self,
        tier: Tier,
        options: ServerOptions,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        tenants: TenantDirectory | None = None,
    ):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-gateway")
        self._thread.daemon = True
        self._thread.start()
        self.metrics = ApiMetrics(tier.stats)
        #: Who may call, and the secret their namespaces come from.
        self.tenants = tenants or options.tenant_directory()
        server, port, executor = asyncio.run_coroutine_threadsafe(
            create_server(tier, options, self.metrics, self.tenants), self._loop
        ).result(timeout=60)
        self._server = server
        self._executor = executor
        self.port = port
        self.address = f"{options.host}:{port}"
        self.metrics_port = (
            self.metrics.serve(metrics_port, metrics_host) if metrics_port is not None else None
        )
        # What exists now (modules, the tier's clients and handles) lives as long as the
        # process: take it out of the cyclic GC's scans so collections while serving stay short.
        gc.freeze()

    def stop(self, grace_s: float = 2.0) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop).result(
            timeout=grace_s + 10
        )
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
