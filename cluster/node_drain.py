"""Draining every replica on this machine before it goes (a Kubernetes node drain, a Ray
worker pod's preStop): each is asked over its drain socket and answers once it drained."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from pathlib import Path

from kvmesh.replica.drain_socket import DRAIN, DRAINED, local_sockets, replica_of


async def _drain_one(path: Path) -> bool | None:
    """True once the replica answered ``drained``; None if it is gone already (a stale
    socket, removed now); False if it went away mid-drain."""
    try:
        reader, writer = await asyncio.open_unix_connection(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # its process died without removing it
        return None
    try:
        writer.write(DRAIN)
        await writer.drain()
        return await reader.readline() == DRAINED
    except ConnectionError:
        return False
    finally:
        writer.close()


async def drain_local_replicas(timeout_s: float) -> tuple[list[str], list[str]]:
    """Ask every local replica to drain, all at once; (those drained, those that were not
    within ``timeout_s``). Sockets whose process is gone are removed, not counted."""
    return await drain_sockets(local_sockets(), timeout_s)


async def drain_sockets(paths: Collection[Path], timeout_s: float) -> tuple[list[str], list[str]]:
    """``drain_local_replicas`` for the replicas behind these drain sockets only (a test's pod
    shares its machine's drain folder with others)."""
    tasks = {path: asyncio.ensure_future(_drain_one(path)) for path in sorted(paths)}
    if tasks:
        await asyncio.wait(tasks.values(), timeout=timeout_s)
    outcome = {
        path: task.result() if task.done() and not task.cancelled() else False for path, task in tasks.items()
    }
    for task in tasks.values():
        task.cancel()
    drained = [replica_of(p) for p, ok in outcome.items() if ok]
    return drained, [replica_of(p) for p, ok in outcome.items() if ok is False]
