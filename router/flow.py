"""Flow control at the router: while the fleet is saturated, requests wait here, in one
queue per priority band, rather than on the replicas, and leave in an order that is the
operator's, not the fastest client's.

- **Who and how urgent.** A request's ``FlowKey`` is its tenant (a header or gRPC metadata
  key, else "default") and its band (a named priority, highest first; the last bands may be
  ``sheddable``). The front ends set it (``FLOW_KEY``) before the core routes the request.
- **When it waits.** Only while the fleet is saturated (``saturated()``, the router's: no
  replica has a free running slot under its queue-delay limit, once the requests let go and
  not yet routed, ``pending``, are counted), or while requests of its band or a higher one
  wait already (no overtaking by a lucky arrival).
- **Slots handed on.** A routed request that ends while requests wait leaves its slot to
  them (``kept``) until the dispatcher looks; the request let go into it holds the claim
  until it is routed. These are the router's ``claims``: room it is about to fill that no
  replica carries yet. ``on_claims`` shares each change in the loop turn of the ended
  request's release (and of the successor's reservation), so other routers, which count
  claims against the room they see, never see the slot free in between.
- **In what order it leaves.** By band, highest first; within a band, the tenant served the
  fewest tokens so far (a virtual token counter, VTC: each dispatch charges the request's
  estimated tokens, its end corrects them to the tokens it was served; a tenant that comes
  back after being idle starts at the least counter among those waiting, so idleness is not
  banked). Counters live only while a tenant has requests waiting or running: no tenant name
  a client chooses stays in memory after its requests, and metric labels are the configured
  tenants' (others count as "other").
- **How long.** Each band has a size and a TTL; a request past its TTL or its client's
  deadline, or arriving at a full band, is refused RESOURCE_EXHAUSTED / 429 with a
  Retry-After without reaching a replica; at a full band, the tenant with the most requests
  waiting there loses its newest instead, unless that is the newcomer's own. Sheddable bands
  go first: each request of a higher band that has to wait sheds the newest waiting request
  of the lowest sheddable band that has one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from kvmesh.router.metrics import RouterMetrics
from kvmesh.serving.errors import InvalidRequest, Overloaded, shown
from kvmesh.serving.options import option

log = logging.getLogger(__name__)
MAX_TENANT_CHARS = 64  # a client's tenant name, at most
_CHECK_S = 0.05  # while requests wait, how often the fleet's saturation is looked at again
_DEADLINE_MARGIN_S = 0.5  # a waiting request is refused this long before its client's deadline


@dataclass(frozen=True)
class Band:
    """A priority band: its name, how many requests may wait in it, for how long at most."""

    name: str
    max_queued: int = 1024
    ttl_s: float = 30.0
    sheddable: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"a band's name is letters, digits, - and _, got {self.name!r}")
        if self.max_queued < 0 or self.ttl_s <= 0:
            raise ValueError(f"band {self.name}: max_queued must be >= 0 and ttl_s > 0")


DEFAULT_BANDS = "high:256:30,normal:1024:30,batch:1024:120:sheddable"


def parse_bands(spec: str) -> tuple[Band, ...]:
    """``NAME:MAX_QUEUED:TTL_S[:sheddable],...``, highest priority first."""
    bands = []
    for part in spec.split(","):
        name, *rest = part.strip().split(":")
        if len(rest) not in (2, 3) or (len(rest) == 3 and rest[2] != "sheddable"):
            raise ValueError(f"a band is NAME:MAX_QUEUED:TTL_S[:sheddable], got {part!r}")
        try:
            bands.append(Band(name, int(rest[0]), float(rest[1]), len(rest) == 3))
        except ValueError as exc:
            raise ValueError(f"band {part!r}: {exc}") from None
    if len({b.name for b in bands}) != len(bands):
        raise ValueError(f"band names must differ, got {spec!r}")
    return tuple(bands)


@dataclass(frozen=True)
class FlowConfig:
    flow_control: str = option(
        "on",
        choices=("on", "off"),
        help="on: requests wait at the router while the fleet is saturated (priority bands, fair "
        "shares); off: every request goes to a replica at once, to queue in its engine",
    )
    bands: str = option(
        DEFAULT_BANDS,
        flag="priority-bands",
        help="priority bands, highest first: NAME:MAX_WAITING:TTL_S[:sheddable],... (flow control, "
        "docs/operations.md)",
    )
    default_band: str = option("normal", help="the band of a request that names none")
    priority_header: str = option(
        "x-kvmesh-priority", help="HTTP header / gRPC metadata key naming a request's band"
    )
    tenant_header: str = option(
        "x-kvmesh-tenant", help="HTTP header / gRPC metadata key naming a request's tenant (else: default)"
    )
    tenants: str = option(
        "", help="comma-separated tenants counted under their own name in metrics (others: other)"
    )
    max_queue_delay_s: float = option(
        2.0,
        flag="max-queue-delay",
        help="a replica takes no more requests from flow control while its estimated queue delay is "
        "over this many seconds (nor while its running slots, --max-num-seqs, are all taken); with "
        "no replica taking one, requests wait at the router",
    )

    def __post_init__(self) -> None:
        names = {b.name for b in parse_bands(self.bands)}
        if self.default_band not in names:
            raise ValueError(
                f"default_band {self.default_band!r} is not one of the bands ({', '.join(names)})"
            )
        if self.max_queue_delay_s <= 0:
            raise ValueError(f"max_queue_delay_s must be positive, got {self.max_queue_delay_s}")

    def tenant_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.tenants.split(",") if t.strip())

    def key(self, headers: Mapping[str, str]) -> FlowKey:
        """The flow key a request's headers (or gRPC metadata, lower-cased keys) give."""
        return FlowKey(headers.get(self.tenant_header) or "default", headers.get(self.priority_header) or "")


