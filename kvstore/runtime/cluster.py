"""Ray bootstrap: join or embed a cluster, and a local multi-"machine" cluster for tests and demos.

Everything here keeps Ray on loopback. Ray 2.60 on Linux otherwise listens on every interface
and talks over the external address even with a 127.0.0.1 node address; what keeps it on
127.0.0.1 is ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment of every Ray process plus
node ip 127.0.0.1 (see MEASURED.md). We set those variables before any Ray process starts.

A *machine* of ``LocalCluster`` is one Ray worker node (its own raylet and object store) standing
for one failure domain. Each carries a custom resource named after its stable machine id, so an
actor can be pinned to it (``pin_to_machine``) and a machine restarted under the same id gets its
actors back. The head node has no CPUs: work only lands on the machines.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.cluster_utils import Cluster

from kvstore.errors import ConfigError, InvalidArgument

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
#: Capacity of each machine's own resource; an actor pinned there asks for 1 unit of it.
_MACHINE_RESOURCE_UNITS = 10_000
_MIB = 1024 * 1024

#: Environment every Ray process of ours must see (inherited by raylets and workers).
RAY_LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    # No usage-stats prompt or upload attempt from tests and demos (there is no network).
    "RAY_USAGE_STATS_ENABLED": "0",
}


def _apply_loopback_env() -> None:
    # Written (not read) here: child processes inherit it. Only variables Ray itself reads.
    for name, value in RAY_LOOPBACK_ENV.items():
        os.environ[name] = value
    # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when `ray` is first imported; this
    # process imported it before we could set the variable, so apply the same switch to the
    # already-loaded constant (its only reader looks it up at call time).
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def machine_resource(machine_id: str) -> str:
    """Name of the custom resource that machine ``machine_id`` carries."""
    return f"kvstore_machine_{machine_id}"


def pin_to_machine(machine_id: str) -> dict[str, Any]:
    """Actor options placing an actor on machine ``machine_id`` of a ``LocalCluster``.

    ``num_cpus=0``: a pinned actor that also held a CPU could wait forever in
    PENDING_CREATION once the machine's CPUs are taken (MEASURED.md).
    """
    if not machine_id or not isinstance(machine_id, str):
        raise InvalidArgument("machine_id", f"must be a non-empty string, got {machine_id!r}")
    return {"num_cpus": 0, "resources": {machine_resource(machine_id): 1}}


def pin_to_node(node_id_hex: str) -> dict[str, Any]:
    """Actor options placing an actor on the Ray node ``node_id_hex`` (hard node affinity).

    Used on real multi-machine clusters, where each Ray node is one machine.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not node_id_hex or not isinstance(node_id_hex, str):
        raise InvalidArgument("node_id_hex", f"must be a non-empty string, got {node_id_hex!r}")
    return {
        "num_cpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id_hex, soft=False),
    }


def cluster_cpus(default: int = 2) -> int:
    """CPUs of the connected Ray cluster, all nodes together (``default`` if it reports none)."""
    return int(ray.cluster_resources().get("CPU", default))


def alive_node_ids() -> list[str]:
    """Hex ids of the Ray nodes the GCS currently considers alive (needs a connected driver)."""
    return sorted(node["NodeID"] for node in ray.nodes() if node.get("Alive"))


