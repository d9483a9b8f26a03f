"""Stand the Block KVCache tier up on a Ray cluster and hand out clients.

Placement of storage nodes (each actor its own data dir):
- on a ``LocalCluster`` (or a testbed's ``HostCluster``): node i on machine ``i mod machines``
  (custom resource pin);
- on a cluster of hosts (Ray nodes with distinct addresses; only those carrying the resource
  ``kvstore_storage`` when any does): node i on host ``i mod hosts``, pinned to the host's
  address (Ray's ``node:<ip>`` resource), so a host whose Ray restarts gets its storage nodes
  back on their data dirs;
- otherwise (one machine, or simulated machines sharing an address): N actors spread over the
  Ray nodes there are, hard node affinity.
Where machines or hosts are fewer than the nodes, the nodes of one machine share a failure
domain (``BlockStoreConfig.failure_domains``): a stripe puts at most ceil(12 / hosts) shards on
one. Meta shards and the repair loop go on a host carrying ``kvstore_control`` when one does
(a testbed's head), else anywhere (``num_cpus=0``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayError

from kvstore.blockstore.calls import meta_target, node_target
from kvstore.blockstore.capability import READ_KEY_BYTES
from kvstore.blockstore.client import BlockStoreClient
from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.dirlock import open_lock, wait_unlocked
from kvstore.blockstore.fanout import Target
from kvstore.errors import StoreError
from kvstore.runtime.blockstore_actors import (
    FAST_METHODS,
    MetaShardActor,
    RepairActor,
    StorageNodeActor,
    actor_options,
    find_actor,
    meta_actor_name,
    name_resolver,
    node_actor_name,
    repair_actor_name,
    wait_names_released,
)
from kvstore.runtime.cluster import (
    Machines,
    alive_node_ids,
    control_plane_options,
    pin_to_host,
    pin_to_machine,
    pin_to_node,
    storage_hosts,
)
from kvstore.runtime.fanout import RayFanout

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0
_KILL_TIMEOUT_S = 30.0


def node_data_dir(config: BlockStoreConfig, node_id: int) -> str:
    return os.path.join(config.data_root, f"node-{node_id}")


@dataclass
class BlockStoreHandles:
    """Actor handles of one deployment (also rebuildable by name from any driver)."""

    config: BlockStoreConfig
    nodes: dict[int, Any]
    metas: list[Any]
    repair: Any | None = None
    node_options: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: The cluster read key (made at deploy, held by the nodes): only for minting read
    #: capabilities in-cluster; never sent to an engine or a client. None until ``read_key``
    #: asks a node for it (handles found by name: an engine's fetcher never asks).
    cluster_read_key: bytes | None = field(default=None, repr=False)

    def fanout(self) -> RayFanout:
        """The fanout a client of this deployment calls through: the data and hit paths over
        the actors' direct sockets, their endpoints fetched before it is handed out (so no
        first call goes through Ray; within ``call_timeout_s``: a node that is down then is
        asked again later)."""
        handles: dict[Target[Any], Any] = {node_target(i): h for i, h in self.nodes.items()}
        handles.update({meta_target(i): h for i, h in enumerate(self.metas)})
        fanout = RayFanout(
            handles, resolve=name_resolver(self.config.deployment), fast_methods=FAST_METHODS
        )
        missing = fanout.prepare(handles, self.config.call_timeout_s)
        if missing:
            log.info("no direct socket yet to %s: through Ray until then", sorted(missing))
        return fanout

    def client(self) -> BlockStoreClient:
        """A client of this deployment."""
        return BlockStoreClient(self.config, self.fanout(), node_ids=sorted(self.nodes))

    @classmethod
    def from_names(cls, config: BlockStoreConfig) -> BlockStoreHandles:
        """Find a running deployment's actors by name (e.g. from the gateway process)."""
        nodes = {
            i: find_actor(node_actor_name(config.deployment, i))
            for i in range(config.storage_nodes)
        }
        metas = [
            find_actor(meta_actor_name(config.deployment, i)) for i in range(config.meta_shards)
        ]
        missing = [f"node {i}" for i, h in nodes.items() if h is None]
        missing += [f"meta {i}" for i, h in enumerate(metas) if h is None]
        if missing:
            raise StoreError(f"block store {config.deployment!r} not found: {missing}")
        return cls(config, nodes, metas, find_actor(repair_actor_name(config.deployment)))

    def read_key(self, timeout: float = _START_TIMEOUT_S) -> bytes:
        """The cluster read key capabilities are minted under (``capability.mint``): the one
        this process deployed with, or asked of a node through Ray. For the tier only."""
        if self.cluster_read_key is None:
            errors = []
            for node_id, handle in sorted(self.nodes.items()):
                try:
                    self.cluster_read_key = bytes(
                        ray.get(handle.read_key.remote(), timeout=timeout)
                    )
                    break
                except RayError as error:
                    errors.append(f"node {node_id}: {error}")
            else:
                raise StoreError(f"no storage node handed out the read key: {errors}")
        return self.cluster_read_key

    def read_endpoints(self, timeout: float = _START_TIMEOUT_S) -> dict[int, tuple[str, int]]:
        """Each answering node's engine read socket (host, port): what an engine dials."""
        refs = {node_id: h.read_endpoint.remote() for node_id, h in self.nodes.items()}
        out: dict[int, tuple[str, int]] = {}
        for node_id, ref in refs.items():
            try:
                host, port = ray.get(ref, timeout=timeout)
            except RayError as error:
                log.info("node %d: no engine read endpoint: %s", node_id, error)
                continue
            out[node_id] = (str(host), int(port))
        return out

    def revoke(self, lease_ids: Sequence[str], until: float, timeout: float = 10.0) -> int:
        """Revoke the read capabilities of ``lease_ids`` on every node (released leases);
        returns how many nodes acknowledged."""
        refs = [h.revoke.remote(list(lease_ids), until) for h in self.nodes.values()]
        done = 0
        for ref in refs:
            try:
                ray.get(ref, timeout=timeout)
                done += 1
            except RayError as error:
                log.warning("a node did not take a revocation: %s", error)
        return done

    def wait_ready(self, timeout: float = _START_TIMEOUT_S) -> None:
        """Until every node answers and every meta shard finished its rebuild."""
        deadline = time.monotonic() + timeout
        ray.get([h.ping.remote() for h in self.nodes.values()], timeout=timeout)
        while True:
            left = deadline - time.monotonic()
            ready = ray.get([m.ready.remote() for m in self.metas], timeout=max(1.0, left))
            if all(ready):
                return
            if left <= 0:
                raise StoreError("meta shards did not finish rebuilding in time")
            time.sleep(0.05)

    def kill_node(self, node_id: int, restart: bool) -> None:
        """Crash a storage node: ``restart=True`` lets Ray start it again on its data dir."""
        self.kill_nodes([node_id], restart)

    def kill_nodes(self, node_ids: Sequence[int], restart: bool) -> None:
        """Crash storage nodes all at once (every ``ray.kill`` sent before waiting for any), so
        the repair loop never sees some dead while the others still serve their shards.

        Where a data dir is visible from here, returns only once its process is gone (its
        ``LOCK`` released, ``dirlock.py``): ``ray.kill`` is asynchronous, and until then the old
        process may still answer calls and write its log, and a restarted node waits for it."""
        locks = {node_id: open_lock(node_data_dir(self.config, node_id)) for node_id in node_ids}
        for node_id in node_ids:
            ray.kill(self.nodes[node_id], no_restart=not restart)
        for node_id, lock in locks.items():
            if lock is not None and not wait_unlocked(lock, _KILL_TIMEOUT_S):
                log.warning("storage node %d still holds its data dir after ray.kill", node_id)

    def kill_meta(self, shard_id: int, restart: bool = True) -> None:
        ray.kill(self.metas[shard_id], no_restart=not restart)

    def start_node(self, node_id: int) -> Any:
        """(Re)create storage node ``node_id`` on its data dir (after a permanent kill)."""
        deadline = time.monotonic() + 30
        while True:
            try:
                handle = _start_node(
                    self.config, node_id, self.node_options.get(node_id, {}), self.read_key()
                )
                break
            except ValueError:  # the dead actor's name is released asynchronously
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.nodes[node_id] = handle
        ray.get(handle.ping.remote(), timeout=_START_TIMEOUT_S)
        return handle

    def shutdown(self) -> None:
        """Kill every actor of the deployment (data dirs stay)."""
        for handle in [*self.nodes.values(), *self.metas, self.repair]:
            if handle is None:
                continue
            try:
                ray.kill(handle, no_restart=True)
            except (RayError, ValueError):
                pass
        names = [node_actor_name(self.config.deployment, i) for i in self.nodes]
        names += [meta_actor_name(self.config.deployment, i) for i in range(len(self.metas))]
        names.append(repair_actor_name(self.config.deployment))
        wait_names_released(names, "block store")


