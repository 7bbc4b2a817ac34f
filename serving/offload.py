"""CPU work sized by its request: small inline, large in a thread, so one big request (a
long prompt, a large chat to render, a megabyte body to parse) never stalls every other
stream on the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
# Requests up to this many bytes (or characters) are handled inline: a thread hop costs more.
INLINE_BYTES = 8192
# At most one thread per core but one: the event loop keeps a core, so a burst of large
# requests never holds up the other requests' decisions and relays.
_THREADS = concurrent.futures.ThreadPoolExecutor(
    max_workers=max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="kvmesh-offload"
)


async def sized(size: int, fn: Callable[..., T], *args) -> T:
    """``fn(*args)``: inline when ``size`` (of the whole request) is small, else in a thread
    (tokenizers release the GIL; parsing and rendering let the loop in between)."""
    if size <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_THREADS, functools.partial(fn, *args))
