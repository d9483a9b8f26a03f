"""fastcall TLS as an operator option: ``tls_from_env`` reads the KVSTORE_FASTCALL_TLS_*
variables, refuses half a setting naming the variable, and a whole one carries calls over TLS
(real sockets on 127.0.0.1, no Ray)."""

from __future__ import annotations

import ssl
import threading
from pathlib import Path

import pytest
from certs import self_signed

from kvstore.errors import ConfigError
from kvstore.fastcall.client import FastChannel, connect
from kvstore.fastcall.frames import wait_ready
from kvstore.fastcall.server import FastCallServer
from kvstore.fastcall.tls import (
    INSECURE_ENV,
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_ENV,
    TLS_KEY_ENV,
    TLS_SERVER_NAME_ENV,
    ClientTLS,
    ServerTLS,
    TLSConfig,
    tls_env_options,
    tls_from_env,
)
from kvstore.runtime.blockstore_actors import actor_options
from kvstore.runtime.fanout import RayFanout


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(certificate, key): self-signed, so the certificate is its own CA."""
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def full(pem: tuple[str, str]) -> dict[str, str]:
    cert, key = pem
    return {
        TLS_CERT_ENV: cert,
        TLS_KEY_ENV: key,
        TLS_CA_ENV: cert,
        TLS_SERVER_NAME_ENV: "localhost",
    }


def _refused(environ: dict[str, str], variable: str, serving: bool = False) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        tls_from_env(environ, serving=serving)
    assert caught.value.field == variable, caught.value
    assert variable in str(caught.value)
    return caught.value


def test_nothing_set_is_plaintext() -> None:
    assert tls_from_env({}) == (None, None)
    assert tls_from_env({}, serving=True) == (None, None)
    assert tls_from_env({name: "" for name in TLS_ENV}) == (None, None)  # empty: unset
    assert tls_env_options({}) == {}


def test_the_setting_is_a_frozen_config_read_by_the_one_environment_loader(
    full: dict[str, str], pem: tuple[str, str]
) -> None:
    cert, key = pem
    config = TLSConfig.from_env(full)
    assert config == TLSConfig(cert, key, cert, "localhost")
    assert config.env_vars() == full
    assert TLSConfig.from_env({}) == TLSConfig() and TLSConfig().env_vars() == {}
    with pytest.raises(AttributeError):
        config.cert = "elsewhere"  # type: ignore[misc]
    # Built in code, it is checked the same way and names the same variables.
    with pytest.raises(ConfigError) as caught:
        TLSConfig(cert=cert)
    assert caught.value.field == TLS_KEY_ENV


def test_a_whole_setting_reads_as_both_sides(full: dict[str, str], pem: tuple[str, str]) -> None:
    cert, key = pem
    assert tls_from_env(full, serving=True) == (ServerTLS(cert, key), ClientTLS(cert, "localhost"))
    del full[TLS_SERVER_NAME_ENV]
    assert tls_from_env(full) == (ServerTLS(cert, key), ClientTLS(cert, None))


def test_a_certificate_without_its_key_is_refused(full: dict[str, str]) -> None:
    _refused({k: v for k, v in full.items() if k != TLS_KEY_ENV}, TLS_KEY_ENV)
    _refused({k: v for k, v in full.items() if k != TLS_CERT_ENV}, TLS_CERT_ENV)


def test_a_server_setting_without_a_ca_for_clients_is_refused(full: dict[str, str]) -> None:
    _refused({k: v for k, v in full.items() if k != TLS_CA_ENV}, TLS_CA_ENV)
    _refused({TLS_SERVER_NAME_ENV: "localhost"}, TLS_CA_ENV)


def test_a_ca_alone_is_a_client_only_setting(pem: tuple[str, str]) -> None:
    cert, _ = pem
    assert tls_from_env({TLS_CA_ENV: cert}) == (None, ClientTLS(cert))
    # A process that serves would answer plaintext to clients that speak TLS.
    _refused({TLS_CA_ENV: cert}, TLS_CERT_ENV, serving=True)
    with pytest.raises(ConfigError, match=TLS_CERT_ENV):
        tls_env_options({TLS_CA_ENV: cert})  # deploy starts servers


@pytest.mark.parametrize("variable", [TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV])
def test_a_file_that_does_not_exist_is_refused(
    full: dict[str, str], variable: str, tmp_path: Path
) -> None:
    full[variable] = str(tmp_path / "missing.pem")
    assert "no such file" in str(_refused(full, variable))


@pytest.mark.parametrize("variable", [TLS_CERT_ENV, TLS_CA_ENV])
def test_a_file_that_is_not_pem_is_refused(
    full: dict[str, str], variable: str, tmp_path: Path
) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    full[variable] = str(junk)
    _refused(full, variable)


def test_a_whole_setting_round_trips_a_call_over_tls(full: dict[str, str]) -> None:
    server_tls, client_tls = tls_from_env(full, serving=True)
    lock = threading.Lock()

    class Target:
        def double(self, value: int) -> int:
            return 2 * value

    server = FastCallServer(Target(), ("double",), lock, tls=server_tls)
    try:
        channel = FastChannel(server.endpoint, tls=client_tls)
        conn = channel.start("double", (21,))
        assert wait_ready([conn], 10.0) == [conn]
        assert channel.finish(conn) == 42
        assert isinstance(channel._free[0]._sock, ssl.SSLSocket)
        channel.close()
        with pytest.raises(TimeoutError):  # plaintext: the challenge never comes in clear
            connect(server.endpoint, timeout_s=0.3)
    finally:
        server.close()


def test_the_setting_reaches_fanouts_and_actors(
    full: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (*TLS_ENV, INSECURE_ENV):
        monkeypatch.delenv(name, raising=False)
    assert RayFanout({})._fast._tls is None
    assert "runtime_env" not in actor_options("a")  # nothing set: nothing added
    for name, value in full.items():
        monkeypatch.setenv(name, value)
    assert RayFanout({})._fast._tls == ClientTLS(full[TLS_CA_ENV], "localhost")
    assert actor_options("a", num_cpus=1)["runtime_env"] == {"env_vars": full}
    assert tls_env_options(full) == {"runtime_env": {"env_vars": full}}
