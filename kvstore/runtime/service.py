"""Stand the whole of kvstore up on a Ray cluster and serve it over gRPC.

``Service.start(config)`` connects to Ray (the embedded local cluster by default, an existing one
with ``address``, or a ``LocalCluster``), deploys the block tier (storage nodes, meta shards,
repair), the SWA tier (a store per machine, the entrypoint directory) and the GC worker, and
builds the tier facade the gateway serves (``kvstore.tier.cluster.ClusterTier``). ``Gateway``
runs the gRPC server on an asyncio loop in a background thread, so a synchronous program (the
demo, a benchmark, a test) can use it; ``kvstore up`` runs the same thing in the foreground.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from kvstore.api.gateway import Gateway
from kvstore.api.server import ServerOptions
from kvstore.config import ServiceConfig
from kvstore.runtime.cluster import (
    LocalCluster,
    alive_node_ids,
    connect,
    control_node_ids,
    node_addresses,
)
from kvstore.runtime.deploy import BlockStoreHandles, deploy_blockstore
from kvstore.runtime.gc_actors import deploy_gc
from kvstore.runtime.swa_actors import SWADeployment, deploy_swa
from kvstore.runtime.tiers import cluster_tier
from kvstore.tier.cluster import ClusterTier

log = logging.getLogger(__name__)


class Service:
    """A deployed kvstore: the tiers' handles and the tier facade over them."""

    def __init__(
        self,
        config: ServiceConfig,
        blocks: BlockStoreHandles,
        swa: SWADeployment,
        gc: Any | None,
        tier: ClusterTier,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.swa = swa
        self.gc = gc
        self.tier = tier

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
        blockstore_config = config.blockstore
        blocks = deploy_blockstore(blockstore_config, cluster, start_repair=config.start_repair)
        if cluster is not None:
            machines = {machine: cluster.node_id(machine) for machine in cluster.machines}
        else:
            machines = {f"node-{node[:8]}": node for node in alive_node_ids()}
        swa = deploy_swa(
            machines,
            config=config.swa,
            geometry=config.geometry,
            entrypoint_nodes=control_node_ids() or None,  # a control host's, where there is one
        )
        gc = None
        if config.run_gc:
            gc = deploy_gc(config.gc, blockstore_config)
        local_machine = next(iter(machines)) if len(machines) == 1 else None
        tier = cluster_tier(
            blocks,
            swa,
            config.geometry,
            local_machine=local_machine,
            block_bytes=config.block_bytes,
            machine_addresses=_machines_by_address(machines),
            grants_reads=True,  # the gateway's tier: engines read their leases directly
        )
        return cls(config, blocks, swa, gc, tier)

    def stop(self) -> None:
        """Kill the deployment's actors (data directories stay for a restart)."""
        for step in (
            self.tier.close,
            lambda: ray.kill(self.gc) if self.gc is not None else None,
            self.swa.shutdown,
            self.blocks.shutdown,
        ):
            try:
                step()
            except Exception:  # stopping must go on through every part
                log.warning("shutdown step failed", exc_info=True)


@dataclass
class RunningService:
    service: Service
    gateway: Gateway

    @property
    def address(self) -> str:
        return self.gateway.address

    @property
    def tier(self) -> ClusterTier:
        return self.service.tier


@contextmanager
def embedded_service(
    data_root: Path,
    *,
    cluster: LocalCluster | None = None,
    options: ServerOptions | None = None,
    metrics_port: int | None = None,
    **config: Any,
) -> Iterator[RunningService]:
    """Start kvstore (embedded Ray unless ``cluster``) and its gateway; stop both on exit.
    ``config``: what ``ServiceConfig.from_env`` takes (block tier fields by name, ...)."""
    config["data_root"] = data_root
    service = Service.start(ServiceConfig.from_env(**config), cluster=cluster)
    try:
        gateway = Gateway(service.tier, options or ServerOptions(), metrics_port)
        try:
            yield RunningService(service, gateway)
        finally:
            gateway.stop()
    finally:
        service.stop()


def _machines_by_address(machines: dict[str, str]) -> dict[str, str]:
    """IP address → machine id, for the addresses that name one machine only (machines of a
    local cluster all share 127.0.0.1: none of them is named by it)."""
    address_of = node_addresses()
    found: dict[str, list[str]] = {}
    for machine, node_id in machines.items():
        address = address_of.get(node_id)
        if address:
            found.setdefault(address, []).append(machine)
    return {address: names[0] for address, names in found.items() if len(names) == 1}
