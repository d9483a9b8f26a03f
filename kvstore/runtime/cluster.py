"""Ray bootstrap: join or embed a cluster, and a local multi-"machine" cluster for tests and demos.

Everything here keeps Ray on loopback. Ray 2.60 on Linux otherwise listens on every interface
and talks over the external address even with a 127.0.0.1 node address; what keeps it on
127.0.0.1 is ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment of every Ray process plus
node ip 127.0.0.1 (checked with ``ss -tnp``). We set those variables before any Ray process starts.

Ray's token authentication is on for every cluster kvstore starts and required of every cluster it
joins: without it anyone who reaches the GCS port runs code as the service user and reads the keys
kvstore hands out through Ray (the fastcall socket keys). Ray 2.60 reads the mode from
``RAY_AUTH_MODE`` and the token from ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``,
else ``~/.ray/auth_token``, in every process (GCS, raylets, workers, drivers), so what we decide
goes into this process's environment before any Ray process starts and every child inherits it:

- a cluster we start (``connect(None)``, ``LocalCluster``) uses the token the environment names,
  else kvstore's own file ``~/.kvstore/ray_auth_token`` (0600 in a 0700 directory, made on first
  use; ``RAY_AUTH_TOKEN_PATH`` is pointed at it), with token mode switched on the way
  ``ray.init()`` does it for a new local cluster;
- joining (``connect(address)``) takes the token from Ray's own sources, else kvstore's file, and
  asks the GCS first: a cluster that answers without a token, or refuses ours, is a one-line
  ``ConfigError`` instead of ``ray.init``'s 20 s of retries.

An environment that sets ``RAY_AUTH_MODE`` to anything but ``token`` is refused, not obeyed.

A *machine* of ``LocalCluster`` is one Ray worker node (its own raylet and object store) standing
for one failure domain. Each carries a custom resource named after its stable machine id, so an
actor can be pinned to it (``pin_to_machine``) and a machine restarted under the same id gets its
actors back. The head node has no CPUs: work only lands on the machines.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import ray
from ray.cluster_utils import Cluster

from kvstore.errors import ConfigError, InvalidArgument
from kvstore.privatefs import check_private_file, create_private_file

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
#: Capacity of each machine's own resource; an actor pinned there asks for 1 unit of it.
_MACHINE_RESOURCE_UNITS = 10_000
_MIB = 1024 * 1024

#: Environment every Ray process of ours must see (inherited by raylets and workers).
RAY_LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # No usage-stats prompt or upload attempt from tests and demos (there is no network).
    "RAY_USAGE_STATS_ENABLED": "0",
}

#: Where Ray takes the cluster token from, first set wins: the token itself, then a file.
RAY_TOKEN_ENV = "RAY_AUTH_TOKEN"
RAY_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
#: How long the GCS may take to answer the auth probe before ``ray.init`` is left to judge.
_PROBE_TIMEOUT_S = 5.0


def _apply_loopback_env() -> None:
    # Written (not read) here: child processes inherit it. Only variables Ray itself reads.
    for name, value in RAY_LOOPBACK_ENV.items():
        os.environ[name] = value
    # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when `ray` is first imported; this
    # process imported it before we could set the variable, so apply the same switch to the
    # already-loaded constant (its only reader looks it up at call time).
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def kvstore_token_path() -> Path:
    """kvstore's own Ray token file, for the clusters it starts when the environment names none."""
    return Path.home() / ".kvstore" / "ray_auth_token"


