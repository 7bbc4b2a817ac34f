"""Streamed responses written straight to their connection (``DirectBody``) on a real
uvicorn server: the same bytes as through the ASGI send, none of the chunks through the
middlewares' sends, and a client that stops reading or leaves still ends its stream."""

import asyncio
import json
import socket
import time

import httpx
import pytest
from fake_backend import FakeBackend

from kvmesh.protos import pb
from kvmesh.serving.connections import ConnectionLimits
from kvmesh.serving.http_server import start_http_server
from kvmesh.serving.openai.app import OneModel, build_app

pytestmark = pytest.mark.servers
TOKENS = 40


class _CountingBackend(FakeBackend):
    """Streams ``TOKENS`` chunks of ``text_bytes`` each, then waits on ``hold`` (forever
    unless set); ``closed`` is set when its stream is closed, however it ends."""

    def __init__(self, text_bytes: int = 1, tokens: int = TOKENS, hold: bool = False):
        super().__init__()
        self.text = "x" * text_bytes
        self.tokens = tokens
        self.hold = asyncio.Event() if hold else None
        self.closed = asyncio.Event()

    async def generate(self, request, trace=None):
        try:
            for i in range(self.tokens):
                chunk = pb.Chunk(token_ids=[i % 100], text=f"{self.text}{i};", prompt_tokens=3)
                yield pb.GenerateResponse(request_id="r", chunk=chunk)
                await asyncio.sleep(0)
                if self.hold is not None:
                    await self.hold.wait()
        finally:
            self.closed.set()


class _CountingSends:
    """An ASGI middleware that counts the messages its app sends."""

    def __init__(self, app):
        self.app, self.sent = app, []

    async def __call__(self, scope, receive, send):
        async def counted(message):
            self.sent.append(message["type"])
            await send(message)

        await self.app(scope, receive, counted)


BODY = {"prompt": [1, 2, 3], "stream": True, "max_tokens": TOKENS}


def _texts(sse: str) -> list[str]:
    events = [line[6:] for line in sse.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]]


async def test_a_streamed_response_goes_straight_to_the_connection_with_the_same_bytes():
    counting = _CountingSends(build_app(OneModel(_CountingBackend()), lambda: {"status": "ok"}))
    server = await start_http_server(counting, "127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            direct = await http.post("/v1/completions", json=BODY)
    finally:
        await server.stop(1)
    # Only the headers and the end went through the ASGI send; every event went direct.
    assert counting.sent == ["http.response.start", "http.response.body"]
    assert _texts(direct.text) == [f"x{i};" for i in range(TOKENS)]

    # The same app where the server gives no direct access (in process): the same events.
    app = build_app(OneModel(_CountingBackend()), lambda: {"status": "ok"})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        through_send = await http.post("/v1/completions", json=BODY)
    assert _texts(through_send.text) == _texts(direct.text)


async def test_a_client_that_stops_reading_a_direct_stream_is_cut_off_within_the_write_timeout():
    backend = _CountingBackend(text_bytes=64 << 10, tokens=10_000)  # ~640 MB if nobody stops it
    server = await start_http_server(
        build_app(OneModel(backend), lambda: {"status": "ok"}),
        "127.0.0.1",
        0,
        limits=ConnectionLimits(stream_write_timeout_s=0.5),
    )
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect(("127.0.0.1", server.port))
        payload = json.dumps({**BODY, "max_tokens": 10_000}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        sock.sendall(head.encode() + payload)  # and never read a byte
        started = time.monotonic()
        await asyncio.wait_for(backend.closed.wait(), timeout=10)
        assert time.monotonic() - started < 5
        assert backend.inflight.active == 0
    finally:
        sock.close()
        await server.stop(1)


@pytest.mark.parametrize("read_first", [True, False])
async def test_a_client_that_leaves_between_tokens_ends_its_stream_at_once(read_first):
    backend = _CountingBackend(hold=True)  # one token, then nothing until told
    server = await start_http_server(build_app(OneModel(backend), lambda: {"status": "ok"}), "127.0.0.1", 0)
    try:
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http,
            http.stream("POST", "/v1/completions", json=BODY) as response,
        ):
            assert response.status_code == 200
            if read_first:
                async for _ in response.aiter_bytes():
                    break
        await asyncio.wait_for(backend.closed.wait(), timeout=5)  # not held until a next token
        assert backend.inflight.active == 0
    finally:
        await server.stop(1)
