"""Who is calling the gateway: the tenant a request acts for (docs/rules.md §10).

An identity is a bearer token (``authorization: Bearer <token>``) that the tokens file maps to a
tenant, or — with mutual TLS on — the common name of the verified client certificate. A gateway
with neither tokens nor client certificates (loopback, one user) serves everyone as the default
tenant. Exactly one ``authorization`` header is accepted: with two, which one a proxy checked and
which one the server read could differ, so the request is refused.

``AuthInterceptor`` refuses unauthenticated calls before any handler runs (server reflection
included; health checks stay open so a load balancer can probe); ``Authenticator.tenant`` is
what the servicer asks per request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from kvstore.errors import Unauthenticated
from kvstore.tenants import Tenant, TenantDirectory

_HEALTH = "/grpc.health.v1.Health/"
_BEARER = "bearer "


class Authenticator:
    def __init__(self, directory: TenantDirectory, *, client_certificates: bool = False) -> None:
        self.directory = directory
        self.client_certificates = client_certificates

    @property
    def open(self) -> bool:
        """No identity needed: every caller is the default tenant."""
        return not self.directory.requires_identity and not self.client_certificates

    def tenant(self, metadata: Iterable[tuple[str, Any]], auth_context: Any = None) -> Tenant:
        """The tenant of a request, from its metadata and (mTLS) its peer's certificate.
        Raises ``Unauthenticated`` naming what is missing or wrong."""
        token = bearer_token(metadata)
        if token is not None:
            tenant = self.directory.by_token(token)
            if tenant is None:
                raise Unauthenticated("wrong bearer token")
            return tenant
        if self.client_certificates:
            subject = certificate_subject(auth_context)
            if subject is None:
                raise Unauthenticated("no client certificate common name")
            tenant = self.directory.by_subject(subject)
            if tenant is None:
                raise Unauthenticated(f"client certificate {subject!r} is no tenant's")
            return tenant
        if self.directory.requires_identity:
            raise Unauthenticated("missing bearer token")
        return self.directory.default()


def bearer_token(metadata: Iterable[tuple[str, Any]]) -> bytes | None:
    """The token of the one ``authorization: Bearer`` header (None: no header). Two headers,
    or one that is not a bearer token, are refused."""
    values = [value for key, value in metadata if key == "authorization"]
    if not values:
        return None
    if len(values) > 1:
        raise Unauthenticated(f"{len(values)} authorization headers; give exactly one")
    raw = values[0]
    text = raw if isinstance(raw, str) else bytes(raw).decode("latin-1")
    if not text.lower().startswith(_BEARER):
        raise Unauthenticated("the authorization header is not 'Bearer <token>'")
    return text[len(_BEARER) :].strip().encode("latin-1")


def certificate_subject(auth_context: Any) -> str | None:
    if not auth_context:
        return None
    names = auth_context.get("x509_common_name") or []
    return bytes(names[0]).decode(errors="replace") if names else None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call whose bearer token is missing, wrong or given twice, before any handler
    (and server reflection) runs. With client certificates on, a call without a token is let
    through: TLS has verified its certificate and the servicer maps it to a tenant."""

    def __init__(self, authenticator: Authenticator) -> None:
        self._auth = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith(_HEALTH) or self._auth.open:
            return await continuation(handler_call_details)
        metadata = list(handler_call_details.invocation_metadata or ())
        try:
            token = bearer_token(metadata)
            if token is None and not self._auth.client_certificates:
                raise Unauthenticated("missing bearer token")
            if token is not None and self._auth.directory.by_token(token) is None:
                raise Unauthenticated("wrong bearer token")
        except Unauthenticated as error:
            return _deny(method, str(error))
        return await continuation(handler_call_details)


def _deny(method: str, message: str) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{message} for {method}")

    async def stream_out(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{message} for {method}")
        yield  # pragma: no cover  (makes this an async generator)

    async def both_streams(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{message} for {method}")
        yield  # pragma: no cover

    if method.endswith("/ServerReflectionInfo"):
        return grpc.stream_stream_rpc_method_handler(both_streams)
    if method.endswith("/GetBlocks"):
        return grpc.unary_stream_rpc_method_handler(stream_out)
    if method.endswith("/PutBlocks"):
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.unary_unary_rpc_method_handler(unary)
