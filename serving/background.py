"""Background loops a component owns (index refresh, publishing, supervision), and how they stop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine


class BackgroundLoops:
    """Loops written ``while loops.running: ...`` end on a flag as well as a cancel.

    The flag is what makes ``stop()`` reliable: a cancellation that lands inside a client
    library's call can be swallowed there, and a stop that only cancelled then waited forever
    on a loop that kept going (seen with the router's Redis refresh).
    """

    def __init__(self) -> None:
        self.running = True
        self._tasks: list[asyncio.Task] = []

    def start(self, loop: Coroutine, name: str) -> None:
        self.running = True  # a component stopped and started again runs again
        self._tasks.append(asyncio.create_task(loop, name=name))

    async def stop(self) -> None:
        self.running = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
