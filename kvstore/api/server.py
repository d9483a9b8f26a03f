"""The kvstore gRPC gateway: a ``grpc.aio`` server with auth, TLS, limits, health and reflection.

``create_server(tier, ServerOptions(...)) -> (server, port)``: binds 127.0.0.1 unless told
otherwise, and beyond loopback only with TLS and an identity (or ``insecure``); port 0 picks a
free port (tests). Each request is served by its tenant's view of the tier
(``kvstore.tier.tenancy``). The standard ``grpc.health.v1.Health`` service and
server reflection are registered so ``grpcurl`` works against it.
"""

from __future__ import annotations

import inspect
import ipaddress
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.api.auth import Authenticator, AuthInterceptor
from kvstore.api.metrics import ApiMetrics
from kvstore.api.servicer import GatewayLimits, KVStoreServicer
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.errors import ConfigError
from kvstore.privatefs import check_private_file
from kvstore.tenants import TenantDirectory, load_secret
from kvstore.tier.protocols import Tier
from kvstore.tier.tenancy import TenantViews

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: How far the transport reads one stream ahead of the servicer (HTTP/2 window): enough to keep
#: a put stream moving over a millisecond of round trip (1 GB/s), small enough that streams
#: waiting for the byte budget hold little.
RECEIVE_LOOKAHEAD_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None  # one bearer token for the default tenant; None = see tokens_file
    #: Tokens file (``kvstore.tenants``): token → tenant, reread when it changes.
    tokens_file: Path | None = None
    #: The server secret the tenants' salts come from (made 0600 if absent). None: a random
    #: one for this process only — every namespace changes at restart (tests).
    tenant_secret_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: CA that signs client certificates: with it, TLS is mutual and a certificate's common
    #: name is an identity (``subjects`` in the tokens file).
    tls_client_ca: Path | None = None
    #: Serve beyond loopback without TLS or without an identity (say so to mean it).
    insecure: bool = False
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_in_flight: int = 256  # beyond this, RESOURCE_EXHAUSTED
    worker_threads: int = 16
    limits: GatewayLimits = field(default_factory=GatewayLimits)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in [0, 65535], got {self.port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert", "--tls-cert and --tls-key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_client_ca", "client certificates need --tls-cert/--tls-key")
        if self.token is not None and not self.token:
            raise ConfigError("token", "the token file is empty")
        if self.token is not None and self.tokens_file is not None:
            raise ConfigError("token", "give --token-file or --tokens-file, not both")
        if self.max_message_bytes < 1024:
            raise ConfigError("max_message_bytes", f"must be ≥ 1024, got {self.max_message_bytes}")
        if self.max_in_flight < 1 or self.worker_threads < 1:
            raise ConfigError("max_in_flight", "max_in_flight and worker_threads must be ≥ 1")
        if not is_loopback(self.host) and not self.insecure:
            missing = []
            if self.tls_cert is None:
                missing.append("TLS (--tls-cert/--tls-key)")
            if self.token is None and self.tokens_file is None and self.tls_client_ca is None:
                missing.append("an identity (--tokens-file, --token-file or --tls-client-ca)")
            if missing:
                raise ConfigError(
                    "host",
                    f"{self.host} is reachable from other machines, so the gateway needs "
                    f"{' and '.join(missing)}: without them anyone on the network reads and "
                    "writes every tenant's KV in the clear. Give them, or --insecure to serve "
                    "so anyway",
                )

    def tenant_directory(self) -> TenantDirectory:
        """The identities this gateway accepts (and the secret their namespaces come from)."""
        if self.tenant_secret_file is not None:
            secret = load_secret(self.tenant_secret_file)
        else:
            secret = os.urandom(32)
        return TenantDirectory(secret, tokens_file=self.tokens_file, static_token=self.token)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token_file(path: Path) -> str:
    """The one bearer token in ``path``: a file readable by group or others is refused."""
    check_private_file(path, "token_file")
    try:
        token = path.read_text().strip()
    except OSError as error:
        raise ConfigError("token_file", f"cannot read {path}: {error.strerror}") from error
    if not token:
        raise ConfigError("token_file", f"{path} is empty")
    return token


class MalformedRequest:
    """What a request that is not a decodable protobuf message becomes (instead of the UNKNOWN
    status grpc would answer before any kvstore code runs)."""

    def __init__(self, message_type: str, error: Exception | str) -> None:
        self.message_type = message_type
        self.error = error

    def describe(self) -> str:
        return f"request: not a valid {self.message_type} message ({self.error})"


def _safe_parser(message_class: Any, max_bytes: int) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if len(data) > max_bytes:
            return MalformedRequest(
                message_class.DESCRIPTOR.full_name,
                f"{len(data)} bytes, more than any valid one holds ({max_bytes})",
            )
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return MalformedRequest(message_class.DESCRIPTOR.full_name, error)

    return parse


def _guard_unary(method: Any) -> Any:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        return await method(request, context)

    return call


def _guard_unary_stream(method: Any) -> Any:
    if inspect.iscoroutinefunction(method):
        # A handler that writes with ``context.write`` (GetBlocks: it notices stalled readers).
        async def written(request: Any, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, MalformedRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
            await method(request, context)

        return written

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        async for reply in method(request, context):
            yield reply

    return call


def _guard_stream_unary(method: Any) -> Any:
    async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async def checked() -> Any:
            async for request in requests:
                if isinstance(request, MalformedRequest):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
                yield request

        return await method(checked(), context)

    return call


def add_servicer(servicer: KVStoreServicer, server: grpc.aio.Server) -> None:
    """Register the KVStore methods like the generated ``add_KVStoreServicer_to_server``, but
    with parsers that turn undecodable bytes, or more bytes than any valid request of the method
    holds (``GatewayLimits.request_bytes``: not parsed at all), into INVALID_ARGUMENT naming the
    message type."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["KVStore"].methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        implementation = getattr(servicer, method.name)
        options = {
            "request_deserializer": _safe_parser(
                request_class, servicer.limits.request_bytes(method.name)
            ),
            "response_serializer": response_class.SerializeToString,
        }
        if method.client_streaming:
            handler = grpc.stream_unary_rpc_method_handler(
                _guard_stream_unary(implementation), **options
            )
        elif method.server_streaming:
            handler = grpc.unary_stream_rpc_method_handler(
                _guard_unary_stream(implementation), **options
            )
        else:
            handler = grpc.unary_unary_rpc_method_handler(_guard_unary(implementation), **options)
        handlers[method.name] = handler
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


async def create_server(
    tier: Tier,
    options: ServerOptions,
    metrics: ApiMetrics | None = None,
    directory: TenantDirectory | None = None,
) -> tuple[grpc.aio.Server, int, ThreadPoolExecutor]:
    """Build and start the server; returns it, the bound port and its worker pool.
    ``directory``: the identities (default: ``options.tenant_directory()``)."""
    authenticator = Authenticator(
        directory or options.tenant_directory(),
        client_certificates=options.tls_client_ca is not None,
    )
    # A PutBlocks stream reserves room for one message before it reads it: the server's own
    # message limit is that size.
    limits = replace(options.limits, message_bytes=options.max_message_bytes)
    channel_options = [
        ("grpc.max_receive_message_length", options.max_message_bytes),
        ("grpc.max_send_message_length", options.max_message_bytes),
        # A connection holds at most this many calls at once; idle ones are closed, and
        # every connection is cycled so none holds resources forever.
        ("grpc.max_concurrent_streams", limits.max_streams_per_connection),
        # The transport reads at most ``RECEIVE_LOOKAHEAD_BYTES`` of a stream ahead of the
        # servicer: with the window grown to the measured bandwidth-delay product it took
        # whole messages of streams the byte budget had not admitted yet (40 fat PutBlocks
        # streams: +790 MiB held in the transport, counted nowhere).
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", RECEIVE_LOOKAHEAD_BYTES),
        ("grpc.max_connection_idle_ms", int(limits.connection_idle_s * 1000)),
        ("grpc.max_connection_age_ms", int(limits.connection_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", int(limits.rpc_deadline_s * 1000)),
    ]
    server = grpc.aio.server(interceptors=[AuthInterceptor(authenticator)], options=channel_options)
    executor = ThreadPoolExecutor(options.worker_threads, thread_name_prefix="kvstore-rpc")
    views = TenantViews(tier)
    servicer = KVStoreServicer(
        views, authenticator, executor, options.max_in_flight, limits, metrics
    )
    add_servicer(servicer, server)

    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )

    address = f"{options.host}:{options.port}"
    if options.tls_cert is not None and options.tls_key is not None:
        client_ca = options.tls_client_ca
        credentials = grpc.ssl_server_credentials(
            [(Path(options.tls_key).read_bytes(), Path(options.tls_cert).read_bytes())],
            root_certificates=None if client_ca is None else Path(client_ca).read_bytes(),
            require_client_auth=client_ca is not None,
        )
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise ConfigError("port", f"cannot bind {address}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    return server, port, executor
