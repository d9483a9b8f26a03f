"""The multi-host testbed: hosts in network namespaces, a Ray cluster over them, kvstore on top.

    with Testbed.up(TestbedConfig(storage_hosts=7)) as bed:      # torn down on exit
        tier = bed.kvstore_up()                                   # `kvstore up` on the head
        bed.run("client", ["kvstore", "status", *bed.client_flags(tier)])

Hosts: ``head`` (Ray's GCS, kvstore's control plane and its gRPC gateway, no storage), ``s1`` ..
``sN`` (storage hosts: ``kvstore up`` spreads its storage nodes over them, several per host when
there are fewer hosts than nodes, and places a stripe's shards at most ceil(12 / N) to a host),
and ``client`` (a Ray node with no storage: where engines, benchmarks and replays run).

The data plane (the direct sockets of storage nodes, meta shards and the SWA tier) runs TLS,
as it must between machines (it refuses plaintext beyond loopback): ``up`` makes one
self-signed certificate for every host's address, and ``env`` points every process at it
(``KVSTORE_FASTCALL_TLS_CERT``/``_KEY``, and ``_CA`` the same file: clients check the chain).

Everything a testbed makes is under one run directory (``/tmp/<name>-<random>``, fresh and
private: ``rundir``; the Ray token, Ray's temp dir, the gateway's and the data plane's TLS
certificates, the gateway's bearer token, logs) and one set of
network namespaces (``<name>-<host>``); ``testbed.json`` there lets another process attach to it
(``Testbed.attach``) or take it down (``down``). Teardown kills every process on every host,
deletes the namespaces and the run directory, and checks that nothing is left (``leftovers``):
on ``__exit__``, on a failed ``up``, on SIGINT/SIGTERM (``teardown_on_signals``), and on demand.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from kvstore.errors import ConfigError
from kvstore.fastcall.tls import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV
from kvstore.privatefs import create_private_file
from kvstore.runtime.cluster import LocalClusterConfig
from kvstore.runtime.upprocess import TierProcess
from kvstore.testbed.netns import NAME_PREFIX, Network, require_tools
from kvstore.testbed.raycluster import HostCluster
from kvstore.testbed.rundir import check_private, is_ours, make_run_dir

#: Where testbeds make their run directories (short: Ray's socket paths must fit 107 bytes).
#: /tmp itself: sticky, so no other user can replace a run directory made there.
RUN_ROOT = Path("/tmp")
STATE_FILE = "testbed.json"
HEAD, CLIENT = "head", "client"
GATEWAY_PORT = 50051
#: The data plane's certificate and key, in the run directory.
FASTCALL_DIR = "fastcall"


@dataclass(frozen=True)
class TestbedConfig:
    """Shape of a testbed. The default, 7 storage hosts of 2 storage nodes each, is the
    smallest that keeps every promise across a host loss: a stripe has at most 2 shards on a
    host (any one host may go), and the 6 hosts left still hold 12 shards (writes stay whole)."""

    storage_hosts: int = 7
    #: CPUs each storage host's Ray node advertises (they share this machine's cores).
    host_cpus: int = 2
    object_store_mib: int = 128
    mtu: int = 1500
    #: Name of the testbed (``kvtb`` + up to 6 letters/digits); random when empty.
    name: str = ""
    run_root: str = str(RUN_ROOT)
    #: Ray health checks: a host silent for ~period x threshold is declared dead (~6-9 s;
    #: not shorter: on a loaded 2-core box a starved raylet must not be declared dead).
    health_check_period_ms: int = 1000
    health_check_failure_threshold: int = 6

    __test__ = False  # not a pytest class

    def __post_init__(self) -> None:
        if isinstance(self.storage_hosts, bool) or not 1 <= self.storage_hosts <= 64:
            raise ConfigError("storage_hosts", f"must be 1 to 64, got {self.storage_hosts!r}")
        for name in ("host_cpus", "object_store_mib", "mtu", "health_check_period_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.name and (
            not self.name.startswith(NAME_PREFIX) or not self.name.isalnum() or len(self.name) > 10
        ):
            raise ConfigError("name", f"{NAME_PREFIX} + up to 6 letters/digits, got {self.name!r}")

    def hosts(self) -> list[str]:
        return [HEAD, *self.storage_names(), CLIENT]

    def storage_names(self) -> list[str]:
        return [f"s{i}" for i in range(1, self.storage_hosts + 1)]

    def ray_config(self) -> LocalClusterConfig:
        return LocalClusterConfig(
            machine_cpus=self.host_cpus,
            head_object_store_mib=self.object_store_mib,
            machine_object_store_mib=self.object_store_mib,
            health_check_period_ms=self.health_check_period_ms,
            health_check_timeout_ms=self.health_check_period_ms * 3,
            health_check_failure_threshold=self.health_check_failure_threshold,
            # A raylet that cannot reach the GCS exits after this (Ray's default: 60 s).
            extra_system_config={"gcs_rpc_server_reconnect_timeout_s": 30},
        )


@dataclass
class Gateway:
    """What a client needs to reach a testbed's ``kvstore up``."""

    address: str
    token_file: Path
    tls_root_cert: Path

    def flags(self, address_flag: str = "--server") -> list[str]:
        """The gateway's address, ``--token-file`` and ``--tls-root-cert`` for a kvstore client
        command (``kvstore status``, ``get``, ...; ``kvstore replay`` names it ``--address``)."""
        return [
            address_flag,
            self.address,
            "--token-file",
            str(self.token_file),
            "--tls-root-cert",
            str(self.tls_root_cert),
        ]


