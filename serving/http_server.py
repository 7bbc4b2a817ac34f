"""Running an ASGI app (the OpenAI front end) with uvicorn inside an existing event loop."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass

import uvicorn

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
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(), name=f"kvmesh-http-{port}")
    while not server.started:
        if task.done():
            task.result()  # re-raise why it could not start
            raise OSError(f"HTTP server on port {port} did not start")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, server.servers[0].sockets[0].getsockname()[1])
