"""Connections held open against the router's HTTP port for ``kvmesh bench soak --hostile``:
idle ones that never send a byte, and slowloris ones that send a header line every few
seconds and never end their head. Each is opened again as soon as the server drops it, for
the whole run, so the server holds as many as it lets them hold; it must drop each within
its bounds (the idle timeout, the head timeout, with a 408 for a head). Recorded: how many
were opened, what the server answered, how long each lived."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from urllib.parse import urlsplit

KINDS = ("idle", "slowloris")
LINE_EVERY_S = 3.0  # a slowloris connection's pace: a line well within any head timeout
CONNECT_TIMEOUT_S = 10.0
REOPEN_AFTER_S = 0.2  # a dropped connection's slot waits this long: a refusing server is not flooded


@dataclass
class HeldLog:
    opened: Counter = field(default_factory=Counter)
    connect_failures: Counter = field(default_factory=Counter)
    answers: Counter = field(default_factory=Counter)  # "kind: status the server sent, or none"
    lived_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def report(self) -> dict:
        return {
            kind: {
                "opened": self.opened[kind],
                "connect_failures": self.connect_failures[kind],
                "answers": {k.split(": ", 1)[1]: n for k, n in self.answers.items() if k.startswith(kind)},
                "dropped": len(self.lived_s[kind]),
                "lived_median_s": round(statistics.median(self.lived_s[kind]), 2)
                if self.lived_s[kind]
                else None,
                "lived_max_s": round(max(self.lived_s[kind]), 2) if self.lived_s[kind] else None,
            }
            for kind in KINDS
            if self.opened[kind] or self.connect_failures[kind]
        }

    def longest_lived_s(self) -> float:
        return max((max(lived) for lived in self.lived_s.values() if lived), default=0.0)


def hold_open(
    http_url: str, idle: int, slowloris: int, stop: asyncio.Event, log: HeldLog
) -> list[asyncio.Task]:
    """``idle`` and ``slowloris`` connections to ``http_url`` (loopback only), each opened
    again when dropped, until ``stop``."""
    parts = urlsplit(http_url)
    if parts.hostname != "127.0.0.1":
        raise ValueError(f"held-open connections go to 127.0.0.1 only, not {parts.hostname}")
    counts = {"idle": idle, "slowloris": slowloris}
    return [
        asyncio.create_task(_slot(parts.port, kind, stop, log)) for kind in KINDS for _ in range(counts[kind])
    ]


async def _slot(port: int, kind: str, stop: asyncio.Event, log: HeldLog) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            log.connect_failures[kind] += 1
            await _pause(stop, 1.0)
            continue
        log.opened[kind] += 1
        opened_at = loop.time()
        try:
            status = await _until_dropped(reader, writer, kind == "slowloris", stop)
        finally:
            writer.close()
        if status is not None:
            log.lived_s[kind].append(loop.time() - opened_at)
            log.answers[f"{kind}: {status}"] += 1
        await _pause(stop, REOPEN_AFTER_S)


async def _until_dropped(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slow: bool, stop: asyncio.Event
) -> str | None:
    """Hold the connection until the server ends it (then the status it sent, or "none") or
    the run does (None)."""
    if slow:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: soak\r\n")
    received, lines = b"", 0
    while not stop.is_set():
        try:
            chunk = await asyncio.wait_for(reader.read(4096), LINE_EVERY_S)
        except TimeoutError:
            if slow:
                lines += 1
                writer.write(b"X-Slow-%d: a\r\n" % lines)
            continue
        except ConnectionError:
            chunk = b""
        if not chunk:
            status = received.split(b" ", 2)[1:2]
            return status[0].decode("ascii", "replace") if status else "none"
        received = (received + chunk)[:64]
    return None


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