def _ensure_token_file(path: Path) -> Path:
    """``path`` holding a token only this user can read; made (random, 256 bits) if missing."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        create_private_file(path, secrets.token_hex(32).encode(), str(path))
    check_private_file(path, str(path))
    if path.stat().st_size == 0:
        # Ray aborts the process on an empty RAY_AUTH_TOKEN_PATH; say which file instead.
        raise ConfigError(str(path), "the Ray token file is empty (delete it to get a new one)")
    return path


def _raylet() -> Any:
    """``ray._raylet``, whose type stub declares none of its auth API (the token loader, Config)."""
    from ray import _raylet

    return _raylet


def _point_ray_at(path: Path) -> None:
    os.environ[RAY_TOKEN_PATH_ENV] = str(path)
    # The loader keeps the first token it found; this process may have asked before.
    _raylet().AuthenticationTokenLoader.instance().reset_cache()


def _token_for_own_cluster() -> Path | None:
    """Make sure a cluster we start has a token; the file it is in (None: ``RAY_AUTH_TOKEN``)."""
    if os.environ.get(RAY_TOKEN_ENV):
        return None
    named = os.environ.get(RAY_TOKEN_PATH_ENV)
    if named:
        return Path(named)
    path = _ensure_token_file(kvstore_token_path())
    _point_ray_at(path)
    return path


def _require_token_auth() -> None:
    """Token mode on for this process and every Ray process it starts (refused if turned off)."""
    from ray._private.authentication import authentication_token_setup as ray_auth
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    # The switch ray.init() itself throws for a new local cluster: token mode unless the
    # environment chose. Its log line tells the user how to opt out, which kvstore refuses.
    quiet = logging.getLogger(ray_auth.__name__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        enabled = ray_auth.enable_token_auth_by_default()
    finally:
        quiet.setLevel(level)
    if not enabled:
        name = ray_auth.AUTH_MODE_ENV_VAR
        raise ConfigError(
            name,
            f"is {os.environ.get(name)!r}: kvstore starts and joins Ray only with token "
            "authentication (unset it, or set it to token)",
        )
    if not is_token_auth_enabled():
        # The variable was set after Ray read its config (it reads it once): read it again.
        _raylet().Config.initialize("")


def _token_source() -> str | None:
    """Where Ray will take this process's token from, in Ray's order (None: nowhere).

    Decided here, not by asking Ray's loader: it raises the same error for "no token anywhere"
    as for "the named file cannot be read", and only the first has a fallback."""
    if os.environ.get(RAY_TOKEN_ENV):
        return RAY_TOKEN_ENV
    named = os.environ.get(RAY_TOKEN_PATH_ENV)
    if named:
        try:
            readable = bool(Path(named).read_text().strip())
        except OSError:
            readable = False
        if not readable:
            raise ConfigError(RAY_TOKEN_PATH_ENV, f"{named} cannot be read or is empty")
        return f"{RAY_TOKEN_PATH_ENV}={named}"
    default = Path.home() / ".ray" / "auth_token"
    return "~/.ray/auth_token" if default.is_file() else None


def _gcs_channel(gcs: str) -> Any:
    import grpc

    # The channel Ray's own clients open (ray._private.grpc_utils.init_grpc_channel: TLS when
    # RAY_USE_TLS says so) minus its token interceptor: one probe must go without the token.
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        from ray._common.tls_utils import load_certs_from_env

        chain, key, ca = load_certs_from_env()
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=chain
        )
        return grpc.secure_channel(gcs, credentials)
    return grpc.insecure_channel(gcs)


def _gcs_accepts(gcs: str, metadata: tuple[tuple[str, str], ...]) -> bool | None:
    """Whether the GCS at ``gcs`` answers a call carrying ``metadata``: True, False (refused as
    unauthenticated) or None (no verdict: unreachable or slow; ``ray.init`` reports that)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with _gcs_channel(gcs) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]
            stub.GetClusterId(request, metadata=metadata, timeout=_PROBE_TIMEOUT_S)
        except grpc.RpcError as error:
            return False if error.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return True


def _check_cluster_auth(address: str) -> None:
    """Before joining ``address``: a token to join with, and a GCS that wants it and takes it.
    (``ray.init`` would retry a refused token for 20 s, logging a line a second.)"""
    from ray._private.services import canonicalize_bootstrap_address

    source = _token_source()
    if source is None:
        own = kvstore_token_path()
        if not own.exists():
            raise ConfigError(
                "ray token",
                f"none to join {address} with: set {RAY_TOKEN_PATH_ENV} to a file holding the "
                f"cluster's token (`ray get-auth-token` on its head prints it), or {RAY_TOKEN_ENV}",
            )
        _point_ray_at(_ensure_token_file(own))  # a cluster kvstore started for this user
        source = str(own)
    try:
        gcs = canonicalize_bootstrap_address(address)
    except ValueError as error:
        raise InvalidArgument("address", str(error)) from None
    if gcs is None:
        return  # "auto" found no cluster: ray.init says so
    if _gcs_accepts(gcs, ()):
        raise ConfigError(
            "ray token",
            f"the Ray cluster at {gcs} accepts callers without a token: kvstore joins only "
            "clusters whose every node runs with RAY_AUTH_MODE=token",
        )
    header = _raylet().AuthenticationTokenLoader.instance().get_token_for_http_header()
    if _gcs_accepts(gcs, tuple(header.items())) is False:
        raise ConfigError("ray token", f"the Ray cluster at {gcs} refused the token from {source}")


def machine_resource(machine_id: str) -> str:
    """Name of the custom resource that machine ``machine_id`` carries."""
    return f"kvstore_machine_{machine_id}"