def _start_node(
    config: BlockStoreConfig, node_id: int, placement: dict[str, Any], read_key: bytes
) -> Any:
    options = actor_options(node_actor_name(config.deployment, node_id), **placement)
    return StorageNodeActor.options(**options).remote(  # type: ignore[attr-defined]
        node_id,
        node_data_dir(config, node_id),
        config.node,
        config.deployment,
        config.meta_shards,
        config.call_timeout_s,
        read_key,
    )


def _node_placements(
    config: BlockStoreConfig, cluster: Machines | None
) -> tuple[dict[int, dict[str, Any]], tuple[str, ...]]:
    """Actor options of each storage node, and the failure domain of each (empty: every node
    a domain of its own)."""
    count = config.storage_nodes
    if cluster is not None:
        machines = cluster.machines
        if not machines:
            raise StoreError("the local cluster has no machines to place storage nodes on")
        where = [machines[i % len(machines)] for i in range(count)]
        domains = tuple(where) if len(machines) < count else ()
        return {i: pin_to_machine(where[i]) for i in range(count)}, domains
    hosts = storage_hosts()
    if len(hosts) > 1:
        where = [hosts[i % len(hosts)] for i in range(count)]
        domains = tuple(where) if len(hosts) < count else ()
        if len(hosts) * 2 < config.stripe_width:  # a host would hold more than m shards
            log.warning(
                "%d storage hosts: a stripe puts up to %d shards on one, so losing a host can "
                "lose blocks (10+2 needs >= 6 hosts for that)",
                len(hosts),
                -(-config.stripe_width // len(hosts)),
            )
        return {i: pin_to_host(where[i]) for i in range(count)}, domains
    ray_nodes = alive_node_ids()
    if not ray_nodes:
        return {i: {} for i in range(count)}, ()
    return {i: pin_to_node(ray_nodes[i % len(ray_nodes)]) for i in range(count)}, ()


def deploy_blockstore(
    config: BlockStoreConfig,
    cluster: Machines | None = None,
    *,
    start_repair: bool = True,
    wait: bool = True,
) -> BlockStoreHandles:
    """Create the storage nodes, meta shards and repair loop of ``config`` (Ray connected).

    Data dirs under ``config.data_root`` are reused as found: deploying on the dirs of a
    previous deployment restores every committed block (meta shards rebuild from manifests).
    """
    if not ray.is_initialized():
        raise StoreError("Ray is not connected: call kvstore.runtime.cluster.connect() first")
    placements, domains = _node_placements(config, cluster)
    config = config.with_overrides(failure_domains=domains)
    # The cluster read key: made here, handed to the nodes as an actor argument (Ray keeps it
    # in-cluster and gives it back to a restarted node), never written to disk or config.
    read_key = os.urandom(READ_KEY_BYTES)
    nodes = {
        i: _start_node(config, i, placements[i], read_key) for i in range(config.storage_nodes)
    }
    node_ids = sorted(nodes)
    if wait:  # nodes first, so the meta shards' rebuild finds them answering
        ray.get([h.ping.remote() for h in nodes.values()], timeout=_START_TIMEOUT_S)
    control = control_plane_options()
    metas = [
        MetaShardActor.options(  # type: ignore[attr-defined]
            **actor_options(meta_actor_name(config.deployment, i), **control)
        ).remote(i, config, node_ids)
        for i in range(config.meta_shards)
    ]
    repair = None
    if start_repair:
        repair = RepairActor.options(  # type: ignore[attr-defined]
            **actor_options(repair_actor_name(config.deployment), **control)
        ).remote(config, node_ids)
    handles = BlockStoreHandles(config, nodes, metas, repair, placements, read_key)
    if wait:
        handles.wait_ready()
    return handles


def make_client(handles: BlockStoreHandles) -> BlockStoreClient:
    return handles.client()


def connect_client(config: BlockStoreConfig) -> BlockStoreClient:
    """A client of an already deployed tier, found by actor names."""
    return BlockStoreHandles.from_names(config).client()
