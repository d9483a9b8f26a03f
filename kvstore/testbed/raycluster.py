"""A Ray cluster over testbed hosts, started the way an operator starts one on real machines.

The head host runs ``ray start --head`` (the GCS, no CPUs, resource ``kvstore_control`` so
kvstore's control plane lands there); every other host runs ``ray start --address HEAD``
with its own ``--node-ip-address``. Token authentication is on for every process: the token is
one 0600 file of the testbed's (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH``), which a
process on any host reads (they share the filesystem, as hosts provisioned with the same
secret would). Ray listens on every interface of its host, which in a namespace means ``lo``
and the host's test-range ``eth0`` only.

Storage hosts carry ``kvstore_storage`` (where ``kvstore up`` puts storage nodes) and
``kvstore_machine_<host>`` (what ``LocalCluster`` machines carry, so ``ChaosTier`` pins actors
to a host exactly as it pins them to a simulated machine). ``HostCluster`` answers the same
calls as ``kvstore.runtime.cluster.LocalCluster`` (``machines``, ``node_id``, ``add_machine``,
``remove_machine``), so the chaos tier runs on it unchanged; ``add_machine`` of a host whose
Ray died starts Ray there again, as the host's init system would.

``node_id`` asks the GCS (``ray.nodes()``): the calling process must be a connected driver.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstore.childenv import child_env
from kvstore.errors import InvalidArgument
from kvstore.runtime.cluster import (
    CONTROL_RESOURCE,
    RAY_TOKEN_ENV,
    RAY_TOKEN_PATH_ENV,
    STORAGE_RESOURCE,
    LocalClusterConfig,
    control_node_ids,
    machine_resource,
)
from kvstore.testbed.netns import TAG_VARIABLE, Network

RAY_PORT = 6379
_MIB = 1024 * 1024
_RAY_START_TIMEOUT_S = 120.0
#: Variables of this process that must not reach the testbed's Ray: the loopback-only switch
#: (under it ``ray start --address`` refuses to join) and a token of another cluster.
_DROP = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", RAY_TOKEN_ENV, "RAY_ADDRESS")


def ray_env(token_path: Path, tag: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every Ray process and driver on the testbed ``tag``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _DROP}
    env.update(
        {
            "RAY_AUTH_MODE": "token",
            RAY_TOKEN_PATH_ENV: str(token_path),
            "RAY_USAGE_STATS_ENABLED": "0",
            TAG_VARIABLE: tag,
        }
    )
    return child_env(env)


def ray_cli() -> str:
    """The ``ray`` command of this Python environment (a venv's own, not whichever is first on
    PATH: every host must run the Ray this process imports)."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else "ray"