@dataclass
class Testbed:
    config: TestbedConfig
    network: Network
    ray: HostCluster
    run_dir: Path
    tiers: list[TierProcess] = field(default_factory=list)
    #: More environment for every process this testbed starts from now on (``env``).
    extra_env: dict[str, str] = field(default_factory=dict)

    __test__ = False

    # --- up / attach / down --------------------------------------------------------------------

    @classmethod
    def up(cls, config: TestbedConfig | None = None, progress: Any = None) -> Testbed:
        """Bring a testbed up; on any failure (Ctrl-C included) take down what was made."""
        config = config or TestbedConfig()
        require_tools()
        name = config.name or f"{NAME_PREFIX}{secrets.token_hex(3)}"
        config = TestbedConfig(**{**asdict(config), "name": name})
        say = progress or (lambda message: None)
        network: Network | None = None
        run_dir: Path | None = None
        try:
            run_dir = make_run_dir(Path(config.run_root), name)
            token = run_dir / "ray_token"
            create_private_file(token, secrets.token_hex(32).encode(), "ray token")
            say(f"network: {len(config.hosts())} hosts on a bridge")
            network = Network.create(name, config.hosts(), mtu=config.mtu)
            _data_plane_certificate(run_dir, [network.address(h) for h in config.hosts()])
            ray = HostCluster(
                network,
                head=HEAD,
                storage=config.storage_names(),
                others=[CLIENT],
                token_path=token,
                temp_dir=run_dir / "ray",
                config=config.ray_config(),
                host_cpus=config.host_cpus,
            )
            bed = cls(config, network, ray, run_dir)
            bed._save()
            say(f"ray: head at {ray.address}, token auth on")
            ray.start()
            return bed
        except BaseException:
            if network is not None:
                network.destroy()
            if run_dir is not None:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise

    @classmethod
    def attach(cls, run_dir: Path) -> Testbed:
        """The testbed whose run directory is ``run_dir`` (brought up by another process)."""
        path = Path(run_dir) / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ConfigError("testbed", f"cannot read {path}: {error}") from None
        config = TestbedConfig(**state["config"])
        network = Network.attach(config.name, config.hosts())
        ray = HostCluster(
            network,
            head=HEAD,
            storage=config.storage_names(),
            others=[CLIENT],
            token_path=Path(state["ray"]["token_path"]),
            temp_dir=Path(state["ray"]["temp_dir"]),
            config=config.ray_config(),
            host_cpus=config.host_cpus,
        )
        return cls(config, network, ray, Path(run_dir))

    def _save(self) -> None:
        state = {
            "config": asdict(self.config),
            "ray": self.ray.describe(),
            "addresses": {h: self.network.address(h) for h in self.network.hosts},
        }
        (self.run_dir / STATE_FILE).write_text(json.dumps(state, indent=1))

    def down(self) -> list[str]:
        """Stop everything and remove every trace; returns what was left (empty when clean)."""
        for tier in self.tiers:
            tier.stop(timeout_s=20)
        self.tiers.clear()
        left = self.network.destroy()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.run_dir.exists():
            left.append(f"directory {self.run_dir}")
        return left

    def __enter__(self) -> Testbed:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        left = self.down()
        if left and kind is None:
            raise RuntimeError(f"testbed {self.config.name} left behind: {left}")

    # --- using it ------------------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a kvstore or Ray process on any host of this testbed: the data
        plane in TLS (``fastcall_env``) for whatever deploys or calls the tier there."""
        return {**self.ray.env(), **self.fastcall_env(), **self.extra_env, **extra}

    def fastcall_env(self) -> dict[str, str]:
        """The data plane's TLS setting: the certificate ``up`` made, its own CA (clients check
        the chain alone; the key challenge inside proves the actor). The hosts share this
        machine's filesystem, so the paths are the same on each, as the setting asks."""
        folder = self.run_dir / FASTCALL_DIR
        cert = str(folder / "server.pem")
        return {TLS_CERT_ENV: cert, TLS_KEY_ENV: str(folder / "server.key"), TLS_CA_ENV: cert}

    def run(
        self, host: str, argv: Sequence[str], timeout_s: float = 600.0, **extra_env: str
    ) -> subprocess.CompletedProcess[str]:
        return self.network.run(host, argv, env=self.env(**extra_env), timeout_s=timeout_s)

    def kvstore_up(self, *flags: str, timeout_s: float = 300.0) -> Gateway:
        """``kvstore up --address RAY`` on the head host: 2 storage nodes a storage host, the
        gateway on the head's address with TLS and a bearer token, 2 meta shards (the hosts
        share this machine's cores: ``kvstore up`` would size them to the 2 CPUs each host's
        Ray node advertises). ``flags`` go last (they win). Stopped by ``down``."""
        head = self.network.address(HEAD)
        check_private(self.run_dir)  # still the one ``up`` made: nothing put in its place
        secrets_dir = self.run_dir / "gateway"
        secrets_dir.mkdir(mode=0o700, exist_ok=True)
        check_private(secrets_dir)
        token = secrets_dir / "token"
        if not token.exists():
            create_private_file(token, secrets.token_hex(24).encode(), "gateway token")
        cert, key = secrets_dir / "server.pem", secrets_dir / "server.key"
        if not cert.exists():
            _self_signed(cert, key, head)
        tier = TierProcess.start(
            self.run_dir / "kvstore-data",
            "--address", self.ray.address, "--host", head, "--port", str(GATEWAY_PORT),
            "--token-file", str(token), "--tls-cert", str(cert), "--tls-key", str(key),
            "--storage-nodes", str(2 * self.config.storage_hosts), "--meta-shards", "2",
            *flags,
            env=self.env(),
            prefix=self.network.exec_prefix(HEAD),
            timeout_s=timeout_s,
        )  # fmt: skip
        self.tiers.append(tier)
        return Gateway(tier.address, token, cert)

    def foreign_sockets(self) -> dict[str, list[str]]:
        """Per host, TCP sockets with an address outside the test range and loopback."""
        return {
            host: bad for host in self.network.hosts if (bad := self.network.foreign_sockets(host))
        }

    def status(self) -> dict[str, Any]:
        return {
            "name": self.config.name,
            "run_dir": str(self.run_dir),
            "ray": self.ray.address,
            "hosts": {
                host: {
                    "address": self.network.address(host),
                    "processes": len(self.network.pids(host)),
                    "link": "up" if self.network.link_is_up(host) else "down",
                }
                for host in self.network.hosts
            },
        }


