"""Keep-alive HTTP/1.1 connections from the router to one replica's OpenAI port, to relay its
SSE streams byte for byte.

Why not gRPC for HTTP clients: a streamed token read through gRPC's Python API costs the router
CPU in gRPC core's threads and the aio read path, and re-encoding it as SSE costs more; the replica already writes the exact SSE the client wants. Here a token costs one
``data_received`` parsed by httptools' C parser and one write. Only what the router needs is
read: the status, and (``relay.py``) the one trailer event the replica adds for it.

Once the client's response has begun, a connection can ``splice`` its events straight into
the client's connection from ``data_received``: no task wakes up per token, and the reader
hears only of the end, the trailer, or a client whose buffers are full.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

from kvmesh.serving.openai.relay import trailer_at, whole_events

# Buffered and unread beyond this, the router stops reading from the replica: a client that
# reads slowly slows its replica's stream down instead of filling the router's memory.
_HIGH_WATER_BYTES = 256 << 10
_MAX_IDLE = 16  # idle connections kept per replica
# What ``read`` returns while splicing when the client's buffers are full: reading from the
# replica has stopped; wait for the client to drain, then ``resume``.
CLIENT_FULL = b""
CLOSED = "the router closed its connections to the replica"


class ReplicaHttpError(Exception):
    """The replica answered with an error status; ``body`` is its (OpenAI-shaped) error."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}")
        self.status, self.body = status, body


class _Connection(asyncio.Protocol):
    """One connection, one response at a time, fed to httptools as bytes arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.status = 0
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte of the current response
        self.error: BaseException | None = None
        # The router had to stop reading the current response (its client fell behind).
        # The replica's write timeout cuts only a stream that was not read, so a connection
        # lost after this is taken for that cut, not for a failed replica (``relay.py``).
        self.fell_behind = False
        self._pieces: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future | None = None
        self._news = False  # something the reader waits for happened in this data_received
        # Splicing: each whole event goes to ``_sink`` (the client's connection); it says
        # True when the client's buffers are full. ``_carry``: an event not yet whole.
        self._sink: Callable[[bytes], bool] | None = None
        self._carry = b""
        self.client_full = False

    # --------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None:
            self.error = exc or ConnectionResetError("the replica closed the connection")
        self._wake()

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self.parser is None:  # bytes nobody asked for: the connection cannot be trusted
            self.error = ConnectionError("unexpected bytes from the replica")
            self.transport.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = ConnectionError(f"bad HTTP from the replica: {exc}")
            self.transport.abort()
            self._news = True
        if self._news:
            self._news = False
            self._wake()

    # --------------------------------------------------------------- httptools callbacks

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._news = True

    def on_body(self, body: bytes) -> None:
        if self._sink is not None and not self.client_full:
            self._splice(body)
            return
        self._keep(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self.parser = None
        self._news = True
        self._stop_splicing()

    def _keep(self, body: bytes) -> None:
        """Hold body bytes for ``read``."""
        self._pieces.append(body)
        self._buffered += len(body)
        self._news = True
        if self._buffered > _HIGH_WATER_BYTES and not self._paused:
            self._pause()

    def _pause(self) -> None:
        self._paused = self.fell_behind = True
        self.transport.pause_reading()

    def _unpause(self) -> None:
        self._paused = False
        self.transport.resume_reading()

    def _take_held(self) -> bytes:
        """Everything held for the reader, taken."""
        data = b"".join(self._pieces) if len(self._pieces) > 1 else self._pieces[0]
        self._pieces.clear()
        self._buffered = 0
        return data

    # --------------------------------------------------------------- splicing

    def splice(self, sink: Callable[[bytes], bool]) -> None:
        """From now on, whole SSE events go to ``sink`` as they arrive, up to the replica's
        trailer: that event and everything after it are left for ``read``, like the end,
        an error, and ``CLIENT_FULL`` when ``sink`` says its client's buffers are full."""
        if self.complete:
            return  # all of it is in already: the reader takes it as it is
        self._sink = sink
        self.resume()  # what is held (even past the high-water mark) goes first

    def resume(self) -> None:
        """After ``CLIENT_FULL``, once the client drained: splice what came meanwhile, read on."""
        self.client_full = False
        if self._sink is not None and self._pieces:
            self._splice(self._take_held())
        if not self.client_full and self._paused:
            self._unpause()

    def _splice(self, body: bytes) -> None:
        block, self._carry = whole_events(self._carry + body if self._carry else body)
        sink, rest = self._sink, b""
        at = trailer_at(block) if block else -1
        if at >= 0:  # the trailer and what follows it are the reader's
            block, rest = block[:at], block[at:] + self._carry
            self._sink, self._carry = None, b""
        if block and sink(block):
            self.client_full = self._news = True
            if not self._paused:
                self._pause()
        if rest:
            self._keep(rest)

    def _stop_splicing(self) -> None:
        """At the response's end: an event left incomplete is the reader's."""
        if self._sink is not None and self._carry:
            self._keep(self._carry)
        self._sink, self._carry = None, b""

    # --------------------------------------------------------------- the caller's side

    @property
    def usable(self) -> bool:
        return self.error is None and self.transport is not None and not self.transport.is_closing()

    def send(self, request: bytes) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.complete, self.keep_alive, self.received = 0, False, False, False
        # What the last caller left unread (it stopped reading an answer that had all come
        # in) is that answer's, never this one's.
        self._pieces.clear()
        self._buffered, self.fell_behind = 0, False
        self._sink, self._carry, self.client_full = None, b"", False
        if self._paused:
            self._unpause()
        self.transport.write(request)

    async def headers(self) -> int:
        """The response's status, once its headers are in."""
        while not self.status:
            if self.error is not None:
                raise self.error
            await self._wait()
        return self.status

    async def read(self) -> bytes | None:
        """The body bytes that arrived since the last read (``CLIENT_FULL`` while splicing,
        when the client must drain first); None at the response's end."""
        while True:
            if self.client_full:
                return CLIENT_FULL
            if self._pieces:
                data = self._take_held()
                if self._paused:
                    self._unpause()
                return data
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            await self._wait()

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def fail(self, error: OSError) -> None:
        """Close it under its reader, who gets ``error``."""
        if self.error is None:
            self.error = error
        self.close()
        self._wake()


