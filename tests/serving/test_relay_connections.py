"""The router's keep-alive HTTP/1.1 connections to a replica (``router/replica_http.py``),
against a hand-written HTTP server on a real socket: a connection is reused only when its
last answer was read to the end, one the replica closed is never handed out again, a reader
that falls behind pauses the socket instead of buffering without bound, and errors come back
with their status and body."""

import asyncio

import pytest
from fake_http import FakeHttpServer

from kvmesh.router.replica_http import ReplicaHttp, ReplicaHttpError

pytestmark = pytest.mark.asyncio


class _Server(FakeHttpServer):
    """Answers every request on a connection with ``body`` (chunked, or with a length when an
    error); ``close_after``: closes each connection after that many answers."""

    def __init__(self, body: bytes = b"data: 1\n\n", status: int = 200, close_after: int = 0):
        super().__init__()
        self.body, self.status, self.close_after = body, status, close_after
        self._answered: dict[int, int] = {}

    async def answer(self, writer: asyncio.StreamWriter) -> bool:
        if self.status == 200:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(self.body), self.body))
        else:
            writer.write(
                b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (self.status, len(self.body), self.body)
            )
        await writer.drain()
        answered = self._answered[id(writer)] = self._answered.get(id(writer), 0) + 1
        if answered == self.close_after:
            writer.close()
            return False
        return True


async def _whole(http: ReplicaHttp) -> bytes:
    conn = await http.post("/x", b"{}", (("authorization", "Bearer t"),))
    parts = []
    while (data := await conn.read()) is not None:
        parts.append(data)
    http.release(conn)
    return b"".join(parts)


async def test_a_connection_read_to_its_end_is_reused():
    async with _Server() as server:
        http = ReplicaHttp(server.url, None)
        assert [await _whole(http) for _ in range(3)] == [b"data: 1\n\n"] * 3
        assert server.connections == 1
        http.close()


@pytest.mark.parametrize(
    ("body", "arrived", "connections"),
    [(b"data: 1\n\n" * 1000, True, 1), (b"x" * (4 << 20), False, 2)],
    ids=["answer-all-in: kept", "answer-still-coming: closed"],
)
async def test_what_a_departed_caller_left_unread_never_reaches_the_next_request(body, arrived, connections):
    """A client that left without reading its answer: a connection whose answer had all come
    in may be kept, one still receiving is closed; either way the next request reads only its
    own answer."""
    async with _Server(body=body) as server:
        http = ReplicaHttp(server.url, None)
        conn = await http.post("/x", b"{}", ())
        await asyncio.sleep(0.1)  # nobody reads
        assert conn.complete == arrived
        http.release(conn)
        server.body = b"data: 2\n\n"
        assert await _whole(http) == b"data: 2\n\n"
        assert server.connections == connections
        http.close()


async def test_a_connection_the_replica_closed_is_not_handed_out_again():
    async with _Server(close_after=1) as server:
        http = ReplicaHttp(server.url, None)
        assert await _whole(http) == b"data: 1\n\n"
        await asyncio.sleep(0.1)  # the close arrives while the connection is idle in the pool
        assert await _whole(http) == b"data: 1\n\n"
        assert server.connections == 2
        http.close()


async def test_a_reader_that_falls_behind_pauses_the_socket():
    async with _Server(body=b"x" * (4 << 20)) as server:
        http = ReplicaHttp(server.url, None)
        conn = await http.post("/x", b"{}", ())
        await asyncio.sleep(0.3)  # not reading: the router must not buffer all 4 MiB
        assert conn._paused and conn._buffered < 1 << 20
        total = 0
        while (data := await conn.read()) is not None:
            total += len(data)
        assert total == 4 << 20 and not conn._paused
        http.release(conn)
        http.close()


async def test_an_error_status_comes_back_with_its_body_and_the_connection_stays_usable():
    async with _Server(body=b'{"error": {"message": "no"}}', status=429) as server:
        http = ReplicaHttp(server.url, None)
        with pytest.raises(ReplicaHttpError) as refused:
            await http.post("/x", b"{}", ())
        assert refused.value.status == 429 and refused.value.body == b'{"error": {"message": "no"}}'
        with pytest.raises(ReplicaHttpError):
            await http.post("/x", b"{}", ())
        assert server.connections == 1  # the error's body was read whole: the connection was kept
        http.close()


async def test_an_unreachable_replica_is_an_oserror_soon():
    http = ReplicaHttp("http://127.0.0.1:9", None, connect_timeout_s=1.0)  # discard port: nothing listens
    with pytest.raises(OSError):
        await http.post("/x", b"{}", ())
