"""The fastest event loop the platform has, for the servers whose loop carries every request:
uvloop where it is installed (Linux, macOS; a dependency there), asyncio's own elsewhere.
gRPC's asyncio API and uvicorn both run on it (one loop per process, made before any channel)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Any:
    """uvloop's loop maker, or None (asyncio's default)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the fastest loop (``loop_name`` says which one ran)."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


def loop_name() -> str:
    """The running loop's maker: "uvloop" or "asyncio"."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]
