"""Several response streams read as one (the n choices of a request, the prompts of a batch)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of every stream as they arrive, tagged with the stream's position.

    The first error ends the merge and is raised here; closing the merge (the client went
    away) cancels every stream still running, so each cleans up (aborts its request).
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, _DONE))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            i, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
