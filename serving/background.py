"""Background loops a component owns (index refresh, publishing, supervision), and how they stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

log = logging.getLogger(__name__)

# The offset (seconds) of the grid this process's periodic loops wake on: loops of one
# process share their wake-ups, while processes sharing a host (and its monotonic clock) do
# not all call Redis in the same instant.
_PHASE_S = random.random()


def until_next_tick(period: float, now: float | None = None) -> float:
    """Seconds from ``now`` (the loop's clock) to the next multiple of ``period`` on this
    process's grid. Why a grid rather than ``sleep(period)``: on an idle server each wake-up
    runs on cold caches (a read of the live replicas costs several times what it does back to
    back), and loops sleeping their own period drift apart into a wake-up each;
    loops on one grid whose periods divide each other wake together."""
    if now is None:
        now = asyncio.get_running_loop().time()
    return (math.floor((now - _PHASE_S) / period) + 1) * period + _PHASE_S - now


async def sleep_to_next_tick(period: float) -> None:
    """Sleep to the next tick of ``period`` on this process's grid (``until_next_tick``)."""
    await asyncio.sleep(until_next_tick(period))


@dataclass(frozen=True)
class LoopFailure:
    count: int  # failures since the component started
    error: str  # the latest one, shortened
    at: float  # monotonic time of the latest one


MIN_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
# A loop counts as failing while its latest failure is this recent: a loop that keeps failing
# fails again within its backoff, which is shorter.
FAILING_WINDOW_S = 60.0


class BackgroundLoops:
    """Loops written ``while loops.running: ...`` end on a flag as well as a cancel, and never
    die silently.

    The flag is what makes ``stop()`` reliable: a cancellation that lands inside a client
    library's call can be swallowed there, and a stop that only cancelled then waited forever
    on a loop that kept going (seen with the router's Redis refresh).

    A loop that raises is logged, counted and started again after a backoff that doubles up
    to ``MAX_BACKOFF_S``: a loop that died on one bad read used to leave its component frozen
    for good (the router's view of the replicas). ``failing()`` names the loops of the process
    that failed lately, for health and ``kvmesh status``.
    """

    def __init__(self) -> None:
        self.running = True
        self._tasks: list[asyncio.Task] = []
        self.failures: dict[str, LoopFailure] = {}  # loop name -> its latest failure
        _ALL.add(self)

    def start(self, loop: Callable[[], Coroutine], name: str) -> None:
        """Run ``loop()`` until ``stop``; if it raises, log it and call it again after a backoff."""
        self.running = True  # a component stopped and started again runs again
        self._tasks.append(asyncio.create_task(self._supervised(loop, name), name=name))

    async def _supervised(self, loop: Callable[[], Coroutine], name: str) -> None:
        backoff = MIN_BACKOFF_S
        while self.running:
            started = time.monotonic()
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # whatever it was, the loop must go on
                failure = self.failures.get(name)
                count = failure.count + 1 if failure else 1
                self.failures[name] = LoopFailure(
                    count, f"{type(exc).__name__}: {exc}"[:200], time.monotonic()
                )
                log.error(
                    "background loop failed, restarting",
                    exc_info=count == 1,  # the traceback once; then the line
                    extra={"loop": name, "failures": count, "retry_in_s": backoff},
                )
            if time.monotonic() - started > MAX_BACKOFF_S:
                backoff = MIN_BACKOFF_S  # it ran a good while before failing: not a crash loop
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF_S)

    def failing(self, within_s: float = FAILING_WINDOW_S) -> dict[str, str]:
        """Loops that failed in the last ``within_s`` seconds: name -> "N failures, last: why"."""
        now = time.monotonic()
        return {
            name: f"{f.count} failures, last: {f.error}"
            for name, f in self.failures.items()
            if now - f.at <= within_s
        }

    async def stop(self) -> None:
        self.running = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()


_ALL: weakref.WeakSet[BackgroundLoops] = weakref.WeakSet()


async def cancel(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (if any) and wait until it has ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def failing_loops() -> dict[str, str]:
    """Every loop of this process that failed lately (``BackgroundLoops.failing``)."""
    out: dict[str, str] = {}
    for loops in list(_ALL):
        out.update(loops.failing())
    return out
