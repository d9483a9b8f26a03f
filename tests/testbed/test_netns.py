"""The testbed's network layer: hosts in namespaces on a bridge, links, sockets, teardown."""

from __future__ import annotations

import secrets
import subprocess
import time
from collections.abc import Iterator

import pytest

from kvstore.errors import ConfigError, InvalidArgument
from kvstore.testbed.netns import TEST_RANGE, Network, namespaces

CONNECT = (
    "import socket, sys; s = socket.socket(); s.settimeout(2); "
    "print(s.connect_ex((sys.argv[1], int(sys.argv[2]))))"
)


def _connect(network: Network, host: str, to: str, port: int) -> int:
    done = network.run(host, ["python3", "-c", CONNECT, network.address(to), str(port)])
    return int(done.stdout.strip())


@pytest.fixture
def network() -> Iterator[Network]:
    made = Network.create(f"kvtb{secrets.token_hex(3)}", ["a", "b", "c"])
    try:
        yield made
    finally:
        made.destroy()


def test_hosts_get_their_own_test_range_address_and_reach_each_other(network: Network) -> None:
    import ipaddress

    addresses = {network.address(h) for h in network.hosts}
    assert len(addresses) == 3
    assert all(ipaddress.ip_address(a) in TEST_RANGE for a in addresses)
    shown = network.run("a", ["ip", "-o", "addr"]).stdout
    assert network.address("a") in shown and "inet6" not in shown  # IPv6 off
    assert "eth0" in shown and network.address("b") not in shown
    # Nothing listens on b: a's connect is refused by b's stack, i.e. it got there.
    assert _connect(network, "a", "b", 9) == 111  # ECONNREFUSED
    # The machine's own namespace gained no interface.
    own = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert network.name not in own and " p0" not in own


def test_a_link_down_cuts_the_host_off_and_up_brings_it_back(network: Network) -> None:
    network.link_down("b")
    assert not network.link_is_up("b")
    assert _connect(network, "a", "b", 9) != 111  # no answer at all now
    assert _connect(network, "a", "c", 9) == 111  # the others still meet
    network.link_up("b")
    deadline = time.monotonic() + 10
    while _connect(network, "a", "b", 9) != 111:
        assert time.monotonic() < deadline, "b did not come back"
        time.sleep(0.2)


def _listen(network: Network, host: str, address: str) -> subprocess.Popen[bytes]:
    """A listener on ``address`` on ``host``, returned once ``ss`` shows it."""
    code = (
        "import socket, sys, time; s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(); "
        "time.sleep(120)"
    )
    process = network.popen(host, ["python3", "-c", code, address])
    deadline = time.monotonic() + 60
    while not any(local.startswith(address + ":") for _, local, _ in network.sockets(host)):
        assert process.poll() is None and time.monotonic() < deadline, f"no listener on {address}"
        time.sleep(0.1)
    return process


def test_sockets_outside_the_test_range_are_reported(network: Network) -> None:
    listeners = [_listen(network, "c", "127.0.0.1"), _listen(network, "c", network.address("c"))]
    try:
        assert network.foreign_sockets("c") == []  # loopback and the test range are fine
        # An address outside the range (a documentation address on lo) is not.
        network.run("c", ["ip", "addr", "add", "192.0.2.7/32", "dev", "lo"])
        listeners.append(_listen(network, "c", "192.0.2.7"))
        stray = network.foreign_sockets("c")
        assert len(stray) == 1 and "192.0.2.7" in stray[0]
    finally:
        for listener in listeners:
            listener.kill()


def test_a_crashed_host_has_no_process_left_and_destroy_leaves_nothing() -> None:
    name = f"kvtb{secrets.token_hex(3)}"
    network = Network.create(name, ["a", "b"])
    try:
        for _ in range(3):
            network.popen("a", ["sleep", "300"])
        network.popen("b", ["sh", "-c", "sleep 300 & sleep 300"])
        time.sleep(0.3)
        assert len(network.pids("a")) == 3
        network.kill_host("a")
        assert network.pids("a") == []
        assert network.pids("b")
    finally:
        left = network.destroy()
    assert left == []
    assert not [ns for ns in namespaces() if ns.startswith(name)]
    assert Network.leftovers(name) == []


def test_bad_names_and_a_second_network_of_one_name_are_refused(network: Network) -> None:
    with pytest.raises(InvalidArgument, match="name"):
        Network("notkvtb", ["a"])
    with pytest.raises(InvalidArgument, match="hosts"):
        Network("kvtbx", ["a", "a"])
    with pytest.raises(InvalidArgument, match="no host 'z'"):
        network.address("z")
    with pytest.raises(ConfigError, match="exists already"):
        Network.create(network.name, ["a"])
