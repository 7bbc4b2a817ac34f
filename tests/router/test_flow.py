"""Flow control (``router/flow.py``): who waits, in what order they leave, and when they are
refused, against a fleet whose saturation the test sets."""

import asyncio
import collections
import time

import pytest

from kvmesh.router.flow import FlowConfig, FlowControl, FlowKey, parse_bands
from kvmesh.router.metrics import RouterMetrics
from kvmesh.serving.errors import InvalidRequest, Overloaded
from kvmesh.serving.metrics import read_samples

pytestmark = pytest.mark.asyncio


class Fleet:
    """A fleet of ``slots`` requests at once: saturated while they are all taken, by requests
    running or let go and not yet routed (the router's rule)."""

    def __init__(self, slots: int):
        self.slots, self.running, self.flow = slots, 0, None

    async def saturated(self) -> bool:
        return self.running + self.flow.pending >= self.slots


def control(
    fleet: Fleet,
    bands: str = "high:100:30,normal:100:30,batch:100:30:sheddable",
    on_claims=lambda delta: None,
    **config,
) -> FlowControl:
    fleet.flow = FlowControl(
        FlowConfig(bands=bands, **config), fleet.saturated, RouterMetrics("m"), on_claims
    )
    return fleet.flow


def samples(flow: FlowControl) -> dict:
    return read_samples(flow.metrics.render().decode())


async def test_a_request_past_its_bands_ttl_is_refused_with_a_retry_after_and_never_runs():
    fleet = Fleet(0)  # saturated for good
    flow = control(fleet, bands="normal:10:0.2", tenants="acme")
    with pytest.raises(Overloaded, match=r"waited 0\.2 s") as refused:
        await flow.admit(FlowKey("acme"), 10)
    assert refused.value.retry_after_s >= 1 and fleet.running == 0
    shed = ("kvmesh_router_flow_shed_total", (("band", "normal"), ("reason", "ttl"), ("tenant", "acme")))
    assert samples(flow)[shed] == 1
    assert flow.queued == 0 and not flow._served and not flow._active  # nothing of it is kept


async def test_a_clients_deadline_shortens_the_wait_and_it_hears_why_before_it():
    flow = control(Fleet(0), bands="normal:10:30")
    started = time.monotonic()
    with pytest.raises(Overloaded, match="waited"):
        await flow.admit(FlowKey(), 10, deadline=started + 1.0)
    assert time.monotonic() - started < 1.0  # refused before the client's own deadline


async def test_a_higher_band_overtakes_a_lower_one():
    fleet = Fleet(1)
    flow = control(fleet)
    holder = await flow.admit(FlowKey(band="normal"), 10)  # it runs: the fleet is full now
    fleet.running = 1
    order = []

    async def one(name: str, band: str) -> None:
        admitted = await flow.admit(FlowKey(name, band), 10)
        fleet.running += 1
        flow.routed(admitted)
        order.append((name, admitted))

    tasks = [asyncio.create_task(one(f"low-{i}", "normal")) for i in (1, 2)]
    await asyncio.sleep(0.05)
    tasks.append(asyncio.create_task(one("urgent", "high")))
    await asyncio.sleep(0.05)
    assert order == [] and flow.queued == 3
    for running in range(3):
        fleet.running -= 1
        flow.end(order[-1][1] if order else holder, 10)
        while len(order) == running:
            await asyncio.sleep(0.005)
        assert len(order) == running + 1  # one at a time: the fleet has one slot
    await asyncio.gather(*tasks)
    assert [name for name, _ in order] == ["urgent", "low-1", "low-2"]


