"""Stand the whole of kvstore up on a Ray cluster and serve it over gRPC.

``Service.start(config)`` connects to Ray (the embedded local cluster by default, an existing one
with ``address``, or a ``LocalCluster``), deploys the block tier (storage nodes, meta shards,
repair), the SWA tier (a store per machine, the entrypoint directory) and the GC worker, and
builds the gateway's backend. ``serve()`` runs the gRPC gateway on an asyncio loop in a
background thread, so a synchronous program (the demo, a benchmark, a test) can use it;
``kvstore up`` runs the same thing in the foreground.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import ray

from kvstore.api.cluster_backend import ClusterBackend
from kvstore.api.metrics import ApiMetrics
from kvstore.api.server import ServerOptions, create_server
from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.errors import ConfigError
from kvstore.gc.config import DEFAULT_PATH as GC_DEFAULT_PATH
from kvstore.gc.config import GCConfig
from kvstore.geometry import GeometryConfig
from kvstore.runtime.cluster import LocalCluster, alive_node_ids, connect
from kvstore.runtime.deploy import BlockStoreHandles, deploy_blockstore
from kvstore.runtime.gc_actors import deploy_gc
from kvstore.runtime.swa_actors import SWADeployment, deploy_swa
from kvstore.swa.config import SWAConfig

log = logging.getLogger(__name__)


def default_gc_config() -> GCConfig:
    """``gc/gc.toml`` of the source tree when present, else the built-in defaults."""
    if Path(GC_DEFAULT_PATH).is_file():
        return GCConfig.from_file(GC_DEFAULT_PATH)
    return GCConfig.from_dict({})


@dataclass(frozen=True)
class ServiceConfig:
    data_root: Path
    deployment: str = "kvstore"
    storage_nodes: int = 12
    meta_shards: int = 4
    fsync: Literal["always", "batch", "never"] = "batch"
    node_capacity_bytes: int | None = None
    geometry: GeometryConfig = field(default_factory=GeometryConfig.default)
    swa: SWAConfig = field(default_factory=SWAConfig)
    gc: GCConfig | None = None  # None: default_gc_config()
    run_gc: bool = True
    start_repair: bool = True

    def __post_init__(self) -> None:
        if self.storage_nodes < 12:
            raise ConfigError(
                "storage_nodes", f"a 10+2 stripe needs at least 12, got {self.storage_nodes}"
            )
        if self.meta_shards < 1:
            raise ConfigError("meta_shards", f"must be ≥ 1, got {self.meta_shards}")

    def blockstore_config(self) -> BlockStoreConfig:
        node = StorageNodeConfig(fsync=self.fsync)
        if self.node_capacity_bytes is not None:
            node = StorageNodeConfig(fsync=self.fsync, capacity_bytes=self.node_capacity_bytes)
        return BlockStoreConfig(
            data_root=str(self.data_root),
            deployment=self.deployment,
            storage_nodes=self.storage_nodes,
            meta_shards=self.meta_shards,
            node=node,
        )


class Service:
    """A deployed kvstore: the tiers' handles and the gateway backend over them."""

    def __init__(
        self,
        config: ServiceConfig,
        blocks: BlockStoreHandles,
        swa: SWADeployment,
        gc: Any | None,
        backend: ClusterBackend,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.swa = swa
        self.gc = gc
        self.backend = backend

    @classmethod
    def start(
        cls,
        config: ServiceConfig,
        *,
        address: str | None = None,
        cluster: LocalCluster | None = None,
    ) -> Service:
        if cluster is None:
            connect(address)
        blockstore_config = config.blockstore_config()
        blocks = deploy_blockstore(blockstore_config, cluster, start_repair=config.start_repair)
        if cluster is not None:
            machines = {machine: cluster.node_id(machine) for machine in cluster.machines}
        else:
            machines = {f"node-{node[:8]}": node for node in alive_node_ids()}
        swa = deploy_swa(machines, config=config.swa, geometry=config.geometry)
        gc = None
        if config.run_gc:
            gc = deploy_gc(config.gc or default_gc_config(), blockstore_config)
        local_machine = next(iter(machines)) if len(machines) == 1 else None
        backend = ClusterBackend(
            blocks=blocks.client(),
            swa=swa.client(local_machine=local_machine),
            geometry=config.geometry,
            meta_handles=blocks.metas,
            repair_handle=blocks.repair,
            storage_nodes=config.storage_nodes,
            traffic_classes=blockstore_config.traffic_classes,
        )
        return cls(config, blocks, swa, gc, backend)

    def stop(self) -> None:
        """Kill the deployment's actors (data directories stay for a restart)."""
        for step in (
            lambda: ray.kill(self.gc) if self.gc is not None else None,
            self.swa.shutdown,
            self.blocks.shutdown,
        ):
            try:
                step()
            except Exception:  # stopping must go on through every part
                log.warning("shutdown step failed", exc_info=True)


class Gateway:
    """The gRPC server of a ``Service`` on its own asyncio loop in a background thread."""

    def __init__(
        self, service: Service, options: ServerOptions, metrics_port: int | None = None
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-gateway")
        self._thread.daemon = True
        self._thread.start()
        self.metrics = ApiMetrics(service.backend.stats)
        server, port, executor = asyncio.run_coroutine_threadsafe(
            create_server(service.backend, options, self.metrics), self._loop
        ).result(timeout=60)
        self._server = server
        self._executor = executor
        self.port = port
        self.address = f"{options.host}:{port}"
        self.metrics_port = (
            self.metrics.serve(metrics_port, options.host) if metrics_port is not None else None
        )
        # What exists now (modules, Ray, the deployment's handles) lives as long as the process:
        # take it out of the cyclic GC's scans so collections while serving stay short.
        gc.freeze()

    def stop(self, grace_s: float = 2.0) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop).result(
            timeout=grace_s + 10
        )
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


@dataclass
class RunningService:
    service: Service
    gateway: Gateway

    @property
    def address(self) -> str:
        return self.gateway.address

    @property
    def backend(self) -> ClusterBackend:
        return self.service.backend


@contextmanager
def embedded_service(
    data_root: Path,
    *,
    cluster: LocalCluster | None = None,
    options: ServerOptions | None = None,
    metrics_port: int | None = None,
    **config: Any,
) -> Iterator[RunningService]:
    """Start kvstore (embedded Ray unless ``cluster``) and its gateway; stop both on exit."""
    service = Service.start(ServiceConfig(data_root=Path(data_root), **config), cluster=cluster)
    try:
        gateway = Gateway(service, options or ServerOptions(), metrics_port)
        try:
            yield RunningService(service, gateway)
        finally:
            gateway.stop()
    finally:
        service.stop()
