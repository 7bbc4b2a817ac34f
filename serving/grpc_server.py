"""A grpc.aio server with the standard extras: health (grpc.health.v1) and reflection; a
request that does not decode is INVALID_ARGUMENT (``grpc_decode``)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.serving.connections import ConnectionLimits
from kvmesh.serving.grpc_decode import GuardedRegistrar
from kvmesh.serving.tls import TLSConfig

MAX_MESSAGE_BYTES = 64 << 20


class ListenError(OSError):
    """A server could not listen where it was told to (the port is taken, the address is wrong)."""


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def check_free(host: str, port: int, what: str) -> None:
    """ListenError naming the address when ``host:port`` cannot be bound now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ListenError(f"cannot listen on {host}:{port} for {what} ({exc.strerror})") from None


@dataclass
class GrpcServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: list[str]
    serving: bool | None = None  # what set_serving last set (None: nothing yet)

    async def set_serving(self, serving: bool) -> None:
        """Readiness of the named services ("" stays SERVING while the process runs: liveness).
        Set only when it changes: a router calls this after every read of its replicas."""
        if serving == self.serving:
            return
        self.serving = serving
        status = SERVING if serving else NOT_SERVING
        for name in self.service_names:
            await self.health.set(name, status)

    async def stop(self, grace: float | None) -> None:
        """Drain: everything NOT_SERVING, in-flight calls get ``grace`` seconds."""
        await self.set_serving(False)
        await self.health.set("", NOT_SERVING)
        await self.server.stop(grace)


async def start_grpc_server(
    services: Sequence[tuple[Callable[[object, grpc.aio.Server], None], object, str]],
    host: str,
    port: int,
    serving: bool = True,
    tls: TLSConfig | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    connections: ConnectionLimits | None = None,
) -> GrpcServer:
    """Serve ``(add_XServicer_to_server, servicer, full service name)`` triples on host:port
    (0: any), over TLS when ``tls`` has a certificate. Larger messages: RESOURCE_EXHAUSTED.
    ``connections``: streams per connection and the keepalive policy. grpc's overload
    protection stays on (part of its defence against floods of reset streams): it counts the
    streams of calls that ended but that Python has not freed yet, so a burst near the bound
    can have calls refused (UNAVAILABLE, REFUSED_STREAM: never processed, safe to retry)."""
    if port:
        check_free(host, port, "gRPC")  # a clear message, before grpc logs its own
    server = grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),  # else a second server on a taken port silently shares it
            *(connections or ConnectionLimits()).grpc_options(),
        ],
    )
    names = []
    registrar = GuardedRegistrar(server)
    for add, servicer, name in services:
        add(servicer, registrar)
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    creds = tls.server_credentials() if tls else None
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ListenError(f"cannot listen on {host}:{port} for gRPC (is the port in use?)")
    await server.start()
    result = GrpcServer(server=server, port=bound, health=health_servicer, service_names=names)
    await result.set_serving(serving)
    return result
