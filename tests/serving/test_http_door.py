"""The door of every kvmesh HTTP port (``serving/http_door.py``), tried with raw sockets on a
real server: an oversized or slow request head, a silent connection, a stalled body and one
connection too many are each answered and ended within their bound, while ordinary,
keep-alive and pipelined clients are served as before; a wrong token ends its connection
before the body is read."""

import asyncio
import contextlib
import ssl
import types

import pytest
from fake_backend import FakeBackend
from uvicorn.protocols.http import httptools_impl

from kvmesh.serving.connections import ConnectionLimits
from kvmesh.serving.http_server import start_http_server
from kvmesh.serving.openai.app import OneModel, build_app
from kvmesh.serving.tls import TLSConfig

pytestmark = pytest.mark.servers

# Small bounds, so that each test takes well under a second of waiting; each test that waits
# on a timer shortens only the one it tries.
LIMITS = dict(
    http_max_head_bytes=8 << 10,
    http_max_headers=50,
    http_head_timeout_s=5.0,
    http_body_timeout_s=5.0,
    http_idle_timeout_s=5.0,
    http_max_connections=64,
)


async def _echo(scope, receive, send):
    """Reads the whole body, answers with the method, path and body size."""
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = f"{scope['method']} {scope['path']} {size}".encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def _serving(app=_echo, tls: TLSConfig | None = None, **limits):
    server = await start_http_server(app, "127.0.0.1", 0, tls, ConnectionLimits(**{**LIMITS, **limits}))
    try:
        yield server.port
    finally:
        await server.stop(grace=1)


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status and body of the next response (Content-Length framed)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length:"))
    return int(lines[0].split()[1]), await asyncio.wait_for(reader.readexactly(length), 5)


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server ends the connection within ``seconds`` (what it sends meanwhile is read)."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(1 << 16):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


def _get(path: str = "/") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode()


def _post(path: str, body: bytes) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


@pytest.fixture
def parser_feeds(monkeypatch) -> list[int]:
    """The size of every piece the server's HTTP parser is given."""
    fed: list[int] = []
    real = httptools_impl.httptools

    class Counting:
        def __init__(self, protocol):
            self._parser = real.HttpRequestParser(protocol)

        def __getattr__(self, name):
            return getattr(self._parser, name)

        def feed_data(self, data):
            fed.append(len(data))
            self._parser.feed_data(data)

    monkeypatch.setattr(
        httptools_impl, "httptools", types.SimpleNamespace(**{**vars(real), "HttpRequestParser": Counting})
    )
    return fed


async def test_a_megabyte_header_line_gets_431_and_the_parser_never_sees_it(parser_feeds):
    async with _serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        status, body = await _response(reader)
        assert await _closed_within(reader, 2)
        writer.close()
    assert status == 431, body
    assert sum(parser_feeds) <= LIMITS["http_max_head_bytes"]


async def test_over_tls_an_oversized_head_gets_431_and_the_connection_ends(pki):
    cert, key = pki["server"]
    client = ssl.create_default_context(cafile=pki["ca"])
    async with _serving(tls=TLSConfig(cert=cert, key=key)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
        writer.write(b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (64 << 10) + b"\r\n\r\n")
        status, body = await _response(reader)
        assert await _closed_within(reader, 2)
        writer.close()
    assert status == 431, body


async def test_a_thousand_headers_get_431(parser_feeds):
    head = "GET / HTTP/1.1\r\nHost: t\r\n" + "".join(f"X-{i}: v\r\n" for i in range(1000)) + "\r\n"
    assert len(head) < LIMITS["http_max_head_bytes"] * 2
    async with _serving(http_max_head_bytes=64 << 10) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head.encode())
        status, body = await _response(reader)
        assert await _closed_within(reader, 2)
        writer.close()
    assert status == 431, body
    assert not parser_feeds  # the whole head came in one read, and was refused before parsing


