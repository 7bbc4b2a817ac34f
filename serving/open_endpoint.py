"""A tiny plain-HTTP server for what scrapers and probes read (``/metrics``, ``/health``).

It needs no token and no TLS, so a Prometheus scraper or a kubelet probe never holds the
inference credential; it answers only the GET routes it was given, one request per
connection, and keeps nothing a client sends (a request head over 64 KiB, or slower than
10 s, is dropped)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

# A route: () -> (HTTP status, content type, body).
Route = Callable[[], Awaitable[tuple[int, str, bytes]]]
_REASONS = {200: b"OK", 404: b"Not Found", 503: b"Service Unavailable"}
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def start_open_endpoint(host: str, port: int, routes: dict[str, Route]) -> asyncio.Server:
    """Serve ``routes`` (path -> Route) on ``host:port``; OSError when the port is taken."""
    encoded = {path.encode(): route for path, route in routes.items()}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            parts = head.split(b" ", 2)
            route = encoded.get(parts[1].split(b"?")[0]) if len(parts) == 3 and parts[0] == b"GET" else None
            if route is None:
                status, kind, body = 404, "text/plain", f"only {', '.join(sorted(routes))} here\n".encode()
            else:
                status, kind, body = await route()
            writer.write(
                b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                % (status, _REASONS.get(status, b""), kind.encode(), len(body))
                + body
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(serve, host, port)