def pin_to_machine(machine_id: str) -> dict[str, Any]:
    """Actor options placing an actor on machine ``machine_id`` of a ``LocalCluster``.

    ``num_cpus=0``: a pinned actor that also held a CPU could wait forever in
    PENDING_CREATION once the machine's CPUs are taken (seen with Ray 2.60).
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


def pin_to_host(address: str) -> dict[str, Any]:
    """Actor options placing an actor on the host at ``address``, whichever Ray node runs
    there now: a host whose Ray restarts (a new node id) gets its restartable actors back."""
    if not address or not isinstance(address, str):
        raise InvalidArgument("address", f"must be a host address, got {address!r}")
    return {"num_cpus": 0, "resources": {f"node:{address}": 0.001}}


#: Ray node resources that say what a host is for: storage nodes go only to hosts carrying
#: ``kvstore_storage`` when any does (a client or head host carries none), and the control
#: plane (meta shards, repair) to a host carrying ``kvstore_control`` when one does.
STORAGE_RESOURCE = "kvstore_storage"
CONTROL_RESOURCE = "kvstore_control"


def storage_hosts() -> list[str]:
    """Addresses of the live hosts storage nodes may go to, sorted: the Ray nodes carrying
    ``kvstore_storage`` (all of them when none does), one per address. Empty when some address
    runs several Ray nodes (simulated machines on one host: not hosts of their own)."""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    marked = [node for node in nodes if node.get("Resources", {}).get(STORAGE_RESOURCE)]
    chosen = marked or nodes
    addresses = [str(node["NodeManagerAddress"]) for node in chosen]
    all_addresses = [str(node["NodeManagerAddress"]) for node in nodes]
    if len(set(all_addresses)) != len(all_addresses):
        return []
    return sorted(addresses)


def control_node_ids() -> list[str]:
    """Live Ray nodes carrying ``kvstore_control`` (the control plane's hosts), sorted."""
    return sorted(
        str(node["NodeID"])
        for node in ray.nodes()
        if node.get("Alive") and node.get("Resources", {}).get(CONTROL_RESOURCE)
    )


def control_plane_options() -> dict[str, Any]:
    """Placement of the control-plane actors: on a host carrying ``kvstore_control`` if any."""
    return {"resources": {CONTROL_RESOURCE: 0.001}} if control_node_ids() else {}


class Machines(Protocol):
    """What deploying on a set of machines needs: ``LocalCluster``, or a testbed's hosts."""

    @property
    def machines(self) -> list[str]: ...

    def node_id(self, machine_id: str) -> str: ...

    def add_machine(self, machine_id: str | None = None) -> str: ...

    def remove_machine(self, machine_id: str, graceful: bool = True) -> None: ...

    def control_node_ids(self) -> list[str]:
        """Ray nodes for the control plane (SWA entrypoints, ...); empty: anywhere."""
        ...


def cluster_cpus(default: int = 2) -> int:
    """CPUs of the connected Ray cluster, all nodes together (``default`` if it reports none)."""
    return int(ray.cluster_resources().get("CPU", default))


def node_addresses() -> dict[str, str]:
    """Hex id → IP address of every Ray node the GCS considers alive."""
    return {
        node["NodeID"]: str(node.get("NodeManagerAddress", ""))
        for node in ray.nodes()
        if node.get("Alive")
    }


def alive_node_ids() -> list[str]:
    """Hex ids of the Ray nodes the GCS currently considers alive (needs a connected driver)."""
    return sorted(node["NodeID"] for node in ray.nodes() if node.get("Alive"))


@dataclass(frozen=True)
class LocalClusterConfig:
    """How a ``LocalCluster`` is shaped. Health-check numbers decide how fast a machine that
    vanished without notice is declared dead (Ray's default is ~15 s; here ~6 s). Shorter is
    wrong on a busy host: a raylet starved for a few seconds (2 shared cores under a chaos
    scenario's load) was declared dead, and then exited, in the middle of a scenario: a fault
    nobody injected. The tier does not wait for Ray to notice: its repair loop and SWA
    directory find a dead machine themselves, within seconds."""

    machine_cpus: int = 2
    head_object_store_mib: int = 512
    machine_object_store_mib: int = 256
    health_check_period_ms: int = 1000
    health_check_timeout_ms: int = 3000
    health_check_failure_threshold: int = 6
    #: Objects up to this size travel inline in the gRPC reply instead of through the object
    #: store (measured with Ray 2.60: 4 MiB made 128 KiB round trips 2.3-2.9x faster).
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
    if address is None or _is_loopback_address(address):
        _apply_loopback_env()
    else:  # other hosts: Ray must find this one's own address (the loopback switch forbids it)
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if address is None:
        _token_for_own_cluster()
        _require_token_auth()
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
        _require_token_auth()
        _check_cluster_auth(address)
        ray.init(address=address, namespace=namespace, log_to_driver=False)


def _is_loopback_address(address: str) -> bool:
    """Whether a Ray address (``HOST:PORT``, ``auto``, ``ray://...``) names this machine's
    loopback; ``auto`` counts as loopback (a cluster kvstore started here)."""
    import ipaddress

    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host in ("auto", "localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LocalCluster:
    """A head (no CPUs) plus N worker nodes on this host, each standing for one machine."""

    def __init__(
        self, cluster: Cluster, config: LocalClusterConfig, token_path: Path | None = None
    ) -> None:
        self._cluster = cluster
        self._config = config
        #: The file holding the cluster's Ray token (None: given as RAY_AUTH_TOKEN).
        self.token_path = token_path
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
        # ray.cluster_utils.Cluster starts the processes itself, without ray.init's auth set-up.
        token_path = _token_for_own_cluster()
        _require_token_auth()
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
        local = cls(cluster, config, token_path)
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

    def control_node_ids(self) -> list[str]:
        """None of its own: the control plane goes anywhere (the head has no CPUs)."""
        return []

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
