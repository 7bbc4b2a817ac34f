"""One write timeout per response stream: a write that takes longer than it ends in
TimeoutError (about when it runs out), a stream of quick writes lasting longer than it does
not, and a cancellation from elsewhere stays a cancellation."""

import asyncio

import pytest

from kvmesh.serving.connections import WriteDeadline

pytestmark = pytest.mark.asyncio


async def test_a_write_that_hangs_times_out_when_its_time_runs_out():
    deadline = WriteDeadline(0.2)
    await asyncio.sleep(0.15)  # the stream's timer is mid-period when the write begins
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await deadline.write(asyncio.sleep(5))
    assert 0.19 <= loop.time() - started < 0.35
    deadline.close()


async def test_quick_writes_for_longer_than_the_timeout_never_time_out():
    deadline = WriteDeadline(0.1)
    for _ in range(60):  # ~0.3 s of writes of ~5 ms each
        await deadline.write(asyncio.sleep(0.005))
    deadline.close()


async def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    deadline = WriteDeadline(0.5)
    writer = asyncio.create_task(deadline.write(asyncio.sleep(5)))
    await asyncio.sleep(0.05)
    writer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writer
    deadline.close()


async def test_a_closed_deadline_leaves_no_timer_behind():
    deadline = WriteDeadline(0.05)
    deadline.close()
    await asyncio.sleep(0.12)
    assert deadline._timer.cancelled()