class HostCluster:
    """Ray on a ``Network``'s hosts: ``head`` first, then ``storage`` hosts, then ``others``
    (hosts with a Ray node and no storage: the client)."""

    def __init__(
        self,
        network: Network,
        *,
        head: str,
        storage: Sequence[str],
        others: Sequence[str],
        token_path: Path,
        temp_dir: Path,
        config: LocalClusterConfig | None = None,
        host_cpus: int = 2,
    ) -> None:
        for host in (head, *storage, *others):
            network.address(host)  # InvalidArgument for a host the network does not have
        self.network = network
        self.head = head
        self.storage = list(storage)
        self.others = list(others)
        self.token_path = token_path
        self.temp_dir = temp_dir
        self.config = config or LocalClusterConfig()
        self.host_cpus = host_cpus

    @property
    def address(self) -> str:
        return f"{self.network.address(self.head)}:{RAY_PORT}"

    @property
    def machines(self) -> list[str]:
        """Storage hosts whose Ray is running (processes in their namespace)."""
        return [host for host in self.storage if self.network.pids(host)]

    def env(self) -> dict[str, str]:
        return ray_env(self.token_path, self.network.name)

    # --- starting Ray --------------------------------------------------------------------------

    def start(self) -> None:
        """Ray on every host: the head, then the rest."""
        self._ray_start(self.head, head=True)
        for host in [*self.storage, *self.others]:
            self._ray_start(host)

    def restart_all(self) -> None:
        """Ray on every host again, from scratch (after the head host was lost: a new GCS, a
        new cluster; whatever is left on a host is killed first)."""
        for host in [self.head, *self.storage, *self.others]:
            self.network.kill_host(host)
        self.start()

    def _resources(self, host: str) -> dict[str, float]:
        if host == self.head:
            return {CONTROL_RESOURCE: 1}
        if host in self.storage:
            return {STORAGE_RESOURCE: 1, machine_resource(host): 10_000}
        return {}

    def _ray_start(self, host: str, head: bool = False, tries: int = 3) -> None:
        """``ray start`` on ``host``; tried again (what was left killed first) when the node
        does not come up in time, as a supervisor would: on a loaded 2-core box a raylet may
        miss Ray's start-up deadline."""
        network = self.network
        argv = [ray_cli(), "start", "--node-ip-address", network.address(host)]
        argv += ["--temp-dir", str(self.temp_dir), "--disable-usage-stats"]
        store = self.config.head_object_store_mib if head else self.config.machine_object_store_mib
        argv += ["--object-store-memory", str(store * _MIB)]
        argv += ["--resources", json.dumps(self._resources(host))]
        if head:
            argv += ["--head", "--port", str(RAY_PORT), "--num-cpus", "0"]
            argv += ["--include-dashboard", "false"]
            argv += ["--system-config", json.dumps(self.config.system_config())]
        else:
            cpus = self.host_cpus if host in self.storage else 0
            argv += ["--address", self.address, "--num-cpus", str(cpus)]
        for attempt in range(1, tries + 1):
            done = network.run(host, argv, env=self.env(), timeout_s=_RAY_START_TIMEOUT_S)
            if done.returncode == 0:
                return
            if attempt == tries:
                tail = (done.stdout + done.stderr)[-2000:]
                raise RuntimeError(f"ray start on {host} failed {tries} times:\n{tail}")
            network.kill_host(host)
            time.sleep(1.0)

    # --- LocalCluster's calls ------------------------------------------------------------------

    def node_id(self, machine_id: str) -> str:
        """Ray node id (hex) of the live node on host ``machine_id`` (asks the GCS)."""
        import ray

        address = self.network.address(machine_id)
        for node in ray.nodes():
            if node.get("Alive") and node.get("NodeManagerAddress") == address:
                return str(node["NodeID"])
        raise InvalidArgument("machine_id", f"no live Ray node on {machine_id} ({address})")

    def control_node_ids(self) -> list[str]:
        """The head host's Ray node (it carries ``kvstore_control``): the control plane's."""
        return control_node_ids()

    def add_machine(self, machine_id: str | None = None) -> str:
        """Start Ray on storage host ``machine_id`` again (after a crash or once its link is
        back: a raylet the GCS declared dead exits when it hears so, and the host's
        supervisor starts a new one). Whatever is left of the old one is killed first."""
        if machine_id is None or machine_id not in self.storage:
            raise InvalidArgument("machine_id", f"one of {self.storage}, got {machine_id!r}")
        self.network.kill_host(machine_id)
        self._ray_start(machine_id)
        return machine_id

    def remove_machine(self, machine_id: str, graceful: bool = True) -> None:
        """Stop host ``machine_id``'s every process (``graceful``: SIGTERM first)."""
        if graceful:
            for pid in self.network.pids(machine_id):
                try:
                    os.kill(pid, 15)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while self.network.pids(machine_id) and time.monotonic() < deadline:
                time.sleep(0.1)
        self.network.kill_host(machine_id)

    def ensure_running(self, machine_id: str, steady_s: float = 5.0) -> str:
        """After a host's link came back: ``"kept"`` when its Ray node is alive in the GCS
        and stays so for ``steady_s``; else ``"restarted"``: the GCS declared it dead while it
        was cut off (its raylet exits when it hears so), so Ray is started there again, as
        the host's supervisor (systemd, KubeRay) would. Needs a connected driver."""
        alive_since = time.monotonic()
        while time.monotonic() - alive_since < steady_s:
            try:
                self.node_id(machine_id)
            except InvalidArgument:
                self.add_machine(machine_id)
                return "restarted"
            if not self._raylet_running(machine_id):
                self.add_machine(machine_id)
                return "restarted"
            time.sleep(0.5)
        return "kept"

    def _raylet_running(self, host: str) -> bool:
        for pid in self.network.pids(host):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"raylet" in f.read().split(b"\0")[0]:
                        return True
            except OSError:
                continue
        return False

    def wait_dead(self, machine_id: str, timeout_s: float = 60.0) -> float | None:
        """Seconds until the GCS no longer lists ``machine_id``'s node as alive, None on timeout
        (the calling process must be a connected driver)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            try:
                self.node_id(machine_id)
            except InvalidArgument:
                return time.monotonic() - started
            time.sleep(0.2)
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "head": self.head,
            "storage": self.storage,
            "others": self.others,
            "token_path": str(self.token_path),
            "temp_dir": str(self.temp_dir),
            "host_cpus": self.host_cpus,
        }
