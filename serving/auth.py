"""Bearer tokens on every kvmesh door (router and replicas): read from files, checked in
constant time before any work is done."""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # probes need no token


def read_token_file(path: str, flag: str) -> str:
    """The token in ``path`` (surrounding whitespace dropped); ValueError naming ``flag`` when
    the file cannot be read or is empty. Tokens live in files (a Secret volume), never in
    flags, the environment or ``ps``."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path!r} is not text") from None
    if not token:
        raise ValueError(f"{flag} {path!r} is empty")
    return token


def is_loopback_host(host: str) -> bool:
    """Whether only this machine can reach ``host`` (a name or address, no port)."""
    return host == "localhost" or host == "::1" or host.startswith("127.")


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata presenting ``token`` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


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
