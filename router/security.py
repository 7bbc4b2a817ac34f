"""TLS for every gRPC hop and a bearer token on the router, checked before any work.

One ``TLSConfig`` per process: ``cert``/``key`` are its identity (as a server, and as a
client toward replicas when they require client certificates); ``ca`` is the trust anchor
for peers: outbound connections verify servers with it, and with ``client_auth`` a server
accepts only clients whose certificate it signed (mTLS). Replicas are dialled by IP, so
outbound checks the certificate against ``server_name`` instead of the address.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # probes need no token


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the TLS {what} {path!r}: {exc.strerror}") from None


@dataclass(frozen=True)
class TLSConfig:
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    client_auth: bool = False  # servers require a client certificate signed by ``ca``
    server_name: str | None = None  # the name outbound connections expect in server certs

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("TLS needs both a certificate and its key")
        if self.client_auth and not self.ca:
            raise ValueError("client certificate checks (mTLS) need a CA to check them against")

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    @classmethod
    def from_env(cls) -> TLSConfig:
        env = os.environ.get
        return cls(
            cert=env("KVMESH_TLS_CERT") or None,
            key=env("KVMESH_TLS_KEY") or None,
            ca=env("KVMESH_TLS_CA") or None,
            client_auth=env("KVMESH_TLS_CLIENT_AUTH", "") in ("1", "true", "yes"),
            server_name=env("KVMESH_TLS_SERVER_NAME") or None,
        )

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.cert:
            return None
        pair = [(_read(self.key, "key"), _read(self.cert, "certificate"))]
        return grpc.ssl_server_credentials(
            pair,
            root_certificates=_read(self.ca, "CA") if self.client_auth else None,
            require_client_auth=self.client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.ca:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA"),
            private_key=_read(self.key, "key"),
            certificate_chain=_read(self.cert, "certificate"),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.ca and self.server_name else []


def open_channel(address: str, tls: TLSConfig | None, options: list | None = None) -> grpc.aio.Channel:
    """An asyncio channel, TLS when ``tls`` has a CA."""
    options = list(options or [])
    creds = tls.channel_credentials() if tls else None
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options + tls.channel_options())


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