@dataclass(frozen=True)
class LocalClusterConfig:
    """How a ``LocalCluster`` is shaped. Health-check numbers decide how fast a machine that
    vanished without notice is declared dead (Ray's default is ~15 s)."""

    machine_cpus: int = 2
    head_object_store_mib: int = 512
    machine_object_store_mib: int = 256
    health_check_period_ms: int = 500
    health_check_timeout_ms: int = 1000
    health_check_failure_threshold: int = 4
    #: Objects up to this size travel inline in the gRPC reply instead of through the object
    #: store (MEASURED.md: raising it to 4 MiB made 128 KiB round trips 2.3-2.9x faster).
    max_direct_call_object_size: int = 4 * _MIB
    extra_system_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in (
            "machine_cpus",
            "head_object_store_mib",
            "machine_object_store_mib",
            "health_check_period_ms",
            "health_check_timeout_ms",
            "health_check_failure_threshold",
            "max_direct_call_object_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.head_object_store_mib < 80 or self.machine_object_store_mib < 80:
            raise ConfigError("object_store_mib", "Ray needs at least 80 MiB per object store")

    def system_config(self) -> dict[str, Any]:
        return {
            "health_check_period_ms": self.health_check_period_ms,
            "health_check_timeout_ms": self.health_check_timeout_ms,
            "health_check_failure_threshold": self.health_check_failure_threshold,
            "health_check_initial_delay_ms": 0,
            "max_direct_call_object_size": self.max_direct_call_object_size,
            **self.extra_system_config,
        }


def connect(
    address: str | None = None,
    *,
    namespace: str = "kvstore",
    config: LocalClusterConfig | None = None,
) -> None:
    """Connect this process to Ray: embedded local instance (``None``) or an existing cluster.

    The embedded instance is one Ray node on loopback with ``config``'s system settings (short
    health checks, 4 MiB inline objects) and object store size. Idempotent: a process already
    connected stays connected (to whatever it joined first).
    """
    if ray.is_initialized():
        return
    _apply_loopback_env()
    if address is None:
        config = config or LocalClusterConfig()
        ray.init(
            # "local": always start our own instance. Without it ray.init joins whatever
            # cluster this machine last started (RAY_ADDRESS / /tmp/ray), someone else's.
            address="local",
            include_dashboard=False,
            _node_ip_address=LOOPBACK,
            namespace=namespace,
            log_to_driver=False,
            configure_logging=False,
            object_store_memory=config.head_object_store_mib * _MIB,
            _system_config=config.system_config(),
        )
    else:
        ray.init(address=address, namespace=namespace, log_to_driver=False)


class LocalCluster:
    """A head (no CPUs) plus N worker nodes on this host, each standing for one machine."""

    def __init__(self, cluster: Cluster, config: LocalClusterConfig) -> None:
        self._cluster = cluster
        self._config = config
        self._nodes: dict[str, Any] = {}  # machine id -> ray._private.node.Node
        self._next_index = 0

    @classmethod
    def start(cls, num_machines: int = 3, config: LocalClusterConfig | None = None) -> LocalCluster:
        """Start the head and ``num_machines`` machines and connect this process as driver."""
        if not isinstance(num_machines, int) or num_machines < 0:
            raise InvalidArgument("num_machines", f"must be an integer >= 0, got {num_machines}")
        if ray.is_initialized():
            raise InvalidArgument(
                "ray", "this process is already connected to Ray; one cluster per process"
            )
        config = config or LocalClusterConfig()
        _apply_loopback_env()
        cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={
                "num_cpus": 0,
                "node_ip_address": LOOPBACK,
                "include_dashboard": False,
                "object_store_memory": config.head_object_store_mib * _MIB,
                "_system_config": config.system_config(),
            },
        )
        local = cls(cluster, config)
        try:
            ray.init(
                address=cluster.address,
                namespace="kvstore",
                log_to_driver=False,
                configure_logging=False,
                _node_ip_address=LOOPBACK,
            )
            cluster.connected = True
            for _ in range(num_machines):
                local.add_machine()
        except BaseException:
            local.shutdown()
            raise
        return local

    @property
    def address(self) -> str:
        return str(self._cluster.address)

    @property
    def config(self) -> LocalClusterConfig:
        return self._config

    @property
    def machines(self) -> list[str]:
        """Ids of the machines currently up, in the order they were added."""
        return list(self._nodes)

    def node_id(self, machine_id: str) -> str:
        """Ray node id (hex) of machine ``machine_id``."""
        return str(self._node(machine_id).node_id)

    def add_machine(self, machine_id: str | None = None) -> str:
        """Start one more machine; ``machine_id`` re-uses an id (a machine coming back)."""
        if machine_id is None:
            machine_id = f"m{self._next_index}"
            self._next_index += 1
        elif machine_id in self._nodes:
            raise InvalidArgument("machine_id", f"machine {machine_id!r} is already up")
        node = self._cluster.add_node(
            num_cpus=self._config.machine_cpus,
            node_ip_address=LOOPBACK,
            object_store_memory=self._config.machine_object_store_mib * _MIB,
            resources={machine_resource(machine_id): _MACHINE_RESOURCE_UNITS},
            wait=True,
        )
        self._nodes[machine_id] = node
        return machine_id

    def remove_machine(self, machine_id: str, graceful: bool = True) -> None:
        """Stop machine ``machine_id``. ``graceful=False`` kills its processes outright: callers
        see ``ActorUnavailableError`` until Ray's health checks declare the node dead."""
        node = self._node(machine_id)
        self._cluster.remove_node(node, allow_graceful=graceful)
        del self._nodes[machine_id]

    def shutdown(self) -> None:
        """Disconnect and stop every process of the cluster. Safe to call twice."""
        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            self._cluster.connected = False
            self._cluster.shutdown()
            self._nodes.clear()

    def _node(self, machine_id: str) -> Any:
        try:
            return self._nodes[machine_id]
        except KeyError:
            raise InvalidArgument(
                "machine_id", f"no machine {machine_id!r} is up (up: {sorted(self._nodes)})"
            ) from None

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