class ReplicaHttp:
    """A replica's OpenAI port: ``post`` a request and read its streamed answer; connections
    are kept for the next request when the answer was read to its end."""

    def __init__(
        self,
        url: str,
        ssl_context: ssl.SSLContext | None,
        server_name: str | None = None,
        connect_timeout_s: float = 2.0,
    ):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl_context if parts.scheme == "https" else None
        self.server_name = (server_name or self.host) if self.ssl else None
        self.connect_timeout_s = connect_timeout_s
        self._netloc = parts.netloc.encode()
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()  # a request on each, its answer not released yet
        self.closed = ""  # why ``close`` was called (then no request goes out any more)

    async def post(self, path: str, body: bytes, headers: tuple[tuple[str, str], ...]) -> _Connection:
        """A connection whose response to ``POST path`` has status 200 and headers read (read
        its body with ``read``, then ``release`` it); ReplicaHttpError for another status,
        OSError when the replica cannot be reached or ``close`` was called."""
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers).encode()
        request = b"".join(
            (
                b"POST ",
                path.encode(),
                b" HTTP/1.1\r\nhost: ",
                self._netloc,
                b"\r\ncontent-type: application/json\r\ncontent-length: ",
                str(len(body)).encode(),
                b"\r\n",
                extra,
                b"\r\n",
                body,
            )
        )
        while True:
            conn = self._take_idle()
            reused = conn is not None
            conn = conn or await self._connect()
            self._busy.add(conn)
            conn.send(request)
            try:
                status = await conn.headers()
            except BaseException as exc:  # cancelled too (the client left): the replica learns it now
                self._busy.discard(conn)
                conn.close()
                if isinstance(exc, OSError) and reused and not conn.received and not self.closed:
                    continue  # a kept connection the replica had closed meanwhile: a new one
                raise
            break
        if status != 200:
            error = await self._whole_body(conn)
            raise ReplicaHttpError(status, error)
        return conn

    def release(self, conn: _Connection) -> None:
        """Keep ``conn`` for the next request if its response was read to the end."""
        self._busy.discard(conn)
        if conn.complete and conn.keep_alive and conn.usable and len(self._idle) < _MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self, because: str = CLOSED) -> None:
        """Close every connection, those with a request on them too: their readers get
        ``ConnectionAbortedError(because)``, and so does every later ``post``."""
        self.closed = because
        for conn in [*self._idle, *self._busy]:
            conn.fail(ConnectionAbortedError(because))
        self._idle.clear()
        self._busy.clear()

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable:
                return conn
        return None

    async def _connect(self) -> _Connection:
        if self.closed:
            raise ConnectionAbortedError(self.closed)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                _Connection, self.host, self.port, ssl=self.ssl, server_hostname=self.server_name
            )
        if self.closed:  # meanwhile
            conn.close()
            raise ConnectionAbortedError(self.closed)
        return conn

    async def _whole_body(self, conn: _Connection) -> bytes:
        parts = []
        try:
            while (data := await conn.read()) is not None:
                parts.append(data)
        except OSError:
            pass
        self.release(conn)
        return b"".join(parts)
