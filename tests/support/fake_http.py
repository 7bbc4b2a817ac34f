"""A hand-written HTTP/1.1 server on loopback, to inject the faults a real replica does not
make on purpose: it reads each request whole, then a subclass writes the answer."""

import asyncio


class FakeHttpServer:
    def __init__(self) -> None:
        self.connections = 0
        self.requests = 0
        self.bodies: list[bytes] = []  # each request's body, in order
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        for writer in self._writers:
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.lower().split(b"\r\n")
            body = await reader.readexactly(
                next(int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length"))
            )
            self.bodies.append(body)
            self.requests += 1
            if not await self.answer(writer):
                return

    async def answer(self, writer: asyncio.StreamWriter) -> bool:
        """Write the answer to one request; False when the connection is done with."""
        raise NotImplementedError
