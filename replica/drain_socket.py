"""Where a node's drain reaches its replicas: one Unix socket per replica process in a folder
only this user can open (``drain_dir``).

Kubernetes runs a pod's preStop before it stops the pod, and Ray would stop a replica's
process abruptly; ``kvmesh drain-replicas`` (the Ray pods' preStop) connects to every socket
here instead, and each replica drains as on SIGTERM: it leaves the index (routers stop
choosing it), refuses new requests (a router retries those elsewhere), lets the running
ones finish within its drain timeout, answers ``drained`` and exits. Nothing else can be
asked over the socket, and nothing is read beyond one short line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

DRAIN = b"drain\n"
DRAINED = b"drained\n"


def replica_of(path: Path) -> str:
    """The replica id a drain socket belongs to."""
    return path.stem.split("-", 1)[1]


def pid_of(path: Path) -> int:
    """The process a drain socket belongs to."""
    return int(path.stem.split("-", 1)[0])


def drain_dir() -> Path:
    """This machine's replica drain sockets (per user: another user's replicas are not ours)."""
    return Path(tempfile.gettempdir()) / f"kvmesh-replicas-{os.getuid()}"


def local_sockets() -> list[Path]:
    """Every replica drain socket on this machine (``<pid>-<replica id>.sock``)."""
    return sorted(drain_dir().glob("*-*.sock"))


class DrainSocket:
    def __init__(
        self, replica_id: str, drain: Callable[[], Awaitable[None]], after: Callable[[], None] | None = None
    ):
        """``drain()`` for each asker (it must run once however many ask, as
        ``ReplicaServer.stop`` does); ``after()`` once the first asker has its answer (a Ray
        actor's process exits there)."""
        # by process: replicas of two deployments on one node may share an id
        self.path = drain_dir() / f"{os.getpid()}-{replica_id}.sock"
        self._drain, self._after = drain, after
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(mode=0o700, exist_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            if line == DRAIN:
                await self._drain()
                writer.write(DRAINED)
                await writer.drain()
                after, self._after = self._after, None
                if after is not None:
                    after()
        except (TimeoutError, ValueError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
