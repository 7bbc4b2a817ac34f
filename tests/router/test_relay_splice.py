"""A relayed stream spliced into its client's connection (``_Connection.splice``): whole
events go to the client from the replica connection's own callbacks, in order, without
waking the reader; the trailer and what follows it, the end, and a client whose buffers are
full are the reader's. A real loopback connection to a scripted upstream."""

import asyncio

import pytest
from fake_http import FakeHttpServer

from kvmesh.router.replica_http import CLIENT_FULL, ReplicaHttp

pytestmark = pytest.mark.servers

FIRST = b'data: {"choices": [{"text": "a"}]}\n\n'
EVENTS = [b'data: {"choices": [{"text": "%d"}]}\n\n' % i for i in range(6)]
TRAILER = b": kvmesh-complete AAAA\n\n"
DONE = b"data: [DONE]\n\n"


class _Scripted(FakeHttpServer):
    """Answers 200 chunked, then writes each piece put on ``pieces`` (None: the end)."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def answer(self, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while (piece := await self.pieces.get()) is not None:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


class _Client:
    """The sink: what reached the client, and whether its buffers are full after each write."""

    def __init__(self, full_after: int | None = None) -> None:
        self.got: list[bytes] = []
        self.full_after = full_after

    def __call__(self, block: bytes) -> bool:
        self.got.append(block)
        return self.full_after is not None and len(self.got) >= self.full_after


async def _until(check, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


async def _opened(upstream: _Scripted):
    replica = ReplicaHttp(upstream.url, None)
    conn = await replica.post("/v1/completions", b"{}", ())
    await upstream.pieces.put(FIRST)
    assert await conn.read() == FIRST
    return replica, conn


async def test_events_reach_the_client_whole_and_in_order_without_waking_the_reader():
    async with _Scripted() as upstream:
        replica, conn = await _opened(upstream)
        client = _Client()
        conn.splice(client)
        reads = 0
        real_wake = conn._wake

        def counted_wake():
            nonlocal reads
            reads += 1
            real_wake()

        conn._wake = counted_wake
        await upstream.pieces.put(EVENTS[0][:10])  # one event split over two writes
        await upstream.pieces.put(EVENTS[0][10:] + EVENTS[1])
        for event in EVENTS[2:]:
            await upstream.pieces.put(event)
        await _until(lambda: b"".join(client.got) == b"".join(EVENTS))
        assert reads == 0  # six events, and the reader never woke
        assert all(block.endswith(b"\n\n") for block in client.got)  # never half an event
        await upstream.pieces.put(EVENTS[0] + TRAILER + DONE)  # an event, then the trailer
        await upstream.pieces.put(None)
        assert await conn.read() == TRAILER + DONE  # the trailer and after: the reader's
        assert client.got[-1] == EVENTS[0]  # the event before it: still the client's
        assert await conn.read() is None
        replica.release(conn)
        assert replica._idle == [conn]  # read to its end: kept for the next request


async def test_a_full_client_stops_the_reading_until_it_drained():
    async with _Scripted() as upstream:
        replica, conn = await _opened(upstream)
        client = _Client(full_after=1)
        conn.splice(client)
        await upstream.pieces.put(EVENTS[0])
        assert await conn.read() == CLIENT_FULL
        assert conn.fell_behind
        for event in EVENTS[1:]:  # sent meanwhile: held, not written to a full client
            await upstream.pieces.put(event)
        await asyncio.sleep(0.2)
        assert client.got == [EVENTS[0]]
        client.full_after = None
        conn.resume()  # the client drained
        await _until(lambda: b"".join(client.got) == b"".join(EVENTS))
        await upstream.pieces.put(TRAILER + DONE)
        await upstream.pieces.put(None)
        assert await conn.read() == TRAILER + DONE
        assert await conn.read() is None
        replica.close()


async def test_what_came_before_the_splice_goes_out_first():
    async with _Scripted() as upstream:
        replica, conn = await _opened(upstream)
        await upstream.pieces.put(EVENTS[0] + EVENTS[1][:5])  # arrives while nobody reads
        await asyncio.sleep(0.2)
        client = _Client()
        conn.splice(client)
        await upstream.pieces.put(EVENTS[1][5:] + EVENTS[2])
        await _until(lambda: b"".join(client.got) == b"".join(EVENTS[:3]))
        await upstream.pieces.put(None)  # the end without a trailer (an error event's stream)
        assert await conn.read() is None
        replica.close()


async def test_a_splice_after_the_router_stopped_reading_reads_on():
    """Over the high-water mark while nobody read, the connection stopped reading: the splice
    writes what is held and reads on."""
    big = b'data: {"choices": [{"text": "%s"}]}\n\n' % (b"x" * 30_000)
    async with _Scripted() as upstream:
        replica, conn = await _opened(upstream)
        for _ in range(10):  # ~300 KB, past the 256 KB mark
            await upstream.pieces.put(big)
        await _until(lambda: conn.fell_behind)
        client = _Client()
        conn.splice(client)
        await upstream.pieces.put(EVENTS[0])
        await _until(lambda: client.got and client.got[-1].endswith(EVENTS[0]))
        assert b"".join(client.got) == big * 10 + EVENTS[0]
        await upstream.pieces.put(None)
        assert await conn.read() is None
        replica.close()


async def test_a_response_already_whole_is_left_to_the_reader():
    async with _Scripted() as upstream:
        replica, conn = await _opened(upstream)
        await upstream.pieces.put(EVENTS[0] + TRAILER + DONE)
        await upstream.pieces.put(None)
        await _until(lambda: conn.complete)
        client = _Client()
        conn.splice(client)
        assert client.got == []
        assert await conn.read() == EVENTS[0] + TRAILER + DONE
        assert await conn.read() is None
        replica.close()
