"""The router's view of the replicas: who is live (from the index), how to reach them, and
how much work this router has in flight on each.

The live set is refreshed in the background. A replica leaves it when its heartbeat
expires (the index says so; its calls end then, see ``_went_silent``) or, for a few seconds,
after a call to it failed. When Redis is unreachable the last known set is kept (its
heartbeats cannot be read) and only failed calls take replicas out; routing falls back to
load (no prefix matches).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import HealthStub

from kvmesh.kvcache.index.api import FleetWork, PrefixIndex, ReplicaRecord
from kvmesh.kvcache.index.redis import INDEX_ERRORS
from kvmesh.protos import pb_grpc
from kvmesh.router.metrics import ReplicaGauges, engine_label, heartbeat_age
from kvmesh.router.policies import DEFAULT_STEP_TOKENS, ReplicaState
from kvmesh.router.pricing import FleetPrices, MeasuredReplica
from kvmesh.router.replica_http import CLOSED, ReplicaHttp
from kvmesh.router.replica_load import ReplicaLoad, RequestWork
from kvmesh.router.share_alarm import Change, ShareAlarm
from kvmesh.router.shared_load import FleetLoad
from kvmesh.serving.auth import bearer_metadata
from kvmesh.serving.background import BackgroundLoops, sleep_to_next_tick
from kvmesh.serving.grpc_server import MAX_MESSAGE_BYTES
from kvmesh.serving.step_costs import (
    PRIOR,
    PRIOR_RESTORE_BLOCK_S,
    StepCosts,
    measured_costs,
    measured_restore,
)
from kvmesh.serving.tls import TLSConfig, open_channel

log = logging.getLogger(__name__)
# How long a replica whose heartbeat ran out has to answer a health check before its calls end.
PROBE_S = 1.0
# What a read of the live replicas may take: a heartbeat TTL this close to running out when a
# read does not list its replica ran out meanwhile.
READ_LATENCY_S = 0.25


@dataclass
class ReplicaEntry:
    record: ReplicaRecord
    channel: grpc.aio.Channel
    stub: pb_grpc.ReplicaStub
    live_until: float  # monotonic time its heartbeat expires, as of the last refresh
    auth: tuple[tuple[str, str], ...] = ()  # metadata every call to it carries (its bearer token)
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    failed_until: float = 0.0
    costs: StepCosts | None = None  # its measured step costs, as of its last heartbeat (None: not yet)
    priced: StepCosts = PRIOR  # what the policy prices it at (``router/pricing.py``)
    restore_block_s: float | None = None  # its measured restore of a host block (None: not yet)
    restore_priced: float = PRIOR_RESTORE_BLOCK_S  # what the policy prices that restore at
    step_tokens: int = DEFAULT_STEP_TOKENS  # its chunked-prefill budget, from its record
    http: ReplicaHttp | None = None  # its OpenAI port, where the router can reach it (SSE relay)
    closed_because: str = ""  # why it was closed under its calls: what their errors say
    probing: bool = False  # a health check is on its channel: nothing else may close it meanwhile

    async def close(self, because: str = CLOSED) -> None:
        """Close its channel and connections; calls still on them end (``relay.py`` moves
        those that had no answer yet)."""
        self.closed_because = because
        await self.channel.close()
        if self.http is not None:
            self.http.close(because)


class ReplicaRegistry:
    def __init__(
        self,
        index: PrefixIndex,
        refresh_s: float = 1.0,
        failure_cooldown_s: float = 5.0,
        tls: TLSConfig | None = None,
        fleet: FleetLoad | None = None,
        replica_token: str | None = None,
        prices: FleetPrices | None = None,
        alarm: ShareAlarm | None = None,
    ):
        self.index = index
        self.auth = bearer_metadata(replica_token)
        self.fleet = fleet  # with shared load: every router's in-flight work, through the index
        self.tls = tls
        self.refresh_s = refresh_s
        self.failure_cooldown_s = failure_cooldown_s
        self.prices = prices or FleetPrices()
        self.alarm = alarm or ShareAlarm()
        self.alarm_listeners: list = []  # called with each ``Change`` of the share alarm
        self.entries: dict[str, ReplicaEntry] = {}
        self._retired: list[ReplicaEntry] = []  # gone from the index, calls still in flight
        self._probes: set[asyncio.Task] = set()  # health checks of replicas whose heartbeat ran out
        self._https = tls.client_ssl_context() if tls else None
        self.index_problem = "index not read yet"  # "" while the index can be trusted to list replicas
        self._back_until = 0.0  # after the index returns: replicas it does not list yet are kept until then
        self._read_at = 0.0  # monotonic time of the last successful read of the live replicas
        self._loops = BackgroundLoops()
        self._listeners: list = []

    async def start(self) -> None:
        await self.refresh()
        self._loops.start(self._refresh_loop, "kvmesh-registry")

    async def stop(self) -> None:
        await self._loops.stop()
        for probe in list(self._probes):
            probe.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        for entry in [*self.entries.values(), *self._retired]:
            await entry.close()
        self.entries.clear()
        self._retired.clear()

    def on_change(self, callback) -> None:
        """``callback(live_count)`` after every refresh (health status follows it)."""
        self._listeners.append(callback)

    async def _refresh_loop(self) -> None:
        while self._loops.running:
            await sleep_to_next_tick(self.refresh_s)
            await self.refresh()

    async def refresh(self) -> None:
        try:
            records = await self.index.live_replicas()
        except INDEX_ERRORS as exc:  # Redis away: keep the last known set
            if self.index_ok:
                log.warning("prefix index unreachable: routing by load only", extra={"error": str(exc)})
            self.index_problem = "index unreachable"
        else:
            if len(records) < len(self.entries) and not await self._index_has_settings():
                # Redis came back empty (a restart without persistence, a FLUSHALL): replicas
                # are not dead, they are about to re-register. Keep the last known set meanwhile.
                if self.index_ok:
                    log.warning("prefix index lost its data; replicas are resyncing")
                self.index_problem = "index lost its data"
            else:
                if not self.index_ok:
                    log.info("prefix index reachable", extra={"replicas": len(records)})
                    # Replicas re-register within a heartbeat of its return (the settings
                    # can be back before them): until then, one it does not list yet stays.
                    ttl = max((e.record.heartbeat_ttl_ms for e in self.entries.values()), default=0)
                    self._back_until = time.monotonic() + ttl / 1000
                self.index_problem = ""
                await self._apply(records)
        self._judge_shares()
        for callback in self._listeners:
            await callback(len(self.live()))

    def _judge_shares(self) -> None:
        for change in self.alarm.update((e.record.replica_id for e in self.live()), time.monotonic()):
            _log_alarm(change)
            for listener in self.alarm_listeners:
                listener(change)

    async def _index_has_settings(self) -> bool:
        try:
            return await self.index.has_settings()
        except INDEX_ERRORS:
            return False

    async def _apply(self, records: list[ReplicaRecord]) -> None:
        now = time.monotonic()
        on_time = now - self._read_at <= 1.5 * self.refresh_s  # see _went_silent
        self._read_at = now
        seen = set()
        for rec in records:
            seen.add(rec.replica_id)
            entry = self.entries.get(rec.replica_id)
            if entry is None or entry.record.address != rec.address:
                if entry is not None:
                    self._retired.append(entry)
                channel = open_channel(
                    rec.address, self.tls, [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
                )
                entry = ReplicaEntry(
                    rec,
                    channel,
                    pb_grpc.ReplicaStub(channel),
                    live_until=0.0,
                    auth=self.auth,
                    http=self._http_of(rec),
                )
                self.entries[rec.replica_id] = entry
            entry.record = rec
            entry.costs = measured_costs(rec.load)
            entry.restore_block_s = measured_restore(rec.load)
            entry.step_tokens = _step_tokens(rec)
            entry.live_until = now + rec.heartbeat_ttl_ms / 1000
        for gone in set(self.entries) - seen:
            if now < self._back_until:  # the index just came back: not re-registered yet
                self.entries[gone].live_until = self._back_until
                continue
            entry = self.entries.pop(gone)
            self._retired.append(entry)
            if on_time and entry.load.requests and _went_silent(entry, now):
                entry.probing = True
                self._probes.add(asyncio.create_task(self._end_if_silent(entry), name=f"kvmesh-probe-{gone}"))
        prices = self.prices.update((_measured(e) for e in self.entries.values()), now)
        # a replica that has not measured a restore yet: the median of those that have
        measured = [e.restore_block_s for e in self.entries.values() if e.restore_block_s is not None]
        restore_s = statistics.median(measured) if measured else PRIOR_RESTORE_BLOCK_S
        for rid, entry in self.entries.items():
            entry.priced = prices[rid]
            entry.restore_priced = restore_s if entry.restore_block_s is None else entry.restore_block_s
        await self._close_idle_retired()

    async def _end_if_silent(self, entry: ReplicaEntry) -> None:
        """A replica whose heartbeat ran out: if it does not answer a health check within
        ``PROBE_S`` either (stopped, hung, gone) its calls end now, and those that had no
        answer yet move to another replica (``relay.py``); one that answers SERVING lost only
        the index (a Redis hiccup), and its streams go on."""
        try:
            reply = await HealthStub(entry.channel).Check(HealthCheckRequest(), timeout=PROBE_S)
            serving = reply.status == HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            serving = False
        finally:
            entry.probing = False
            self._probes.discard(asyncio.current_task())
        if serving or entry not in self._retired:
            return
        rid = entry.record.replica_id
        log.warning("replica went silent: its calls end", extra={"replica_id": rid})
        self._retired.remove(entry)
        await entry.close(f"{rid} went silent: its heartbeat expired and it did not answer a health check")

    async def _close_idle_retired(self) -> None:
        """Close a departed replica's channel only once its calls are done: closing it under
        a call cancels the call, which would surface as a cancelled client request (and under
        a health check, grpc aborted the process)."""
        busy = []
        for entry in self._retired:
            if entry.load.requests or entry.probing:
                busy.append(entry)
            else:
                await entry.close()
        self._retired = busy

    def _http_of(self, record: ReplicaRecord) -> ReplicaHttp | None:
        """The replica's OpenAI port, if it serves one the router can reach and verify."""
        url = record.fields.get("http_address", "")
        if url.startswith("http://") or (url.startswith("https://") and self._https is not None):
            return ReplicaHttp(url, self._https, self.tls.server_name if self.tls else None)
        return None

    @property
    def relays_http(self) -> bool:
        """Whether every live replica can take HTTP streams relayed byte for byte."""
        live = self.live()
        return bool(live) and all(e.http is not None for e in live)

    @property
    def index_ok(self) -> bool:
        return not self.index_problem

    def live(self) -> list[ReplicaEntry]:
        """Replicas a request may go to now."""
        now = time.monotonic()
        news_until = self._news_until(now)
        return [
            e
            for e in self.entries.values()
            if e.failed_until <= now and (e.live_until > news_until or not self.index_ok)
        ]

    def _news_until(self, now: float) -> float:
        """The time up to which this router has news of the fleet: now, unless its own reads
        fell behind (its event loop stalled, its process starved of CPU). A heartbeat TTL
        running out in that gap is this router's silence, not a replica's death: until the
        next read, the replicas live at the last one stay live."""
        return min(now, self._read_at + 2 * self.refresh_s)

    def states(
        self,
        matched: dict[str, int],
        fleet: dict[str, FleetWork] | None = None,
        tiered: dict[str, int] | None = None,
    ) -> list[ReplicaState]:
        """The live replicas as the policy sees them. ``fleet``: every router's in-flight
        work from the index (None: this router's own counts); ``tiered``: the blocks each
        holds counting its host tier."""
        now = time.monotonic()
        tiered = tiered or {}
        return [
            ReplicaState(
                replica_id=e.record.replica_id,
                matched_blocks=matched.get(e.record.replica_id, 0),
                tiered_blocks=tiered.get(e.record.replica_id, 0),
                restore_block_s=e.restore_priced,
                **self._inflight(e, fleet),
                recent_blocks=e.load.recent.value(now),
                num_running=int(e.record.load("num_running")),
                num_waiting=int(e.record.load("num_waiting")),
                costs=e.priced,
                step_tokens=e.step_tokens,
                share_alarm=e.record.replica_id in self.alarm.on,
            )
            for e in self.live()
        ]

    def _inflight(self, e: ReplicaEntry, fleet: dict[str, FleetWork] | None) -> dict[str, float]:
        if fleet is None or self.fleet is None or not self.fleet.active:
            return {
                "inflight_requests": e.load.requests,
                "inflight_prefill_blocks": e.load.prefill_blocks,
                "inflight_decode_blocks": e.load.decode_blocks,
            }
        rid = e.record.replica_id
        work, unsent = fleet.get(rid, FleetWork()), self.fleet.unsent(rid)
        return {
            "inflight_requests": round(work.requests + unsent.requests),
            "inflight_prefill_blocks": max(0.0, work.prefill_blocks + unsent.prefill_blocks),
            "inflight_decode_blocks": max(0.0, work.decode_blocks + unsent.decode_blocks),
        }

    def gauges(self) -> list[ReplicaGauges]:
        """The live replicas' heartbeat load, for the router's per-replica metrics."""
        rows = []
        for e in self.live():
            r = e.record
            blocks = r.load("num_blocks")
            usage = 1 - r.load("num_free_blocks") / blocks if blocks else 0.0
            age = heartbeat_age(r.load("heartbeat_at"))
            rate = r.load("tokens_per_s")
            rows.append(
                ReplicaGauges(
                    r.replica_id,
                    r.load("num_running"),
                    r.load("num_waiting"),
                    usage,
                    rate,
                    age,
                    e.load.requests,
                    share_alarm=r.replica_id in self.alarm.on,
                    engine=engine_label(r.fields.get("engine")),
                    hardware=r.fields.get("hardware", ""),
                )
            )
        return rows

    # Load accounting goes to the entry a call started on, which may be retired meanwhile.
    def begin(self, entry: ReplicaEntry, work: RequestWork) -> None:
        if self.fleet is not None:
            self.fleet.add(entry.record.replica_id, 1, work.prefill, work.decode)
        now = time.monotonic()
        entry.load.begin(work, now)
        self.alarm.record(entry.record.replica_id, work, now)

    def prefill_done(self, entry: ReplicaEntry, work: RequestWork) -> None:
        if self.fleet is not None:
            self.fleet.add(entry.record.replica_id, 0, -work.prefill, 0)
        entry.load.prefill_done(work)

    def end(self, entry: ReplicaEntry, work: RequestWork) -> None:
        if self.fleet is not None:
            self.fleet.add(entry.record.replica_id, -1, -work.prefill, -work.decode)
        entry.load.end(work)

    def mark_failed(self, replica_id: str) -> None:
        entry = self.entries.get(replica_id)
        if entry:
            entry.failed_until = time.monotonic() + self.failure_cooldown_s
            log.warning("replica call failed, cooling down", extra={"replica_id": replica_id})


