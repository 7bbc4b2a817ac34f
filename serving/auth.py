"""A bearer token on the router: checked in constant time before any work is done."""

from __future__ import annotations

import hmac

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # probes need no token


def token_matches(header: str | None, token: str) -> bool:
    """Constant-time check of an ``authorization`` value against ``Bearer <token>``."""
    return hmac.compare_digest((header or "").encode(), f"Bearer {token}".encode())


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` with UNAUTHENTICATED before
    the handler runs (health checks stay open for probes)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the auth token must not be empty")
        self._token = token

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if token_matches(metadata.get("authorization"), self._token):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises; this makes it a generator

    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    return grpc.stream_stream_rpc_method_handler(streaming, **codec)
