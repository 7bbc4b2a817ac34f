"""Periodic loops wake on one grid per process (``serving/background.py``): loops whose periods
divide each other share their wake-ups, where loops sleeping their own period drift apart."""

import asyncio
import random

import pytest

from kvmesh.serving.background import sleep_to_next_tick, until_next_tick


def test_the_next_tick_is_within_a_period_and_on_one_grid_for_every_period():
    rng = random.Random(7)
    for _ in range(2000):
        now = rng.uniform(0, 1e6)
        for period in (0.1, 0.5, 1.0, 2.0):
            wait = until_next_tick(period, now)
            assert 0 < wait <= period * (1 + 1e-9)
        # The next whole-second tick is a half-second tick too: the later of the two loops
        # finds the earlier one's tick, never one of its own in between.
        second = now + until_next_tick(1.0, now)
        half = now + until_next_tick(0.5, now)
        assert half == pytest.approx(second, abs=1e-6) or half + until_next_tick(0.5, half) == pytest.approx(
            second, abs=1e-6
        )
    # Every moment inside one tick's interval waits for the same tick.
    tick = 100.0 + until_next_tick(1.0, 100.0)
    for now in (tick - 0.999, tick - 0.5, tick - 0.001):
        assert now + until_next_tick(1.0, now) == pytest.approx(tick, abs=1e-6)


async def _wakes(sleep, period: float, work_s: float, start_after: float, count: int) -> list[float]:
    """When a loop that works ``work_s`` a turn wakes, ``count`` times."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(start_after)
    times = []
    for _ in range(count):
        await sleep(period)
        times.append(loop.time())
        await asyncio.sleep(work_s)  # its turn's work (a Redis round trip, say)
    return times


async def test_loops_on_the_grid_wake_together_where_plain_sleeps_drift_apart():
    async def apart(period, work_s, start_after):
        return await _wakes(asyncio.sleep, period, work_s, start_after, round(0.6 / period))

    async def on_grid(period, work_s, start_after):
        return await _wakes(sleep_to_next_tick, period, work_s, start_after, round(0.6 / period))

    for loops, together in ((on_grid, True), (apart, False)):
        fast, slow = await asyncio.gather(loops(0.05, 0.001, 0), loops(0.1, 0.012, 0.013))
        # Each of the slow loop's wakes, against the nearest wake of the fast one (which
        # wakes until after the slow one's last).
        gaps = [min(abs(t - f) for f in fast) for t in slow[:-1]]
        if together:
            assert max(gaps) < 0.004, gaps
        else:
            assert max(gaps) > 0.008, gaps
