"""Test hosts on one machine: network namespaces joined by a bridge, each with its own address.

Why namespaces: every "multi-machine" run of kvstore on one box otherwise shares one loopback
interface, so nothing crosses a network interface, binds a non-loopback address or loses a link.
A namespace has its own interfaces, addresses, routes and sockets: a process started in it
(``ip netns exec``) sees only its host's ``lo`` and ``eth0``. The processes still share the
machine's CPUs, memory, disk and ``/dev/shm``, which this module does not hide.

Layout of one ``Network`` named ``NAME`` (a short prefix, unique per testbed):

- ``NAME-sw``: the switch, a namespace holding only a bridge ``br0`` and one port per host
  (``p<i>``), so the machine's own namespace gets no interface at all;
- ``NAME-<host>``: one namespace per host, with ``lo`` and ``eth0`` (a veth whose peer is the
  host's switch port) carrying the host's address in a /24 of the test range 198.18.0.0/15
  (RFC 2544: benchmarking networks, never routed). IPv6 is off in every namespace, so sockets
  show only IPv4 test-range or loopback addresses.

A link flap is the switch port going down (``link_down``): the host's ``eth0`` loses carrier,
like a pulled cable or a switch port failing. A host crash is every process in its namespace
killed at once (``kill_host``). ``destroy`` kills every process of every host and deletes the
namespaces (their interfaces go with them); ``leftovers`` says what is still there (a namespace,
a process in one) so a run can check it cleaned up.

Needs root and ``ip`` (iproute2) and ``ss``. Every call here runs ``ip``; nothing is cached
across processes except what the names say, so another process can attach to a running network
by name (``Network.attach``).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError, InvalidArgument

#: Every process a testbed starts carries this variable (its network's name), so a process that
#: somehow left its namespace is still found (``tagged_processes``).
TAG_VARIABLE = "KVSTORE_TESTBED"
#: Every address a testbed hands out lies in this range (RFC 2544), and nothing else is routed.
TEST_RANGE = ipaddress.ip_network("198.18.0.0/15")
#: Names of testbed namespaces start with this (``leftovers`` finds them by it).
NAME_PREFIX = "kvtb"
SWITCH = "sw"
_MAX_HOSTS = 250
_IP_TIMEOUT_S = 30.0


def require_tools() -> None:
    """``ConfigError`` naming what is missing: root, ``ip`` or ``ss``."""
    if os.geteuid() != 0:
        raise ConfigError("testbed", "network namespaces need root (run as root)")
    for tool in ("ip", "ss"):
        if shutil.which(tool) is None:
            raise ConfigError("testbed", f"`{tool}` not found (apt-get install iproute2)")


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def namespaces() -> list[str]:
    """Every named network namespace on this machine."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def subnet_for(name: str) -> ipaddress.IPv4Network:
    """The /24 of the test range a network named ``name`` uses (stable per name; two testbeds
    never share a bridge, so equal subnets would still not meet)."""
    index = sum(name.encode()) % 512
    base = int(TEST_RANGE.network_address) + index * 256
    return ipaddress.ip_network(f"{ipaddress.ip_address(base)}/24")  # type: ignore[return-value]


@dataclass(frozen=True)
class Host:
    name: str
    index: int
    address: str