@dataclass(frozen=True)
class FlowKey:
    tenant: str = "default"
    band: str = ""  # empty: the default band


# Set by the front ends for the request they hand the core (None: the default key); a context
# variable, so the OpenAI app the replicas share need not carry it through their path.
FLOW_KEY: contextvars.ContextVar[FlowKey | None] = contextvars.ContextVar("kvmesh_flow_key", default=None)


@dataclass(eq=False)
class Flow:
    """One request's place in flow control, from admission to its end."""

    tenant: str
    band: int  # its index in the bands, 0 highest
    cost: int  # tokens charged at dispatch (an estimate), corrected at the end
    enqueued_at: float = 0.0
    ready: asyncio.Future | None = None
    shed: str = ""  # why it was pushed out of its queue, if it was
    running: bool = False  # dispatched and not yet ended
    routed: bool = False  # its load is on its replica (no longer ``pending``)
    handed: bool = False  # let go into a slot another request of this router left (a claim)


@dataclass
class _BandQueue:
    band: Band
    waiting: dict[str, collections.deque] = field(default_factory=dict)  # tenant -> its flows, oldest first
    size: int = 0


class FlowControl:
    """``saturated()``: whether a request that arrives now should wait (the fleet's room,
    less the ``pending`` requests about to take some of it)."""

    def __init__(
        self,
        config: FlowConfig,
        saturated: Callable[[], Awaitable[bool]],
        metrics: RouterMetrics,
        on_claims: Callable[[int], None] = lambda delta: None,
    ):
        self.bands = parse_bands(config.bands)
        self.by_name = {b.name: i for i, b in enumerate(self.bands)}
        self.default_band = self.by_name[config.default_band]
        self.tenants = frozenset(config.tenant_names())  # the ones with metric labels of their own
        self.saturated = saturated
        self.metrics = metrics
        self._queues = [_BandQueue(b) for b in self.bands]
        self._served: dict[str, float] = {}  # tenant -> its virtual token counter (waiting or running only)
        self._active: collections.Counter = collections.Counter()  # tenant -> requests waiting or running
        self._wake = asyncio.Event()
        # Requests let go and not yet routed: their replicas are not chosen yet, so a
        # saturation check counts them against the fleet's free room (``saturated``'s).
        self.pending = 0
        self.kept = 0  # slots this router's ended requests left to the ones waiting, not yet given
        self.claims = 0  # kept slots, and requests let go into one and not yet routed
        self.on_claims = on_claims  # called with each change of ``claims``
        self._dispatcher: asyncio.Task | None = None

    def label(self, tenant: str) -> str:
        return tenant if tenant in self.tenants else "other"

    def key_band(self, key: FlowKey) -> int:
        """The band a key names; InvalidRequest naming the known ones for an unknown name."""
        if not key.band:
            return self.default_band
        if key.band not in self.by_name:
            known = ", ".join(self.by_name)
            raise InvalidRequest(
                f"priority: unknown band {shown(key.band)}; known: {known}", param="priority"
            )
        return self.by_name[key.band]

    @property
    def queued(self) -> int:
        return sum(q.size for q in self._queues)

    async def admit(self, key: FlowKey, cost: int, deadline: float | None = None) -> Flow:
        """A place for one request: at once while the fleet has room, else after waiting its
        turn. Overloaded (429, Retry-After) when its band is full, or it waited past the band's
        TTL or its client's ``deadline`` (monotonic seconds), or it was shed."""
        if len(key.tenant) > MAX_TENANT_CHARS:
            raise InvalidRequest(f"tenant: at most {MAX_TENANT_CHARS} characters", param="tenant")
        flow = Flow(key.tenant, self.key_band(key), max(1, cost))
        self._active[flow.tenant] += 1
        try:
            if any(q.size for q in self._queues[: flow.band + 1]) or await self.saturated():
                await self._wait(flow, deadline)
            else:
                self._start(flow)
            return flow
        except BaseException:
            if flow.running:  # dispatched as it was cancelled: it ends here
                self.end(flow, 0)
            else:
                self._dequeue(flow)
                self._forget(flow.tenant)
            raise

    def routed(self, flow: Flow) -> None:
        """The request's load is on its replica now (the next saturation check sees it)."""
        if flow.running and not flow.routed:
            flow.routed = True
            self.pending -= 1
            if flow.handed:
                self._claim(-1)

    def end(self, flow: Flow, served_tokens: int | None) -> None:
        """The request ended: its tenant's counter corrected to the tokens it was served (None:
        unknown, the estimate stands); the next waiting request may go."""
        if served_tokens is not None and flow.tenant in self._served:
            self._served[flow.tenant] += served_tokens - flow.cost
        if flow.routed and flow.running and self.queued:
            self.kept += 1  # its slot goes to the next waiting request
            self._claim(1)
        self.routed(flow)
        flow.running = False
        self._forget(flow.tenant)
        self._wake.set()

    # ------------------------------------------------------------------ waiting

    async def _wait(self, flow: Flow, deadline: float | None) -> None:
        spec = self.bands[flow.band]
        label = (spec.name, self.label(flow.tenant))
        queue = self._queues[flow.band]
        if queue.size >= spec.max_queued and not self._shed_heaviest(queue, flow.tenant):
            self.metrics.flow_shed.labels(*label, "full").inc()
            raise Overloaded(
                f"priority band {spec.name} is full ({spec.max_queued} waiting); retry later",
                retry_after_s=_retry_after(spec),
            )
        self._enqueue(flow)
        if not spec.sheddable:
            self._shed_one()  # sheddable work yields to any urgent request that must wait
        # Refused a little before the client's deadline, so that it hears why (a 429, not its
        # own deadline passing).
        limit = (
            spec.ttl_s
            if deadline is None
            else min(spec.ttl_s, deadline - time.monotonic() - _DEADLINE_MARGIN_S)
        )
        self.metrics.flow_queued.labels(*label).inc()
        try:
            await asyncio.wait_for(asyncio.shield(flow.ready), max(0.0, limit))
        except TimeoutError:
            self.metrics.flow_shed.labels(*label, "ttl").inc()
            raise Overloaded(
                f"waited {limit:.1f} s in priority band {spec.name} and the fleet is still saturated; retry later",
                retry_after_s=_retry_after(spec),
            ) from None
        finally:
            self.metrics.flow_waited.labels(*label).observe(time.monotonic() - flow.enqueued_at)
        if flow.shed:
            self.metrics.flow_shed.labels(*label, "shed").inc()
            raise Overloaded(flow.shed, retry_after_s=_retry_after(spec))

    def _enqueue(self, flow: Flow) -> None:
        queue = self._queues[flow.band]
        if flow.tenant not in queue.waiting:  # back from idle: no credit banked (VTC's lift)
            floor = min((self._served.get(t, 0.0) for t in queue.waiting), default=0.0)
            self._served[flow.tenant] = max(self._served.get(flow.tenant, 0.0), floor)
        flow.enqueued_at = time.monotonic()
        flow.ready = asyncio.get_running_loop().create_future()
        queue.waiting.setdefault(flow.tenant, collections.deque()).append(flow)
        queue.size += 1
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.create_task(self._dispatch(), name="kvmesh-flow-dispatch")
        self._wake.set()

    def _dequeue(self, flow: Flow) -> None:
        queue = self._queues[flow.band]
        flows = queue.waiting.get(flow.tenant)
        if flows is not None and flow in flows:
            flows.remove(flow)
            queue.size -= 1
            if not flows:
                del queue.waiting[flow.tenant]

    def _shed_heaviest(self, queue: _BandQueue, tenant: str) -> bool:
        """Room in a full band made at the expense of the tenant with the most requests
        waiting in it (its newest is refused), unless that is ``tenant`` itself: a flood
        fills a band with its own requests, and they, not a steady tenant's, go."""
        heaviest = max(queue.waiting, key=lambda t: len(queue.waiting[t]), default=None)
        if heaviest is None or len(queue.waiting[heaviest]) <= len(queue.waiting.get(tenant, ())):
            return False
        self._push_out(queue, queue.waiting[heaviest][-1], "its tenant has the most requests waiting")
        return True

    def _push_out(self, queue: _BandQueue, flow: Flow, why: str) -> None:
        self._dequeue(flow)
        flow.shed = f"shed from priority band {queue.band.name}: {why}; retry later"
        flow.ready.set_result(None)

    def _shed_one(self) -> None:
        """The newest waiting request of the lowest sheddable band that has one, refused."""
        for queue in reversed(self._queues):
            if queue.band.sheddable and queue.size:
                newest = max((q[-1] for q in queue.waiting.values()), key=lambda f: f.enqueued_at)
                self._push_out(queue, newest, "a more urgent request has to wait")
                return

    # ------------------------------------------------------------------ leaving

    async def _dispatch(self) -> None:
        """While requests wait: the next one goes whenever the fleet is not saturated."""
        try:
            while self.queued:
                self._wake.clear()
                try:
                    room = not await self.saturated()
                except Exception:  # the check failed (the index away): let one go, as if not saturated
                    log.warning("flow control: the saturation check failed", exc_info=True)
                    room = True
                flow = self._next() if room else None
                if flow is not None:
                    self._dequeue(flow)
                    self._start(flow)
                    flow.ready.set_result(None)
                    continue  # it is pending: the next check counts it
                self._drop_kept()  # no room after all
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), _CHECK_S)
        finally:
            self._drop_kept()  # nobody waits for them

    def _next(self) -> Flow | None:
        """The highest band's waiting request whose tenant has been served the least; on a
        tie (a tenant back from idle is lifted to the least counter), the tenant with fewer
        requests waiting, then the oldest request."""
        for queue in self._queues:
            if queue.size:
                tenant = min(queue.waiting, key=lambda t: self._order(queue, t))
                return queue.waiting[tenant][0]
        return None

    def _order(self, queue: _BandQueue, tenant: str) -> tuple[float, int, float]:
        flows = queue.waiting[tenant]
        return self._served.get(tenant, 0.0), len(flows), flows[0].enqueued_at

    def _start(self, flow: Flow) -> None:
        """It goes: its tenant is charged its estimated tokens now (corrected at its end); it
        counts as ``pending`` until it is routed."""
        flow.running = True
        self.pending += 1
        if self.kept:  # it takes a kept slot, and its claim
            self.kept -= 1
            flow.handed = True
        self._served[flow.tenant] = self._served.get(flow.tenant, 0.0) + flow.cost

    def _drop_kept(self) -> None:
        if self.kept:
            self._claim(-self.kept)
            self.kept = 0

    def _claim(self, delta: int) -> None:
        self.claims += delta
        self.on_claims(delta)

    def _forget(self, tenant: str) -> None:
        self._active[tenant] -= 1
        if self._active[tenant] <= 0:
            del self._active[tenant]
            self._served.pop(tenant, None)


def _retry_after(band: Band) -> float:
    """What a refused client is told to wait: a quarter of its band's TTL, at least a second."""
    return max(1.0, band.ttl_s / 4)
