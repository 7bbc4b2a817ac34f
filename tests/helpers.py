"""Small shared test helpers."""

import asyncio
import time


async def eventually(predicate, timeout: float = 10.0) -> bool:
    """Poll an async predicate until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.05)
    return False
