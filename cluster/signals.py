"""Waiting for the signal that stops a serving command (Ctrl-C, Kubernetes' SIGTERM)."""

from __future__ import annotations

import asyncio
import signal


async def wait_for_signal() -> None:
    """Until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
