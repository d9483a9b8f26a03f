"""The data plane refuses plaintext beyond loopback (issue 31).

The finding: the direct sockets of storage nodes, meta shards and the SWA tier carry every
tenant's KV, and on a cluster of machines they listened on each Ray node's address in plaintext
unless the operator had found ``KVSTORE_FASTCALL_TLS_*``; the gateway, beside them, refused to
do so without ``--insecure``. Now a ``FastCallServer`` that would listen beyond loopback without
TLS refuses to start, naming the address and the two ways out, unless the operator said
insecure (``KVSTORE_FASTCALL_INSECURE=1``, which ``kvstore up --insecure`` sets); loopback stays
plaintext.

Beyond loopback means another interface, which a test may not listen on here: those tests run
the server on a host of a network namespace they make (``kvstore.testbed.netns``, 198.18.0.0/15;
root) and its client on a second host, across the namespaces' bridge. Against the code before
the fix, the server there starts in plaintext and the refusal tests fail.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from certs import ca_signed

from kvstore.childenv import child_env
from kvstore.errors import ConfigError
from kvstore.fastcall.client import FastChannel
from kvstore.fastcall.frames import wait_ready
from kvstore.fastcall.server import FastCallServer
from kvstore.fastcall.tls import (
    INSECURE_ENV,
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_ENV,
    TLS_KEY_ENV,
    FastcallConfig,
    check_plaintext,
    is_loopback,
    tls_env_options,
)


class Target:
    def double(self, value: int) -> int:
        return 2 * value


def _double(endpoint: tuple[str, int, bytes], value: int) -> int:
    channel = FastChannel(endpoint)
    try:
        conn = channel.start("double", (value,))
        assert wait_ready([conn], 10.0) == [conn]
        return int(channel.finish(conn))
    finally:
        channel.close()


# --- the decision, and the server's refusal before anything listens ----------------------------


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "::ffff:127.0.0.1"]
)
def test_loopback_is_127_slash_8_and_colon_colon_1(host: str) -> None:
    assert is_loopback(host)
    assert check_plaintext(host, tls=False, insecure=False) is False  # plaintext, no warning


@pytest.mark.parametrize(
    "host",
    # Another interface, every interface (the wildcards), and names: a name is not resolved,
    # it could resolve anywhere (``localhost`` included: /etc/hosts is the machine's to say).
    ["198.18.0.2", "10.0.0.1", "192.168.1.5", "0.0.0.0", "", "::", "::ffff:198.18.0.2",
     "fe80::1", "localhost", "storage-1.internal"],
)  # fmt: skip
def test_anything_else_is_beyond_loopback_and_needs_tls_or_the_operators_word(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ConfigError) as refused:
        check_plaintext(host, tls=False, insecure=False)
    message = str(refused.value)
    assert f"listen on {host}, beyond loopback" in message
    for way_out in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV, f"{INSECURE_ENV}=1", "--insecure"):
        assert way_out in message
    assert check_plaintext(host, tls=True, insecure=False) is False  # TLS: nothing to say
    assert check_plaintext(host, tls=False, insecure=True) is True  # the operator's word: warn


def test_a_server_beyond_loopback_without_tls_refuses_before_it_binds() -> None:
    # 198.18.0.2 is no address of this machine's: without the check the bind fails instead
    # (OSError, "Cannot assign requested address"), so the refusal is the check's.
    with pytest.raises(ConfigError) as refused:
        FastCallServer(Target(), ("double",), threading.Lock(), "198.18.0.2")
    assert refused.value.field == TLS_CERT_ENV
    assert "198.18.0.2" in str(refused.value) and INSECURE_ENV in str(refused.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_loopback_stays_plaintext_by_default(host: str) -> None:
    server = FastCallServer(Target(), ("double",), threading.Lock(), host)
    try:
        assert server.endpoint[0] == host and server.stats()["tls"] is False
        assert _double(server.endpoint, 21) == 42
    finally:
        server.close()


# --- the setting: one loader, handed on to the actors, set by `kvstore up --insecure` -----------


def _without_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's environment without the data-plane setting, restored after the test
    (set first, so that even a variable the test adds, as ``kvstore up`` does, is undone)."""
    for name in (*TLS_ENV, INSECURE_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_the_insecure_setting_is_read_with_tls_and_handed_on_to_actors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvstore.runtime.blockstore_actors import actor_options

    assert FastcallConfig.from_env({}).insecure is False
    assert FastcallConfig.from_env({INSECURE_ENV: "1"}).insecure is True
    assert FastcallConfig.from_env({INSECURE_ENV: "0"}).insecure is False
    with pytest.raises(ConfigError) as refused:
        FastcallConfig.from_env({INSECURE_ENV: "maybe"})
    assert refused.value.field == INSECURE_ENV
    handed_on = {"runtime_env": {"env_vars": {INSECURE_ENV: "1"}}}
    assert tls_env_options({INSECURE_ENV: "1"}) == handed_on
    _without_the_setting(monkeypatch)
    assert "runtime_env" not in actor_options("a")
    monkeypatch.setenv(INSECURE_ENV, "true")
    assert actor_options("a")["runtime_env"] == handed_on["runtime_env"]


def test_kvstore_up_insecure_covers_the_data_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from kvstore.commands import up
    from kvstore.runtime import cluster

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    assert "data plane" in next(a.help for a in parser._actions if "--insecure" in a.option_strings)
    assert "data plane" in up.DESCRIPTION
    _without_the_setting(monkeypatch)
    # The pre-flight before deploying: the Ray nodes' addresses, where the actors will listen.
    monkeypatch.setattr(cluster, "node_addresses", lambda: {"n1": "127.0.0.1", "n2": "198.18.0.7"})
    config = up._data_plane(insecure=False)
    assert INSECURE_ENV not in os.environ
    with pytest.raises(ConfigError, match="198.18.0.7, beyond loopback"):
        up._check_data_plane(config)
    config = up._data_plane(insecure=True)
    assert os.environ[INSECURE_ENV] == "1"  # what deploy hands on to every actor
    assert up._check_data_plane(config) == ["198.18.0.7"]  # warned of, by address


# --- on a network: a host of a namespace this test makes ---------------------------------------

#: A non-loopback address to listen on needs a network namespace (root, iproute2): these run in
#: the hosts suite, like the testbed's (``-m hosts``; .ci/run runs it as root).
needs_namespaces = pytest.mark.hosts

#: The server on host ``a``: the actors' way (``from_env``: TLS and insecure from the
#: environment), its endpoint on stdout, served until stdin closes.
SERVE = """
import json, logging, sys, threading
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from kvstore.fastcall.server import FastCallServer
class Target:
    def double(self, value):
        return 2 * value
server = FastCallServer.from_env(Target(), ("double",), threading.Lock(), sys.argv[1])
host, port, key = server.endpoint
print(json.dumps([host, port, key.hex(), server.stats()["tls"]]), flush=True)
sys.stdin.read()
"""

#: A client on host ``b``: one call with this process's setting (``tls_from_env``), and one in
#: plaintext whatever the setting.
CALL = """
import json, ssl, sys
from kvstore.fastcall.client import FastChannel, connect
from kvstore.fastcall.frames import wait_ready
from kvstore.fastcall.tls import tls_from_env
host, port, key = json.loads(sys.argv[1])[:3]
endpoint = (host, port, bytes.fromhex(key))
channel = FastChannel(endpoint, tls=tls_from_env()[1])
conn = channel.start("double", (21,))
assert wait_ready([conn], 10.0) == [conn]
answer = channel.finish(conn)
in_tls = isinstance(channel._free[0]._sock, ssl.SSLSocket)
try:
    connect(endpoint, timeout_s=0.5).close()
    plaintext = "served"
except OSError as error:
    plaintext = type(error).__name__
print(json.dumps({"answer": answer, "tls": in_tls, "plaintext": plaintext}))
"""


@pytest.fixture(scope="module")
def network() -> Iterator[Any]:
    # Not a skip: a run that selected these tests without root is a broken set-up, said so.
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("these tests need root and iproute2 (`ip`): see .ci/run", False)
    from kvstore.testbed.netns import Network

    made = Network.create(f"kvtb{secrets.token_hex(3)}", ["a", "b"])
    try:
        yield made
    finally:
        assert made.destroy() == []


@pytest.fixture(scope="module")
def data_plane_pki(network: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA and a certificate it signed for host ``a``'s address: the setting, as an operator
    sets it in every process of the cluster."""
    address = network.address("a")
    pki = ca_signed(
        tmp_path_factory.mktemp("pki"), {"server": ("storage-a", f"subjectAltName=IP:{address}")}
    )
    return {
        TLS_CERT_ENV: str(pki["server.pem"]),
        TLS_KEY_ENV: str(pki["server.key"]),
        TLS_CA_ENV: str(pki["ca.pem"]),
    }


def _environment(**setting: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in (*TLS_ENV, INSECURE_ENV)}
    return child_env(base, **setting)


@dataclass
class Served:
    endpoint: list[Any]  # [host, port, key hex, in TLS]; [] when the server did not start
    said: str = ""  # its stderr: all of it once it ended (a refusal, or the log after stop)


@contextmanager
def serving(network: Any, setting: dict[str, str]) -> Iterator[Served]:
    """The server on host ``a`` with the data-plane ``setting``; stopped on exit."""
    argv = [sys.executable, "-c", SERVE, network.address("a")]
    process = network.popen(
        "a",
        argv,
        env=_environment(**setting),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    line = process.stdout.readline().decode()
    served = Served(json.loads(line) if line else [])
    try:
        yield served
    finally:
        process.stdin.close()  # its cue to stop (a refused server has ended already)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
        served.said = process.stderr.read().decode()  # a few lines: the pipe never filled


def _call(network: Any, endpoint: list[Any], setting: dict[str, str]) -> dict[str, Any]:
    done = network.run(
        "b", [sys.executable, "-c", CALL, json.dumps(endpoint)], env=_environment(**setting)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@needs_namespaces
def test_on_a_network_address_plaintext_is_refused_naming_the_address_and_the_ways_out(
    network: Any,
) -> None:
    address = network.address("a")
    with serving(network, {}) as served:
        assert served.endpoint == [], f"it listened on {address} in plaintext: {served.endpoint}"
    assert f"{TLS_CERT_ENV}: the data plane would listen on {address}, beyond loopback" in (
        served.said
    )
    assert f"{INSECURE_ENV}=1" in served.said and TLS_CA_ENV in served.said


@needs_namespaces
def test_on_a_network_address_tls_serves_and_a_client_on_another_host_round_trips(
    network: Any, data_plane_pki: dict[str, str]
) -> None:
    with serving(network, data_plane_pki) as served:
        assert served.endpoint[:1] == [network.address("a")], served
        assert served.endpoint[3] is True
        # The client has the CA only, as a process that dials and does not serve.
        result = _call(network, served.endpoint, {TLS_CA_ENV: data_plane_pki[TLS_CA_ENV]})
    assert result["answer"] == 42 and result["tls"] is True
    assert result["plaintext"] == "TimeoutError"  # a plaintext dial gets no challenge
    assert "plaintext" not in served.said  # nothing to warn of


@needs_namespaces
def test_on_a_network_address_the_insecure_setting_serves_plaintext_and_warns(
    network: Any,
) -> None:
    with serving(network, {INSECURE_ENV: "1"}) as served:
        assert served.endpoint[:1] == [network.address("a")], served
        assert served.endpoint[3] is False
        result = _call(network, served.endpoint, {})
    assert result == {"answer": 42, "tls": False, "plaintext": "served"}
    assert f"fastcall: serving {network.address('a')} in plaintext (insecure)" in served.said


@needs_namespaces
def test_the_testbeds_own_certificate_serves_its_data_plane_between_hosts(
    network: Any, tmp_path: Path
) -> None:
    # What a testbed hands every process (``Testbed.fastcall_env``), made as ``Testbed.up``
    # makes it: one self-signed certificate for every host's address, its own CA.
    from kvstore.testbed import testbed as testbed_module
    from kvstore.testbed.rundir import make_run_dir

    run_dir = make_run_dir(tmp_path, "kvtbcert")
    testbed_module._data_plane_certificate(run_dir, [network.address(h) for h in network.hosts])
    ray: Any = None  # not started: only the data plane's setting is used
    bed = testbed_module.Testbed(testbed_module.TestbedConfig(), network, ray, run_dir)
    setting = bed.fastcall_env()
    assert set(setting) == {TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV}
    with serving(network, setting) as served:
        assert served.endpoint[:1] == [network.address("a")], served
        result = _call(network, served.endpoint, setting)
    assert result["answer"] == 42 and result["tls"] is True
