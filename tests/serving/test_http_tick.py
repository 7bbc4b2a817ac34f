"""The HTTP server's tick (``SecondTickServer``): once a second, not uvicorn's ten, and never
in the way of an exit (a stop returns at once, not at the next tick)."""

import asyncio
import time

import httpx
import pytest

from kvmesh.serving.http_server import SecondTickServer, start_http_server

pytestmark = pytest.mark.servers


async def _hello(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hi"})


async def test_the_idle_server_ticks_once_a_second_and_keeps_its_date_header(monkeypatch):
    ticks = []
    real_tick = SecondTickServer.on_tick

    async def counted(self, counter):
        ticks.append(counter)
        return await real_tick(self, counter)

    monkeypatch.setattr(SecondTickServer, "on_tick", counted)
    server = await start_http_server(_hello, "127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            first = (await client.get("/")).headers["date"]
            await asyncio.sleep(2.5)
            later = (await client.get("/")).headers["date"]
    finally:
        await server.stop(grace=1)
    assert 2 <= len(ticks) <= 5, ticks  # uvicorn's own would tick ~25 times in 2.5 s
    assert all(counter % 10 == 0 for counter in ticks)  # each tick refreshes the Date header
    assert later != first  # ...so the header follows the clock


async def test_a_stop_does_not_wait_for_the_next_tick():
    server = await start_http_server(_hello, "127.0.0.1", 0)
    await asyncio.sleep(0.2)  # the server now sleeps until its next tick, ~0.8 s away
    began = time.perf_counter()
    await server.stop(grace=5)
    assert time.perf_counter() - began < 0.5
    assert server.task.done()
