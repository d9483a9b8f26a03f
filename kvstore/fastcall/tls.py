"""TLS around the direct sockets: the operator's setting, where plaintext may listen, the
contexts, the bounded handshake.

TLS wraps the socket before the key challenge, for calls between machines: without it, a machine
in the path could read or alter the frames of a connection after its handshake, and those
frames carry every tenant's KV. On loopback it buys nothing, so there it is off unless set;
beyond loopback a server refuses plaintext (``check_plaintext``) unless the operator says
insecure, as the gateway does. An operator sets both through the environment, the same in every
process of the cluster: ``FastcallConfig`` is read by the one environment loader
(``kvstore.envconfig``) from ``KVSTORE_FASTCALL_TLS_<FIELD>`` (``TLSConfig``) and
``KVSTORE_FASTCALL_INSECURE``; ``tls_from_env`` gives a process's two sides (``ServerTLS``,
``ClientTLS``), and deploy hands the setting on to the actors it starts (``tls_env_options``).
"""

from __future__ import annotations

import functools
import ipaddress
import os
import select
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
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
#: The whole data-plane setting: ``<prefix>TLS_<FIELD>`` and ``<prefix>INSECURE``.
FASTCALL_ENV_PREFIX = "KVSTORE_FASTCALL_"
#: The operator's word that servers may listen beyond loopback in plaintext (``kvstore up
#: --insecure`` sets it).
INSECURE_ENV = FASTCALL_ENV_PREFIX + "INSECURE"


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


@dataclass(frozen=True)
class FastcallConfig:
    """The operator's data-plane setting, read whole by the one environment loader: ``tls``
    from ``KVSTORE_FASTCALL_TLS_<FIELD>`` (``TLSConfig``), ``insecure`` from
    ``KVSTORE_FASTCALL_INSECURE`` (servers may listen beyond loopback without TLS:
    ``check_plaintext``)."""

    tls: TLSConfig = field(default_factory=TLSConfig)
    insecure: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FastcallConfig:
        """Read the ``KVSTORE_FASTCALL_*`` variables (an empty value counts as unset)."""
        return envconfig.from_env(cls, FASTCALL_ENV_PREFIX, environ)

    def env_vars(self) -> dict[str, str]:
        """The variables that make this setting (the ones set), to hand on to another process."""
        return {**self.tls.env_vars(), **({INSECURE_ENV: "1"} if self.insecure else {})}


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only: an IP address in
    127.0.0.0/8 or ``::1`` (IPv4-mapped ``::ffff:127.x`` too). A name is not resolved and counts
    as beyond loopback: it could resolve to another interface, or differently tomorrow, and the
    servers are handed IP addresses (their Ray node's). The wildcards (``""``, ``0.0.0.0``,
    ``::``) listen on every interface: beyond loopback."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_plaintext(host: str, tls: bool, insecure: bool) -> bool:
    """Whether a server may listen on ``host`` (with ``tls`` or without): raises ``ConfigError``
    when it would serve plaintext beyond loopback and the operator did not say ``insecure``;
    True when it serves plaintext beyond loopback because they did (warn), False otherwise.
    Its socket calls carry every tenant's KV: in the clear on a network, anyone in the path
    reads them and can alter them after the key challenge."""
    if tls or is_loopback(host):
        return False
    if insecure:
        return True
    raise ConfigError(
        TLS_CERT_ENV,
        f"the data plane would listen on {host}, beyond loopback, in plaintext: every tenant's "
        f"KV would cross the network in the clear. Set {TLS_CERT_ENV}, {TLS_KEY_ENV} and "
        f"{TLS_CA_ENV} (TLS, in every process of the cluster: docs/security.md), or "
        f"{INSECURE_ENV}=1 (`kvstore up --insecure`) to serve plaintext anyway",
    )


def tls_from_env(
    environ: Mapping[str, str] | None = None, *, serving: bool = False
) -> tuple[ServerTLS | None, ClientTLS | None]:
    """The fastcall TLS setting of this process (``environ``: ``os.environ`` when None):
    ``(server, client)``, checked whole (``TLSConfig``, ``TLSConfig.sides``)."""
    return FastcallConfig.from_env(environ).tls.sides(serving=serving)


def tls_env_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Actor options handing this process's data-plane setting (TLS, insecure) on to an actor
    it starts (``{}`` when none is set). A Ray worker is started by its node's raylet, with the
    raylet's environment, not the deploying process's. The TLS setting is checked here as for
    a server (the actors serve), so a bad one fails the deploy instead of every actor's
    start."""
    config = FastcallConfig.from_env(environ)
    config.tls.sides(serving=True)
    env_vars = config.env_vars()
    return {"runtime_env": {"env_vars": env_vars}} if env_vars else {}