async def test_a_slot_handed_on_stays_claimed_from_its_release_until_the_next_request_is_routed():
    """Other routers must never see a slot free between one request's end and the routing of
    the request waiting for it: the claim begins in the call that ends the first (the loop
    turn of its load's release) and ends when the second is routed; a slot that turns out to
    have no room is no longer claimed once the dispatcher has looked."""
    fleet, changes = Fleet(1), []
    flow = control(fleet, on_claims=changes.append)
    holder = await flow.admit(FlowKey(), 10)
    fleet.running = 1
    flow.routed(holder)
    waiter = asyncio.create_task(flow.admit(FlowKey(), 10))
    await asyncio.sleep(0.01)
    assert flow.queued == 1 and changes == []  # admissions alone claim nothing
    fleet.running = 0
    flow.end(holder, 10)
    assert flow.claims == 1 and changes == [1]  # in the same call as the end
    successor = await waiter
    assert flow.claims == 1 and flow.pending == 1  # let go into the slot: it holds the claim
    fleet.running = 1
    flow.routed(successor)
    assert flow.claims == 0 and changes == [1, -1]
    third = asyncio.create_task(flow.admit(FlowKey(), 10))
    await asyncio.sleep(0.01)
    flow.end(successor, 10)  # the fleet stays saturated (fleet.running is still 1)
    assert flow.claims == 1
    await asyncio.sleep(0.01)
    assert flow.claims == 0 and changes == [1, -1, 1, -1] and flow.queued == 1
    third.cancel()
    await asyncio.gather(third, return_exceptions=True)


async def test_two_tenants_at_10_to_1_demand_get_equal_token_shares_while_both_wait():
    fleet = Fleet(2)
    flow = control(fleet, tenants="flood,steady")
    served = collections.Counter()
    stop = asyncio.Event()

    async def client(tenant: str, parallel: int) -> None:
        async def loop() -> None:
            while not stop.is_set():
                try:
                    admitted = await flow.admit(FlowKey(tenant), 50)
                except Overloaded:
                    continue
                fleet.running += 1
                flow.routed(admitted)
                await asyncio.sleep(0.01)
                served[tenant] += 100
                fleet.running -= 1
                flow.end(admitted, 100)

        await asyncio.gather(*(loop() for _ in range(parallel)))

    clients = [asyncio.create_task(client("flood", 20)), asyncio.create_task(client("steady", 2))]
    await asyncio.sleep(1.5)
    stop.set()
    await asyncio.gather(*clients)
    share = served["steady"] / (served["flood"] + served["steady"])
    assert 0.4 <= share <= 0.6, served  # within 20% of an equal share, at 10x less demand
    assert not flow._served and not flow._active  # counters live only while a tenant has work


async def test_sheddable_requests_go_first_when_urgent_work_has_to_wait():
    fleet = Fleet(0)
    flow = control(fleet)
    batch = asyncio.create_task(flow.admit(FlowKey("b", "batch"), 10))
    await asyncio.sleep(0.02)
    urgent = asyncio.create_task(flow.admit(FlowKey("u", "high"), 10))
    with pytest.raises(Overloaded, match="shed from priority band batch: a more urgent"):
        await batch
    fleet.slots = 1
    admitted = await urgent
    flow.end(admitted, 10)


async def test_a_full_band_refuses_its_heaviest_tenant_not_a_steady_one():
    flow = control(Fleet(0), bands="normal:2:30")
    flood = [asyncio.create_task(flow.admit(FlowKey("flood"), 10)) for _ in range(2)]
    await asyncio.sleep(0.02)
    with pytest.raises(Overloaded, match="full"):
        await flow.admit(FlowKey("flood"), 10)  # its own requests fill the band: it is refused
    steady = asyncio.create_task(flow.admit(FlowKey("steady"), 10))
    await asyncio.sleep(0.02)
    with pytest.raises(Overloaded, match="its tenant has the most requests waiting"):
        await flood[1]  # the flood's newest made room
    assert not steady.done() and flow.queued == 2
    for task in [flood[0], steady]:
        task.cancel()
    await asyncio.gather(flood[0], steady, return_exceptions=True)
    assert flow.queued == 0 and not flow._active


async def test_bad_keys_and_bands_are_clear_errors():
    flow = control(Fleet(1))
    with pytest.raises(
        InvalidRequest, match="priority: unknown band 'urgentest'; known: high, normal, batch"
    ):
        await flow.admit(FlowKey(band="urgentest"), 1)
    with pytest.raises(InvalidRequest, match="tenant"):
        await flow.admit(FlowKey("x" * 65), 1)
    for bad in ("high:10", "high:x:3", "high:10:3:urgent", "a:1:1,a:1:1", "b@d:1:1"):
        with pytest.raises(ValueError):
            parse_bands(bad)
    with pytest.raises(ValueError, match="default_band"):
        FlowConfig(bands="a:1:1", default_band="normal")
    assert FlowConfig().key({"x-kvmesh-tenant": "acme", "x-kvmesh-priority": "high"}) == FlowKey(
        "acme", "high"
    )