def _self_signed(
    cert: Path, key: Path, *addresses: str, common_name: str = "kvstore-testbed"
) -> None:
    """A self-signed EC certificate for servers at ``addresses`` (testbed only)."""
    names = ",".join(f"IP:{address}" for address in addresses)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "2", "-subj", f"/CN={common_name}",
         "-addext", f"subjectAltName={names}", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    os.chmod(key, 0o600)


def _data_plane_certificate(run_dir: Path, addresses: Sequence[str]) -> None:
    """The data plane's certificate (``Testbed.fastcall_env``), for every host's address, in
    a private folder of the run directory, checked first as the gateway's secrets are."""
    check_private(run_dir)
    folder = run_dir / FASTCALL_DIR
    folder.mkdir(mode=0o700)
    check_private(folder)
    cert, key = folder / "server.pem", folder / "server.key"
    _self_signed(cert, key, *addresses, common_name="kvstore-testbed-data-plane")


def testbeds(run_root: Path = RUN_ROOT) -> list[Path]:
    """Run directories of this user's testbeds on this machine (one another user made is not
    taken for one)."""
    if not run_root.is_dir():
        return []
    found = (path.parent for path in run_root.glob(f"{NAME_PREFIX}*/{STATE_FILE}"))
    return sorted(path for path in found if is_ours(path))


def down_all(run_root: Path = RUN_ROOT) -> list[str]:
    """Take down every testbed on this machine, and any testbed namespace a crashed run left
    without a state file; returns what could not be removed."""
    left: list[str] = []
    for run_dir in testbeds(run_root):
        try:
            left += Testbed.attach(run_dir).down()
        except ConfigError:  # its namespaces are gone already: only the directory is left
            shutil.rmtree(run_dir, ignore_errors=True)
    Network.purge()
    return left + Network.leftovers()


@contextmanager
def teardown_on_signals(bed: Testbed) -> Iterator[None]:
    """While inside, SIGINT and SIGTERM take the testbed down before the process ends (a
    signal arriving outside the main thread is left to the default handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: FrameType | None) -> None:
        bed.down()
        raise KeyboardInterrupt(f"signal {signum}: testbed {bed.config.name} taken down")

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
