"""Running an ASGI app (the OpenAI front end) with uvicorn inside an existing event loop,
behind a door that bounds what a client sends (``http_door``) and a guard that cuts off
clients that stop reading."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import uvicorn

from kvmesh.serving.background import until_next_tick
from kvmesh.serving.connections import ClientStalled, ConnectionLimits, WriteDeadline
from kvmesh.serving.grpc_server import ListenError, check_free
from kvmesh.serving.http_door import BoundedHttpProtocol
from kvmesh.serving.tls import TLSConfig


@dataclass
class HttpServer:
    server: SecondTickServer
    task: asyncio.Task
    port: int

    async def stop(self, grace: float = 30.0) -> None:
        """Stop accepting, give open responses ``grace`` seconds to finish, then close them."""
        self.server.exit_now()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), grace)
        except TimeoutError:
            self.server.force_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def start_http_server(
    app,
    host: str,
    port: int,
    tls: TLSConfig | None = None,
    limits: ConnectionLimits | None = None,
) -> HttpServer:
    """Serve ``app`` on ``host:port`` (0: any free port; HTTPS when ``tls`` has a cert, with
    client certificates required under ``tls.client_auth``). What a client sends is bounded
    by the HTTP bounds of ``limits`` (default: ``ConnectionLimits()``) in
    ``BoundedHttpProtocol``; a client that does not take a part of a response for its
    ``stream_write_timeout_s`` is disconnected (``StalledClientGuard``). No WebSocket: no
    kvmesh route takes one, so an upgrade is an ordinary request within the same bounds."""
    limits = limits or ConnectionLimits()
    mtls = bool(tls and tls.cert and tls.client_auth)
    config = uvicorn.Config(
        StalledClientGuard(app, limits.stream_write_timeout_s),
        host=host,
        port=port,
        http=functools.partial(BoundedHttpProtocol, limits=limits),
        ws="none",
        timeout_keep_alive=limits.http_idle_timeout_s,
        log_level="warning",
        lifespan="off",
        ssl_certfile=tls.cert if tls else None,
        ssl_keyfile=tls.key if tls else None,
        ssl_ca_certs=tls.ca if mtls else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if mtls else ssl.CERT_NONE,
        timeout_graceful_shutdown=30,
    )
    sock = _bind(host, port)  # here, not in uvicorn: it would sys.exit() when the port is taken
    server = SecondTickServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"kvmesh-http-{port}")
    while not server.started:
        if task.done():
            task.result()  # re-raise why it could not start
            raise ListenError(f"HTTP server on {host}:{port} did not start")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, sock.getsockname()[1])


class SecondTickServer(uvicorn.Server):
    """uvicorn's server with its tick once a second instead of ten times. The tick only
    refreshes the Date header (whole seconds) and checks whether to exit, and at 10 Hz those wake-ups were a large share of
    an idle router's CPU (docs/benchmarks.md, the router's CPU).
    Exiting does not wait for the tick: ``exit_now`` (and a signal uvicorn caught) wakes it."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self._wake = asyncio.Event()

    async def main_loop(self) -> None:
        while not await self.on_tick(0):  # a counter of 0 mod 10: every tick refreshes the Date header
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(until_next_tick(1.0)):
                    await self._wake.wait()

    def exit_now(self) -> None:
        self.should_exit = True
        self._wake.set()

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        with contextlib.suppress(RuntimeError):  # no loop running: nothing to wake
            asyncio.get_running_loop().call_soon_threadsafe(self._wake.set)


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


class StalledClientGuard:
    """Disconnects a client that does not take a part of its response within the write
    timeout. Its response is then cancelled like any other whose client went away (the
    request is aborted, its slot and KV blocks freed) instead of waiting on the client for
    as long as the client likes; a client that stops reading fills the transport's buffers,
    after which every write waits.

    It also offers a streamed response its connection's ``DirectBody`` (the scope's
    ``DIRECT_BODY`` key), under the same write timeout."""

    def __init__(self, app, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        deadline = WriteDeadline(self.timeout_s)

        async def within(sending: Awaitable[None]) -> None:
            try:
                await deadline.write(sending)
            except TimeoutError:
                _close_connection(send)
                raise ClientStalled(
                    f"the client did not read the response for {self.timeout_s:g} s"
                ) from None

        async def send_within(message) -> None:
            await within(send(message))

        scope[DIRECT_BODY] = lambda: DirectBody.of(send, within)
        try:
            await self.app(scope, receive, send_within)
        except ClientStalled:
            await asyncio.sleep(0)  # the server learns of the closed connection: no error logged
        finally:
            deadline.close()


# The scope key of a callable that returns the response's DirectBody, or None where the
# server gives no direct access (another ASGI server, an in-process test client).
DIRECT_BODY = "kvmesh.direct_body"


class DirectBody:
    """A streamed response's chunks written straight to its connection, one
    ``transport.write`` each, once its headers went out chunked through the ASGI ``send``
    (which ends the response too). Why: an ASGI send passes each chunk through every
    middleware's wrapper (Starlette's error and exception handlers, this module's guard)
    and uvicorn's checks, which cost a relayed token more than the relay's own work.
    Built on uvicorn's httptools protocol (its request cycle's transport, flow control and
    chunked state); ``of`` returns None wherever that is not what serves the request."""

    def __init__(self, cycle, within: Callable[[Awaitable[None]], Awaitable[None]]):
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow
        self._within = within

    @classmethod
    def of(cls, send, within: Callable[[Awaitable[None]], Awaitable[None]]) -> DirectBody | None:
        cycle = getattr(send, "__self__", None)
        if not all(hasattr(cycle, name) for name in ("transport", "flow", "disconnected")):
            return None
        if getattr(cycle, "chunked_encoding", None) is not True or not getattr(
            cycle, "response_started", False
        ):
            return None
        return cls(cycle, within)

    async def write(self, data: bytes) -> None:
        """Write one chunk; wait (within the write timeout) while the client's buffers are full."""
        if self.write_now(data):
            await self.drain()

    def write_now(self, data: bytes) -> bool:
        """Write one chunk without waiting (a relay splices into this from its own protocol's
        callbacks); True when the client's buffers are now full: ``drain`` before the next."""
        if self._cycle.disconnected:
            return False  # as uvicorn's send does: whoever watches for the disconnect ends the stream
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return self._flow.write_paused

    async def drain(self) -> None:
        """Until the client took enough of what was written (ClientStalled past the write timeout)."""
        if self._flow.write_paused:
            await self._within(self._flow.drain())


def _close_connection(send) -> None:
    """Drop the connection under uvicorn's ``send`` at once, unsent bytes and all (a close
    would wait for them); another server gets the ClientStalled and does what it does."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is not None:
        transport.abort()
