"""A loopback TCP proxy that can freeze: the client behind it stops reading (``freeze("down")``)
or vanishes without a goodbye, as behind a network partition (``freeze("both")``). A fault
injector for the slow and vanished client tests; everything it forwards is real traffic."""

import asyncio
import socket


class FreezableProxy:
    def __init__(self, target_port: int):
        self.target_port = target_port
        self.frozen: set[str] = set()  # "up" (client -> server) and/or "down" (server -> client)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    def freeze(self, direction: str = "both") -> None:
        self.frozen |= {"up", "down"} if direction == "both" else {direction}

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._server.close()

    async def _handle(self, client_reader, client_writer) -> None:
        upstream = socket.socket()
        # A small receive window toward the server: a frozen client fills it (and the
        # server's send buffer) after little data, as a slow client on a real network does.
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        upstream.setblocking(False)
        await asyncio.get_running_loop().sock_connect(upstream, ("127.0.0.1", self.target_port))
        server_reader, server_writer = await asyncio.open_connection(sock=upstream)
        pipes = [
            asyncio.create_task(self._pipe(client_reader, server_writer, "up")),
            asyncio.create_task(self._pipe(server_reader, client_writer, "down")),
        ]
        self._tasks.update(pipes)

    async def _pipe(self, reader, writer, direction: str) -> None:
        try:
            while True:
                if direction in self.frozen:
                    await asyncio.sleep(3600)
                data = await reader.read(16384)
                if not data or direction in self.frozen:
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if direction not in self.frozen:
                writer.close()
