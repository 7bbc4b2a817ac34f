"""Running an ASGI app (the OpenAI front end) with uvicorn inside an existing event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from dataclasses import dataclass

import uvicorn

from kvmesh.serving.grpc_server import ListenError, check_free
from kvmesh.serving.tls import TLSConfig


@dataclass
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task
    port: int

    async def stop(self, grace: float = 30.0) -> None:
        """Stop accepting, give open responses ``grace`` seconds to finish, then close them."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), grace)
        except TimeoutError:
            self.server.force_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def start_http_server(app, host: str, port: int, tls: TLSConfig | None = None) -> HttpServer:
    """Serve ``app`` on ``host:port`` (0: any free port; HTTPS when ``tls`` has a cert, with
    client certificates required under ``tls.client_auth``)."""
    mtls = bool(tls and tls.cert and tls.client_auth)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        ssl_certfile=tls.cert if tls else None,
        ssl_keyfile=tls.key if tls else None,
        ssl_ca_certs=tls.ca if mtls else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if mtls else ssl.CERT_NONE,
        timeout_graceful_shutdown=30,
    )
    sock = _bind(host, port)  # here, not in uvicorn: it would sys.exit() when the port is taken
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"kvmesh-http-{port}")
    while not server.started:
        if task.done():
            task.result()  # re-raise why it could not start
            raise ListenError(f"HTTP server on {host}:{port} did not start")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, sock.getsockname()[1])


def _bind(host: str, port: int) -> socket.socket:
    check_free(host, port, "HTTP")
    # IPPROTO_TCP, not 0: asyncio turns Nagle off only on sockets that say they are TCP, and
    # with Nagle on, a response written in two parts waits out the client's delayed ACK (40 ms).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