class Network:
    """Hosts on one bridge (see the module doc). Make with ``create``, find with ``attach``."""

    def __init__(self, name: str, hosts: Sequence[str]) -> None:
        if not name.startswith(NAME_PREFIX) or not name.isalnum() or len(name) > 10:
            raise InvalidArgument(
                "name", f"must be {NAME_PREFIX} + letters/digits, at most 10, got {name!r}"
            )
        if not hosts or len(hosts) > _MAX_HOSTS or len(set(hosts)) != len(hosts):
            raise InvalidArgument("hosts", f"1 to {_MAX_HOSTS} distinct names, got {hosts!r}")
        for host in hosts:
            if not host.isalnum() or host == SWITCH or len(host) > 12:
                raise InvalidArgument("hosts", f"{host!r}: letters/digits, at most 12, not 'sw'")
        self.name = name
        subnet = subnet_for(name)
        self.prefix_length = subnet.prefixlen
        self.hosts = {
            host: Host(host, index, str(subnet.network_address + index + 1))
            for index, host in enumerate(hosts)
        }

    # --- names ---------------------------------------------------------------------------------

    def namespace(self, host: str) -> str:
        return f"{self.name}-{self._host(host).name}"

    @property
    def switch(self) -> str:
        return f"{self.name}-{SWITCH}"

    def address(self, host: str) -> str:
        return self._host(host).address

    def port(self, host: str) -> str:
        """The host's port on the switch (what ``link_down`` takes down)."""
        return f"p{self._host(host).index}"

    def exec_prefix(self, host: str) -> list[str]:
        """Prefix a command with this to run it on ``host``."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def _host(self, host: str) -> Host:
        try:
            return self.hosts[host]
        except KeyError:
            known = ", ".join(self.hosts)
            raise InvalidArgument("host", f"no host {host!r} (hosts: {known})") from None

    # --- life cycle ----------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, hosts: Sequence[str], mtu: int = 1500) -> Network:
        """Make the switch and every host; on any failure, remove what was made and raise."""
        require_tools()
        network = cls(name, hosts)
        taken = [ns for ns in namespaces() if ns.startswith(f"{name}-")]
        if taken:
            raise ConfigError("testbed", f"{name} exists already ({', '.join(taken)}): down it")
        try:
            network._make(mtu)
        except BaseException:
            network.destroy()
            raise
        return network

    @classmethod
    def attach(cls, name: str, hosts: Sequence[str]) -> Network:
        """The running network ``name`` (made by another process)."""
        network = cls(name, hosts)
        missing = [
            network.namespace(h) for h in hosts if network.namespace(h) not in set(namespaces())
        ]
        if missing:
            raise ConfigError("testbed", f"{name} is not up: no namespace {missing[0]}")
        return network

    def _make(self, mtu: int) -> None:
        switch = self.switch
        _ip("netns", "add", switch)
        self._quiet_ipv6(switch)
        _ip("-n", switch, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "mtu", str(mtu), "up")
        for host in self.hosts.values():
            ns = self.namespace(host.name)
            _ip("netns", "add", ns)
            self._quiet_ipv6(ns)
            port = self.port(host.name)
            # Both ends are created in their namespaces: the machine's own gets no interface.
            _ip("link", "add", f"e{host.index}", "netns", ns, "mtu", str(mtu), "type", "veth",
                "peer", "name", port, "netns", switch, "mtu", str(mtu))  # fmt: skip
            _ip("-n", ns, "link", "set", f"e{host.index}", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{host.address}/{self.prefix_length}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")

    @staticmethod
    def _quiet_ipv6(ns: str) -> None:
        # Only IPv4 test-range and loopback addresses in a host: no link-local IPv6 either.
        for key in ("all", "default", "lo"):
            path = f"net.ipv6.conf.{key}.disable_ipv6=1"
            subprocess.run(
                ["ip", "netns", "exec", ns, "sysctl", "-qw", path],
                capture_output=True,
                timeout=_IP_TIMEOUT_S,
                check=False,
            )

    def destroy(self, grace_s: float = 3.0) -> list[str]:
        """Kill every process on every host (SIGTERM, then SIGKILL after ``grace_s``) and delete
        the namespaces. Returns what could not be removed (empty when clean)."""
        present = set(namespaces())
        hosts = [h for h in self.hosts if self.namespace(h) in present]
        for host in hosts:
            self._signal_all(host, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(self.pids(h) for h in hosts):
            time.sleep(0.1)
        for host in hosts:
            self.kill_host(host)
        for pid, _command in tagged_processes(self.name):  # one that left its namespace
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for ns in [self.namespace(h) for h in hosts] + [self.switch]:
            if ns in present:
                _ip("netns", "del", ns, check=False)
        return self.leftovers(self.name)

    @staticmethod
    def purge(name: str = NAME_PREFIX) -> None:
        """Kill the processes of every namespace whose name starts with ``name`` and delete
        those namespaces: what a crashed run left, state file or not."""
        for ns in namespaces():
            if not ns.startswith(name):
                continue
            for _attempt in range(50):
                pids = _ip("netns", "pids", ns, check=False).split()
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)
            _ip("netns", "del", ns, check=False)

    @staticmethod
    def leftovers(name: str = NAME_PREFIX) -> list[str]:
        """Namespaces whose names start with ``name``, processes still in them, and processes
        anywhere tagged with a testbed name starting with ``name``."""
        found: list[str] = []
        for ns in namespaces():
            if ns.startswith(name):
                pids = _ip("netns", "pids", ns, check=False).split()
                found.append(f"namespace {ns}" + (f" ({len(pids)} processes)" if pids else ""))
        found += [f"process {pid} ({what})" for pid, what in tagged_processes(name)]
        return found

    # --- processes -----------------------------------------------------------------------------

    def popen(
        self,
        host: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (its own session: a Ctrl-C at the terminal that started
        the testbed does not reach it; ``destroy`` does)."""
        return subprocess.Popen(  # type: ignore[call-overload]
            [*self.exec_prefix(host), *argv],
            env=dict(env) if env is not None else None,
            start_new_session=True,
            **kwargs,
        )

    def run(
        self,
        host: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout_s: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to completion (stdout and stderr captured, text)."""
        return subprocess.run(
            [*self.exec_prefix(host), *argv],
            env=dict(env) if env is not None else None,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            start_new_session=True,
        )

    def pids(self, host: str) -> list[int]:
        """Every process whose network namespace is ``host``'s."""
        out = _ip("netns", "pids", self.namespace(host), check=False)
        return [int(pid) for pid in out.split()]

    def _signal_all(self, host: str, signum: int) -> None:
        for pid in self.pids(host):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def kill_host(self, host: str, timeout_s: float = 10.0) -> None:
        """Crash ``host``: SIGKILL every process in it until none is left (a process may be
        forking while we kill)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids(host)
            if not pids:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes on {host} survive SIGKILL: {pids}")
            self._signal_all(host, signal.SIGKILL)
            time.sleep(0.05)

    # --- links ---------------------------------------------------------------------------------

    def link_down(self, host: str) -> None:
        """Take ``host``'s switch port down: it can reach no host and no host reaches it."""
        _ip("-n", self.switch, "link", "set", self.port(host), "down")

    def link_up(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.port(host), "up")

    def link_is_up(self, host: str) -> bool:
        out = _ip("-n", self.switch, "-o", "link", "show", self.port(host))
        return ",UP" in out or "<UP" in out

    # --- sockets -------------------------------------------------------------------------------

    def sockets(self, host: str) -> list[tuple[str, str, str]]:
        """``ss -tanH`` on ``host``: (state, local address:port, peer address:port) of every
        TCP socket, listeners included."""
        done = self.run(host, ["ss", "-tanH"], timeout_s=_IP_TIMEOUT_S)
        rows = []
        for line in done.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 5:
                rows.append((parts[0], parts[3], parts[4]))
        return rows

    def foreign_sockets(self, host: str) -> list[str]:
        """``host``'s TCP sockets with an address outside the test range and loopback (a
        listener on every interface, ``*`` or ``0.0.0.0``, counts as the host's own: in a
        namespace those are only ``lo`` and ``eth0``)."""
        bad = []
        for state, local, peer in self.sockets(host):
            for end in (local, peer):
                address = end.rsplit(":", 1)[0].strip("[]")
                if address.startswith("::ffff:"):
                    address = address[len("::ffff:") :]
                if address in ("*", "0.0.0.0"):
                    continue
                try:
                    ip = ipaddress.ip_address(address)
                except ValueError:
                    bad.append(f"{state} {local} {peer}")
                    break
                if not (ip.is_loopback or ip in TEST_RANGE):
                    bad.append(f"{state} {local} {peer}")
                    break
        return bad


def tagged_processes(name: str = NAME_PREFIX) -> list[tuple[int, str]]:
    """(pid, command) of every live process whose ``TAG_VARIABLE`` starts with ``name`` (a
    zombie has no environment left, and holds nothing but its pid)."""
    needle = f"{TAG_VARIABLE}={name}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if any(item.startswith(needle) for item in environ.split(b"\0")):
            found.append((int(entry), command[:80]))
    return found
