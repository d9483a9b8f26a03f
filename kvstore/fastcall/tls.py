"""TLS around the direct sockets: the operator's setting, its contexts, the bounded handshake.

TLS (off by default: on loopback it buys nothing) wraps the socket before the key challenge,
for calls between machines: without it, a machine in the path could still read or alter the
frames of a connection after its handshake. An operator turns it on through the environment,
the same in every process of the cluster: ``TLSConfig`` is read by the one environment loader
(``kvstore.envconfig``) from ``KVSTORE_FASTCALL_TLS_<FIELD>``; ``tls_from_env`` gives a
process's two sides (``ServerTLS``, ``ClientTLS``), and deploy hands the setting on to the
actors it starts (``tls_env_options``).
"""

from __future__ import annotations

import functools
import os
import select
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore import envconfig
from kvstore.errors import ConfigError

#: The operator's TLS setting (PEM file paths), read by every process that serves or dials.
TLS_ENV_PREFIX = "KVSTORE_FASTCALL_TLS_"
TLS_CERT_ENV = TLS_ENV_PREFIX + "CERT"
TLS_KEY_ENV = TLS_ENV_PREFIX + "KEY"
TLS_CA_ENV = TLS_ENV_PREFIX + "CA"
TLS_SERVER_NAME_ENV = TLS_ENV_PREFIX + "SERVER_NAME"
TLS_ENV = (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV, TLS_SERVER_NAME_ENV)


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate chain and private key (PEM files)."""

    certfile: str
    keyfile: str

    def context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.certfile, self.keyfile)
        return context


@dataclass(frozen=True)
class ClientTLS:
    """The CA (PEM file) a server's certificate must chain to. ``server_name``: the name the
    certificate must carry too; None checks the chain alone (a cluster CA that signs only the
    cluster's servers; the key challenge inside still proves the actor)."""

    cafile: str
    server_name: str | None = None


@functools.lru_cache(maxsize=8)
def client_context(tls: ClientTLS) -> ssl.SSLContext:
    """Made once per setting: loading a CA file costs more than a loopback call."""
    context = ssl.create_default_context(cafile=tls.cafile)
    context.check_hostname = tls.server_name is not None
    return context


def tls_handshake(sock: ssl.SSLSocket, deadline: float) -> None:
    """The TLS handshake, done by ``deadline`` however slowly the peer sends (a socket timeout
    would bound each wait, not the whole)."""
    sock.setblocking(False)
    poller = select.poll()
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            poller.register(sock, select.POLLIN)
        except ssl.SSLWantWriteError:
            poller.register(sock, select.POLLOUT)
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError("fastcall: the TLS handshake took too long")
        poller.unregister(sock)


@dataclass(frozen=True)
class TLSConfig:
    """The fastcall TLS setting: PEM file paths and the name a server's certificate must carry
    (``""``: unset), each set by ``KVSTORE_FASTCALL_TLS_<FIELD>``. The cluster's processes dial
    each other, so a setting is whole or refused (``ConfigError`` naming the variable): a
    certificate needs its key and a CA (clients must trust the servers), a server name needs
    the CA, every file must exist (and load: ``sides``). A CA alone is a client-only process
    (the gateway needs no key)."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    server_name: str = ""

    def __post_init__(self) -> None:
        files = ((TLS_CERT_ENV, self.cert), (TLS_KEY_ENV, self.key), (TLS_CA_ENV, self.ca))
        for name, path in files:
            if path and not os.path.isfile(path):
                raise ConfigError(name, f"{path}: no such file")
        if bool(self.cert) != bool(self.key):
            missing, given = (
                (TLS_KEY_ENV, TLS_CERT_ENV) if not self.key else (TLS_CERT_ENV, TLS_KEY_ENV)
            )
            raise ConfigError(missing, f"must be set with {given} (a certificate and its key)")
        if not self.ca and (self.cert or self.server_name):
            given = TLS_CERT_ENV if self.cert else TLS_SERVER_NAME_ENV
            raise ConfigError(
                TLS_CA_ENV, f"must be set with {given}: this cluster's clients dial TLS"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TLSConfig:
        """Read the ``KVSTORE_FASTCALL_TLS_*`` variables (an empty value counts as unset)."""
        return envconfig.from_env(cls, TLS_ENV_PREFIX, environ)

    def sides(self, *, serving: bool = False) -> tuple[ServerTLS | None, ClientTLS | None]:
        """``(server, client)``: ``(None, None)`` when nothing is set (plain sockets).
        ``serving``: this process starts a ``FastCallServer``, which must then have a
        certificate (its clients speak TLS to it). A PEM file that does not load is refused
        here, at start-up, not as a refused peer later."""
        if serving and self.ca and not self.cert:
            served = f"must be set with {TLS_CA_ENV} where fastcall is served (TLS clients)"
            raise ConfigError(TLS_CERT_ENV, served)
        server = ServerTLS(self.cert, self.key) if self.cert and self.key else None
        client = ClientTLS(self.ca, self.server_name or None) if self.ca else None
        try:
            if server is not None:
                server.context()
        except (ssl.SSLError, OSError) as error:
            raise ConfigError(
                TLS_CERT_ENV, f"{self.cert} with {TLS_KEY_ENV}={self.key}: {error}"
            ) from None
        try:
            if client is not None:
                client_context(client)
        except (ssl.SSLError, OSError) as error:
            raise ConfigError(TLS_CA_ENV, f"{self.ca}: {error}") from None
        return server, client

    def env_vars(self) -> dict[str, str]:
        """The variables that make this setting (the ones set), to hand on to another process."""
        values = (self.cert, self.key, self.ca, self.server_name)
        return {name: value for name, value in zip(TLS_ENV, values, strict=True) if value}


def tls_from_env(
    environ: Mapping[str, str] | None = None, *, serving: bool = False
) -> tuple[ServerTLS | None, ClientTLS | None]:
    """The fastcall TLS setting of this process (``environ``: ``os.environ`` when None):
    ``(server, client)``, checked whole (``TLSConfig``, ``TLSConfig.sides``)."""
    return TLSConfig.from_env(environ).sides(serving=serving)


def tls_env_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Actor options handing this process's TLS variables on to an actor it starts (``{}`` when
    none is set). A Ray worker is started by its node's raylet, with the raylet's environment,
    not the deploying process's. The setting is checked here as for a server (the actors serve),
    so a bad one fails the deploy instead of every actor's start."""
    config = TLSConfig.from_env(environ)
    config.sides(serving=True)
    env_vars = config.env_vars()
    return {"runtime_env": {"env_vars": env_vars}} if env_vars else {}
