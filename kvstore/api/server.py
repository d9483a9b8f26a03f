"""The kvstore gRPC gateway: a ``grpc.aio`` server with auth, TLS, limits, health and reflection.

``create_server(tier, ServerOptions(...)) -> (server, port)``: binds 127.0.0.1 unless told
otherwise; port 0 picks a free port (tests). The standard ``grpc.health.v1.Health`` service and
server reflection are registered so ``grpcurl`` works against it.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.api.metrics import ApiMetrics
from kvstore.api.servicer import KVStoreServicer
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.errors import ConfigError
from kvstore.tier.protocols import Tier

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None  # bearer token; None = no auth
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_in_flight: int = 256  # beyond this, RESOURCE_EXHAUSTED
    worker_threads: int = 16

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in [0, 65535], got {self.port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert", "--tls-cert and --tls-key must be given together")
        if self.token is not None and not self.token:
            raise ConfigError("token", "the token file is empty")
        if self.max_message_bytes < 1024:
            raise ConfigError("max_message_bytes", f"must be ≥ 1024, got {self.max_message_bytes}")
        if self.max_in_flight < 1 or self.worker_threads < 1:
            raise ConfigError("max_in_flight", "max_in_flight and worker_threads must be ≥ 1")


def read_token_file(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as error:
        raise ConfigError("token_file", f"cannot read {path}: {error.strerror}") from error
    if not token:
        raise ConfigError("token_file", f"{path} is empty")
    return token


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` (health checks stay open)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith("/grpc.health.v1.Health/"):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given_bytes, self._expected):
            return await continuation(handler_call_details)
        return _deny(method, "missing bearer token" if not given else "wrong bearer token")


def _deny(method: str, message: str) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{message} for {method}")

    async def stream_out(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{message} for {method}")
        yield  # pragma: no cover  (makes this an async generator)

    if method.endswith("/GetBlocks"):
        return grpc.unary_stream_rpc_method_handler(stream_out)
    if method.endswith("/PutBlocks"):
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.unary_unary_rpc_method_handler(unary)


class MalformedRequest:
    """What a request that is not a decodable protobuf message becomes (instead of the UNKNOWN
    status grpc would answer before any kvstore code runs)."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.message_type = message_type
        self.error = error

    def describe(self) -> str:
        return f"request: not a valid {self.message_type} message ({self.error})"


def _safe_parser(message_class: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
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
    with parsers that turn undecodable bytes into INVALID_ARGUMENT naming the message type."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["KVStore"].methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        implementation = getattr(servicer, method.name)
        options = {
            "request_deserializer": _safe_parser(request_class),
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
    tier: Tier, options: ServerOptions, metrics: ApiMetrics | None = None
) -> tuple[grpc.aio.Server, int, ThreadPoolExecutor]:
    """Build and start the server; returns it, the bound port and its worker pool."""
    interceptors = [BearerTokenInterceptor(options.token)] if options.token else []
    message_options = [
        ("grpc.max_receive_message_length", options.max_message_bytes),
        ("grpc.max_send_message_length", options.max_message_bytes),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=message_options)
    executor = ThreadPoolExecutor(options.worker_threads, thread_name_prefix="kvstore-rpc")
    servicer = KVStoreServicer(tier, executor, options.max_in_flight, metrics)
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
        credentials = grpc.ssl_server_credentials(
            [(options.tls_key.read_bytes(), options.tls_cert.read_bytes())]
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
