"""The door of every kvmesh HTTP port: what a client sends is bounded before it is trusted.

uvicorn's httptools protocol reads a request head however long it is (httptools builds a
header value by appending each read to it, so its cost grows with the square of the
value's length), however slowly it comes, and keeps a connection that never sends a byte
for as long as the client likes. ``BoundedHttpProtocol`` counts each head's bytes and lines
before the parser sees them (431 past the bounds), gives a head a time from its first byte
to its end and a body a time between its reads (408, or the connection dropped once a
response is under way), closes a connection with no request under way after the idle
timeout (a new one too), and answers a connection past the port's bound with 503.

A refused client gets its answer and the end of the connection, and what it still sends is
read and thrown away for a moment: closing with its bytes unread would reset the
connection, and the client might never read why. The same holds for a request answered
before its body was read (a 401, a 413): its connection ends there, the rest of the body
unread by the app."""

from __future__ import annotations

import asyncio
import http

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvmesh.serving.connections import ConnectionLimits

HEAD_END = b"\r\n\r\n"
# How long a refused client's last bytes are read and dropped after its answer: time for it
# to stop sending and read the answer, not enough to hold the connection.
LINGER_S = 5.0


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol behind ``ConnectionLimits``' HTTP bounds. Its request
    cycle is uvicorn's own, so ``DirectBody`` works on it unchanged."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._head_bytes = 0  # of the head being read
        self._head_lines = 0
        self._tail = b""  # the last bytes (up to 3) of that head, where its end may begin
        self._in_body = False  # a request's head was read, its body not yet all
        self._body_left: int | None = None  # what its Content-Length still owes (None: chunked)
        self._body_arrived = False  # a chunked body: a part of it was in the last read
        self._not_body = 0  # a chunked body: bytes since its last part (chunk lines, trailers)
        self._waiting_since: float | None = None  # the client owes bytes since then (loop time)
        self._patience = 0.0  # and has this long
        self._timer: asyncio.TimerHandle | None = None
        self._closing = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.http_max_connections:
            self._closing = True
            transport.write(self._answer(503, "too many connections"))
            transport.close()
            return
        # Idle from the start: uvicorn arms this timer only once a first response is sent.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Cut ``data`` where a head or a declared body ends, so that each head is counted
        on its own before the parser sees it, however the reads fall; then give the client
        its time for what it still owes (none for a request that came whole)."""
        start, size = 0, len(data)
        while start < size and not self._closing:
            start = (self._through_body if self._in_body else self._through_head)(data, start, size)
        if self._closing:
            return
        if self._in_body:
            self._wait_for_client(self.limits.http_body_timeout_s)  # from its last part
        elif self._head_bytes and self._waiting_since is None:
            self._wait_for_client(self.limits.http_head_timeout_s)  # from its first byte

    def _through_head(self, data: bytes, start: int, size: int) -> int:
        end = self._head_end(data, start, size)
        self._head_bytes += end - start
        self._head_lines += data.count(b"\n", start, end)
        if self._head_bytes > self.limits.http_max_head_bytes:
            self._refuse(431, f"request head over {self.limits.http_max_head_bytes} bytes")
        elif self._head_lines > self.limits.http_max_headers + 2:  # the request line, the blank line
            self._refuse(431, f"over {self.limits.http_max_headers} header fields")
        else:
            self._feed(data, start, end)
        return end

    def _head_end(self, data: bytes, start: int, size: int) -> int:
        """Just past the blank line that ends the head in ``data[start:]``, else ``size``."""
        if self._tail:
            at = (self._tail + data[start : start + 3]).find(HEAD_END)
            if at >= 0:
                end = start + at + 4 - len(self._tail)
                self._tail = b""
                return end
        at = data.find(HEAD_END, start, size)
        if at >= 0:
            self._tail = b""
            return at + 4
        self._tail = (self._tail + data[max(start, size - 3) : size])[-3:]
        return size

    def _through_body(self, data: bytes, start: int, size: int) -> int:
        if self._body_left:  # declared: the body ends where the next head begins
            end = min(size, start + self._body_left)
            self._body_left -= end - start
            self._feed(data, start, end)
            return end
        # Chunked: where it ends is the parser's to find. What is not body (chunk lines,
        # trailers, which the parser builds as it builds headers) is bounded as a head is;
        # what follows the body's end in the same read is the next head, counted and timed
        # from the next read on (until then the idle timeout holds, once its answer is sent).
        self._body_arrived = False
        self._feed(data, start, size)
        if self._in_body:
            self._not_body = 0 if self._body_arrived else self._not_body + size - start
            if self._not_body > self.limits.http_max_head_bytes:
                self._refuse(431, f"over {self.limits.http_max_head_bytes} bytes between body chunks")
        return size

    def _feed(self, data: bytes, start: int, end: int) -> None:
        super().data_received(data if start == 0 and end == len(data) else memoryview(data)[start:end])

    # Parser callbacks: where a head and a body end.

    def on_headers_complete(self) -> None:
        self._head_bytes = self._head_lines = self._not_body = 0
        self._waiting_since = None
        self._in_body = True
        self._body_left = self._declared_length()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_arrived = True
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._waiting_since = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._in_body and self.cycle.response_complete and not self.transport.is_closing():
            self._linger()  # answered before its body was read: the rest of it is not wanted

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg)

    def _declared_length(self) -> int | None:
        length = None
        for name, value in self.headers:
            if name == b"transfer-encoding":
                return None
            if name == b"content-length":
                length = int(value)  # the parser has checked it
        return length

    # Time the client is given.

    def _wait_for_client(self, patience: float) -> None:
        """The client owes bytes from now, for ``patience`` seconds. One timer per connection,
        moved only when it would fire too late: it looks, when it fires, whether the time
        really ran out."""
        now = self.loop.time()
        self._waiting_since, self._patience = now, patience
        if self._timer is None or self._timer.when() > now + patience:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(now + patience, self._check)

    def _check(self) -> None:
        self._timer = None
        if self._waiting_since is None or self._closing:
            return
        now = self.loop.time()
        if self.flow.read_paused or (self._in_body and self.cycle.waiting_for_100_continue):
            self._waiting_since = now  # the client waits on the server, not the other way round
        deadline = self._waiting_since + self._patience
        if deadline > now:
            self._timer = self.loop.call_at(deadline, self._check)
        elif self._in_body:
            self._refuse(408, f"no part of the request body came for {self._patience:g} s")
        else:
            self._refuse(408, f"request head not complete within {self._patience:g} s")

    # The end of a connection.

    def _refuse(self, status: int, reason: str) -> None:
        """Answer ``status`` and end the connection; where a response is under way (or
        requests wait behind one) it cannot be answered, only dropped."""
        cycle = self.cycle
        if self.pipeline or (cycle is not None and cycle.response_started and not cycle.response_complete):
            self._closing = True
            self.transport.abort()
            return
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # its app is told so, and writes nothing more
            cycle.message_event.set()
        self.transport.write(self._answer(status, reason))
        self._linger()

    def _linger(self) -> None:
        """End the connection from this side, read and drop what the client still sends
        until it closes its side or ``LINGER_S`` passes."""
        self._closing = True
        self._waiting_since = None
        self._unset_keepalive_if_required()
        if self._timer is not None:
            self._timer.cancel()
        if not self.transport.can_write_eof():  # TLS: no half-close, the answer is sent and closed
            self.transport.close()
            return
        self.flow.resume_reading()
        self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self.transport.abort)

    def _answer(self, status: int, reason: str) -> bytes:
        body = reason.encode()
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, http.HTTPStatus(status).phrase.encode())]
        lines += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        lines.append(
            b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % len(body)
        )
        return b"".join(lines) + body
