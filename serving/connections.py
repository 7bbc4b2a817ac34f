"""What a slow, stuck or vanished client may hold on a kvmesh server, bounded: a stream that
cannot deliver is aborted (its in-flight slot and KV blocks freed), a gRPC connection
carries a bounded number of streams, and one that stops answering pings is closed; an HTTP
port holds a bounded number of connections, each request head is bounded in size and time,
a request body in the time between its parts, and a connection with no request in time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from kvmesh.serving.options import option


@dataclass(frozen=True)
class ConnectionLimits:
    stream_write_timeout_s: float = option(
        30.0,
        flag="stream-write-timeout",
        help="seconds a response may wait on a client that does not read before its request is aborted",
    )
    grpc_max_streams: int = option(1024, help="concurrent streams on one gRPC connection")
    grpc_keepalive_s: float = option(
        30.0, flag="grpc-keepalive", help="seconds between the server's pings on a gRPC connection"
    )
    grpc_keepalive_timeout_s: float = option(
        10.0,
        flag="grpc-keepalive-timeout",
        help="seconds a gRPC client has to answer a ping before its connection and streams are dropped",
    )
    http_max_head_bytes: int = option(
        32 << 10, help="bytes of an HTTP request head (request line and headers); a longer one gets 431"
    )
    http_max_headers: int = option(100, help="header lines in an HTTP request head; more get 431")
    http_head_timeout_s: float = option(
        10.0,
        flag="http-head-timeout",
        help="seconds from an HTTP request head's first byte to its end; a slower one gets 408",
    )
    http_body_timeout_s: float = option(
        30.0,
        flag="http-body-timeout",
        help="seconds an HTTP request body may pause between its parts; past it, 408 (or the connection dropped)",
    )
    http_idle_timeout_s: float = option(
        5.0,
        flag="http-idle-timeout",
        help="seconds an HTTP connection may stay open with no request under way (a new one included)",
    )
    http_max_connections: int = option(
        2048, help="open connections on one HTTP port; one more gets 503 and is closed"
    )

    def __post_init__(self) -> None:
        for name in (
            "stream_write_timeout_s",
            "grpc_keepalive_s",
            "grpc_keepalive_timeout_s",
            "http_head_timeout_s",
            "http_body_timeout_s",
            "http_idle_timeout_s",
            "grpc_max_streams",
            "http_max_head_bytes",
            "http_max_headers",
            "http_max_connections",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def grpc_options(self) -> list[tuple[str, int]]:
        """Server options: the stream bound, the server's own pings (also on a stream that is
        quiet, however long), and what it accepts of a client's pings (one per 5 s at most;
        a client that pings faster is sent away after two strikes). The ping timeout is set
        with the keepalive timeout: gRPC otherwise waits its own 60 s for a ping's ack while
        the server is writing, so a vanished client kept its stream until flow control
        blocked a write."""
        return [
            ("grpc.max_concurrent_streams", self.grpc_max_streams),
            ("grpc.keepalive_time_ms", int(self.grpc_keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.grpc_keepalive_timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(self.grpc_keepalive_timeout_s * 1000)),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
            ("grpc.http2.max_ping_strikes", 2),
        ]


class WriteDeadline:
    """Every write of one response stream within ``timeout_s``, at the cost of a clock read
    per write: one timer per stream looks, each time a write in progress could have run out,
    whether it has, and cancels the writing task if so (``asyncio.timeout`` around each write
    made and cancelled a timer per streamed token, several times the cost of a clock read)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._writer: asyncio.Task | None = None
        self._started: float | None = None  # the write in progress began then (loop time)
        self._cancelling = 0
        self._expired = False
        self._timer = self._loop.call_later(timeout_s, self._check)

    def _check(self) -> None:
        now, started = self._loop.time(), self._started
        if started is not None and now - started >= self.timeout_s:
            self._expired = True
            self._writer.cancel()
            return
        self._timer = self._loop.call_later(
            self.timeout_s if started is None else started + self.timeout_s - now, self._check
        )

    async def write(self, sending: Awaitable[None]) -> None:
        """Await ``sending``; TimeoutError when it has not finished within the timeout."""
        self._writer = asyncio.current_task()
        self._cancelling = self._writer.cancelling()
        self._started = self._loop.time()
        try:
            await sending
        except asyncio.CancelledError:
            if self._expired and self._writer.uncancel() <= self._cancelling:
                raise TimeoutError from None
            raise
        finally:
            self._started = None

    def close(self) -> None:
        self._timer.cancel()


class ClientStalled(Exception):
    """The client did not take a response within the write timeout (its request is aborted)."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


async def send_all(
    context: grpc.aio.ServicerContext,
    responses: AsyncIterator,
    timeout_s: float,
    after_each: Callable[[], None] | None = None,
) -> None:
    """Write every response of a stream, each within ``timeout_s`` or ClientStalled (a client
    that stops reading fills the transport's buffers, then a write waits as long as it does);
    the stream is closed however this ends, so its request is aborted where it runs."""
    deadline = WriteDeadline(timeout_s)
    try:
        async with contextlib.aclosing(responses):
            async for response in responses:
                try:
                    await deadline.write(context.write(response))
                except TimeoutError:
                    raise ClientStalled(
                        f"request aborted: the client did not read the stream for {timeout_s:g} s"
                    ) from None
                if after_each is not None:
                    after_each()
    finally:
        deadline.close()


def end_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a streaming call with a status, without waiting on it (``abort`` waits for the
    status to be written, which behind a client that does not read is forever)."""
    context.set_code(code)
    context.set_details(details)