def _went_silent(entry: ReplicaEntry, now: float) -> bool:
    """Whether a replica gone from a read left because its heartbeat ran out (it stopped,
    hung, or lost the index), not by deregistering with time left (a drain, or an engine that
    cannot serve and failed its own requests). Its calls would wait on it for nothing, unless
    it answers a health check (``_end_if_silent``). Asked only of a read on time (at most half a period late): a router that
    fell behind may have missed a drain's deregistration until that replica's TTL had run out
    too. ``READ_LATENCY_S``: a TTL that ran out while the read was on its way."""
    return entry.live_until <= now + READ_LATENCY_S


def _log_alarm(change: Change) -> None:
    shares = {
        "replica_id": change.replica_id,
        "request_share": round(change.request_share, 3),
        "prefill_share": round(change.prefill_share, 3),
        "fair_share": round(change.fair_share, 3),
    }
    if change.on:
        log.warning(
            "replica took far over its fair share: it gets no new prefixes until back under", extra=shares
        )
    else:
        log.info("replica back under its share alarm", extra=shares)


def _measured(entry: ReplicaEntry) -> MeasuredReplica:
    record = entry.record
    return MeasuredReplica(
        record.replica_id, record.fields.get("hardware", ""), entry.costs, record.load("cost_steps")
    )


def _step_tokens(record: ReplicaRecord) -> int:
    """A replica's chunked-prefill budget from its record (never trusted to be sane)."""
    tokens = int(record.load("max_num_batched_tokens", DEFAULT_STEP_TOKENS))
    return tokens if tokens > 0 else DEFAULT_STEP_TOKENS
