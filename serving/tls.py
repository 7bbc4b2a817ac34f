"""TLS for every gRPC hop (and HTTPS): one ``TLSConfig`` per process.

One ``TLSConfig`` per process: ``cert``/``key`` are its identity (as a server, and as a
client toward replicas when they require client certificates); ``ca`` is the trust anchor
for peers: outbound connections verify servers with it, and with ``client_auth`` a server
accepts only clients whose certificate it signed (mTLS). Replicas are dialled by IP, so
outbound checks the certificate against ``server_name`` instead of the address.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvmesh.serving.options import option


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the TLS {what} {path!r}: {exc.strerror}") from None


@dataclass(frozen=True)
class TLSConfig:
    cert: str | None = option(None, flag="tls-cert", help="PEM certificate: serve gRPC/HTTP over TLS")
    key: str | None = option(None, flag="tls-key", help="its PEM private key")
    ca: str | None = option(
        None, flag="tls-ca", help="CA for peers: verify replicas, and clients with --tls-client-auth"
    )
    client_auth: bool = option(
        False, flag="tls-client-auth", help="mTLS: servers require a client certificate signed by the CA"
    )
    server_name: str | None = option(
        None, flag="tls-server-name", help="name expected in replica certificates (they are dialled by IP)"
    )

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("TLS needs both a certificate and its key")
        if self.client_auth and not self.ca:
            raise ValueError("client certificate checks (mTLS) need a CA to check them against")

    def check_files(self) -> None:
        """ValueError naming the first certificate, key or CA file that is not there."""
        for path in (self.cert, self.key, self.ca):
            if path and not Path(path).is_file():
                raise ValueError(f"TLS file {path!r} does not exist")

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

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

    def client_ssl_context(self) -> ssl.SSLContext | None:
        """For HTTPS to replicas (the router's relay): verified with the CA, this process's
        certificate presented for mTLS; None without a CA (nothing to verify them with)."""
        if not self.ca:
            return None
        context = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.ca and self.server_name else []


def open_channel(address: str, tls: TLSConfig | None, options: list | None = None) -> grpc.aio.Channel:
    """An asyncio channel, TLS when ``tls`` has a CA."""
    options = list(options or [])
    creds = tls.channel_credentials() if tls else None
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options + tls.channel_options())