async def test_a_head_slower_than_the_head_timeout_gets_408():
    async with _serving(http_head_timeout_s=0.5) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\n")
        answer = asyncio.create_task(_response(reader))
        for i in range(30):  # a header line every 0.1 s, for up to 3 s
            if answer.done():
                break
            writer.write(f"X-{i}: v\r\n".encode())
            await asyncio.sleep(0.1)
        status, body = await answer
        assert await _closed_within(reader, 2)
        writer.close()
    assert status == 408, body


async def test_a_silent_connection_is_closed_after_the_idle_timeout_and_so_is_one_after_its_answer():
    async with _serving(http_idle_timeout_s=0.5) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await _closed_within(reader, 2)  # never sent a byte
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get())
        assert (await _response(reader))[0] == 200
        assert await _closed_within(reader, 2)
        writer.close()


async def test_a_stalled_body_gets_408_and_its_app_is_told_the_client_left():
    left = asyncio.Event()

    async def reader_app(scope, receive, send):
        while (await receive())["type"] == "http.request":
            pass
        left.set()

    async with _serving(reader_app, http_body_timeout_s=0.5) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 4000000\r\n\r\n" + b"x" * (64 << 10))
        status, body = await _response(reader)
        assert await _closed_within(reader, 2)
        await asyncio.wait_for(left.wait(), 2)
        writer.close()
    assert status == 408, body


async def test_chunk_lines_and_trailers_are_bounded_like_a_head():
    async with _serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: "
        )
        answer = asyncio.create_task(_response(reader))
        for _ in range(64):  # a trailer of up to 1 MiB, 16 KiB a read
            if answer.done():
                break
            writer.write(b"a" * (16 << 10))
            await asyncio.sleep(0.01)
        status, body = await answer
        writer.close()
    assert status == 431, body


async def test_the_connection_over_the_cap_gets_503_and_is_closed_at_once():
    async with _serving(http_max_connections=3) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        for reader, writer in held:  # each is served
            writer.write(_get())
            assert (await _response(reader))[0] == 200
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        status, body = await _response(reader)
        assert status == 503, body
        assert await _closed_within(reader, 0.5)
        writer.close()
        held.pop()[1].close()  # one leaves: its place is free again
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get())
        assert (await _response(reader))[0] == 200
        for _, w in [*held, (reader, writer)]:
            w.close()


async def test_keep_alive_and_pipelined_requests_are_served_in_order():
    async with _serving(http_max_head_bytes=1024) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(5):  # one after another on one connection
            writer.write(_post(f"/k{i}", b"b" * i))
            assert await _response(reader) == (200, f"POST /k{i} {i}".encode())
        # Several in one write, each head under the bound, together far over it.
        pipelined = [_get(f"/p{i}-" + "x" * 200) if i % 2 else _post(f"/p{i}", b"y" * 900) for i in range(12)]
        writer.write(b"".join(pipelined))
        for i in range(12):
            expected = f"GET /p{i}-{'x' * 200} 0" if i % 2 else f"POST /p{i} 900"
            assert await _response(reader) == (200, expected.encode())
        writer.close()


async def test_a_large_body_in_the_same_read_as_its_head_is_no_431():
    async with _serving(http_max_head_bytes=1024) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post("/big", b"z" * (1 << 20)) + _get("/after"))
        assert await _response(reader) == (200, b"POST /big 1048576")
        assert await _response(reader) == (200, b"GET /after 0")
        writer.close()


async def test_a_wrong_token_is_refused_before_the_body_is_read_and_its_connection_ends():
    app = build_app(OneModel(FakeBackend()), lambda: {"status": "ok"}, auth_token="the-token")
    async with _serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer wrong\r\n"
        writer.write(head + b"Content-Type: application/json\r\nContent-Length: 4000000\r\n\r\n")
        writer.write(b"x" * (256 << 10))  # and not the rest
        status, body = await _response(reader)
        assert await _closed_within(reader, 2)
        writer.close()
    assert status == 401, body
