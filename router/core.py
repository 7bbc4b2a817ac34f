"""The routing path shared by the gRPC and HTTP front ends: admit -> decide -> relay.

admit (``admit``, by the front ends, before anything is built for a request): refuse while
draining or beyond the in-flight limit, a batch counted as its number of prompts; then wait
in flow control while the fleet is saturated (``flow.py``); decide (``decision.py``):
tokenize, hash, ONE index lookup, rank; relay (``relay.py``): stream from the first choice,
fail over once, move a stream cut midway, account for the work and the prediction.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable

import grpc

from kvmesh.kvcache.index.api import PrefixIndex
from kvmesh.kvcache.index.redis import INDEX_ERRORS
from kvmesh.protos import pb
from kvmesh.router.decision import Decider, Decision, RoutingOptions
from kvmesh.router.flow import FLOW_KEY, FlowControl, FlowKey
from kvmesh.router.index_trust.watch import IndexWatch
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.policies import PrefixAware, ReplicaState
from kvmesh.router.registry import ReplicaRegistry
from kvmesh.router.relay import FailedInBand, Relay, why_not_migratable
from kvmesh.router.shared_load import UNPLACED
from kvmesh.router.speculative import SpeculativeOverlay
from kvmesh.serving import tracing
from kvmesh.serving.admission import InflightLimit, Ticket
from kvmesh.serving.errors import Overloaded, Unavailable, upstream_error
from kvmesh.serving.http_server import DirectBody
from kvmesh.serving.limits import InputLimits
from kvmesh.serving.model_info import ModelInfo
from kvmesh.serving.openai.relay import SseRequest
from kvmesh.serving.request_ids import OwnedRequests
from kvmesh.serving.sampling_params import DEFAULT_MAX_TOKENS
from kvmesh.serving.tokenizer import PromptTokenizer

FLEET_VIEW_S = 0.05  # flow control reads the other routers' in-flight work at most this often


def estimated_tokens(request: pb.GenerateRequest) -> int:
    """What flow control charges a request's tenant when it goes, before it is tokenized:
    its prompt (token ids, or about four characters a token) and its max_tokens. Its end
    corrects the charge to the tokens it was served."""
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        prompt = len(request.token_ids.ids)
    elif kind == "chat":
        prompt = sum(len(m.content) for m in request.chat.messages) // 4
    else:
        prompt = len(request.text) // 4
    sampling = request.sampling
    return prompt + (sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS)


class RouterCore:
    def __init__(
        self,
        model: ModelInfo,
        tokenizer: PromptTokenizer | None,
        index: PrefixIndex,
        registry: ReplicaRegistry,
        options: RoutingOptions | None = None,
        metrics: RouterMetrics | None = None,
    ):
        options = options or RoutingOptions()
        self.model = model
        self.tokenizer = tokenizer
        self.registry = registry
        # This router's own speculative entries, seen at once; with shared load they also go
        # to the index for the other routers (which see them a round trip later).
        self.overlay = SpeculativeOverlay(ttl_s=options.speculative_ttl_s)
        self.metrics = metrics or RouterMetrics(model.api_name)
        self.limits = options.limits
        self.watch = IndexWatch(registry, index, self.metrics, model.block_size, options.index_trust)
        self.metrics.watch_replicas(registry.gauges, lambda: registry.index_ok)
        self.decider = Decider(
            model, tokenizer, (index, registry, self.overlay), self.metrics, options, self.watch.untrusted
        )
        self.relay = Relay(
            registry, self.overlay, self.metrics, model.block_size, self.watch, self.limits.migration_limit
        )
        self.flow = FlowControl(options.flow, self.saturated, self.metrics, self._share_claims)
        self._max_queue_delay_s = options.flow.max_queue_delay_s
        self._flow_control = options.flow.flow_control == "on"
        self._load_model = PrefixAware(block_size=model.block_size)  # what a replica's queue delay is
        # When the other routers' requests per replica were last read, and what they were.
        self._fleet_view: tuple[float, dict[str, int]] = (-1.0, {})
        self._fleet_lock = asyncio.Lock()
        self.draining = False  # set on shutdown: new requests get UNAVAILABLE
        self.inflight = InflightLimit(self.limits.max_inflight, "router")
        self.owned = OwnedRequests()  # the router's request ids, by client connection and client id

    @property
    def active(self) -> int:
        """Requests (and routes that tokenize or render) in flight through this router now."""
        return self.inflight.active

    def admit(self, count: int = 1, policy: str = "") -> Ticket:
        """Slots for a request before anything is built for it (a batch: one per prompt);
        UNAVAILABLE while draining, RESOURCE_EXHAUSTED beyond ``max_inflight``."""
        if self.draining:
            raise Unavailable("router is shutting down; retry on another router")
        try:
            return self.inflight.take(count)
        except Overloaded:
            self.count_overloaded(policy)
            raise

    def count_overloaded(self, policy: str) -> None:
        """A request refused for load (the in-flight limit, flow control), in the request metrics."""
        self.metrics.requests.labels(self.decider.known_policy(policy), "overloaded").inc()

    async def saturated(self) -> bool:
        """Whether the fleet has no room for one more request now: room is a running slot
        (``max_num_seqs``: beyond them a request queues in the engine) on a replica that
        would not keep a new request waiting past ``--max-queue-delay`` before its prefill
        (its queued work at its measured step costs, as the prefix policy prices it), less
        the requests flow control let go and not yet routed. This router's own requests are
        counted as they are now, the other routers' as the index last said (``_others``), so
        routers nearly agree (two may both take a slot that just freed). No live replica:
        not saturated (the decision says why it cannot route)."""
        if not self._flow_control:
            return False
        others = await self._others()
        claimed = self.flow.pending + others.get(UNPLACED, 0)  # the other routers' hand-offs too
        states = self.registry.states({})  # this router's own work, exact
        room = 0.0
        for own in states:
            extra = others.get(own.replica_id, 0)
            room += self._room(dataclasses.replace(own, inflight_requests=own.inflight_requests + extra))
            if room > claimed:
                return False
        return bool(states)

    def _share_claims(self, delta: int) -> None:
        """Flow control's claims on the fleet's room (``FlowControl.claims``), for the other
        routers' saturation checks: sent with this loop turn's other deltas."""
        if self.registry.fleet is not None:
            self.registry.fleet.add(UNPLACED, delta, 0, 0)

    def with_room_first(self, decision: Decision) -> None:
        """The decision's replicas with room (``_room``, from the states it ranked them by)
        first, each group in the policy's order: a replica whose running slots are all taken
        would queue the request in its engine behind the requests it runs, whatever prefix it
        holds (flow control let the request go because some replica had room)."""
        if not self._flow_control:
            return
        full = {s.replica_id for s in decision.states if not self._room(s)}
        if decision.ranked[0] in full:
            decision.ranked = [r for r in decision.ranked if r not in full] + [
                r for r in decision.ranked if r in full
            ]

    def _room(self, state: ReplicaState) -> float:
        """Requests ``state``'s replica takes at once: its free running slots, none where its
        queue is over the limit."""
        entry = self.registry.entries.get(state.replica_id)
        # A record is never trusted to be sane: a slot count under one reads as one.
        slots = max(1.0, entry.record.load("max_num_seqs", math.inf)) if entry else math.inf
        if self._load_model.load_seconds(state) > self._max_queue_delay_s:
            return 0.0
        return max(0.0, slots - state.inflight_requests)

    async def _others(self) -> dict[str, int]:
        """The other routers' requests in flight on each replica, and their flow control's
        claims (``UNPLACED``): every router's from the index (read at most every
        ``FLEET_VIEW_S``) less this router's own as sent there."""
        fleet = self.registry.fleet
        if fleet is None or not fleet.active:
            return {}
        async with self._fleet_lock:
            at, others = self._fleet_view
            if time.monotonic() - at >= FLEET_VIEW_S:
                with contextlib.suppress(*INDEX_ERRORS, TimeoutError):
                    view = await asyncio.wait_for(
                        self.decider.index.routing_view([]), self.decider.lookup_timeout_s
                    )
                    others = {
                        rid: max(0, round(work.requests - fleet.sent_requests(rid)))
                        for rid, work in view.fleet.items()
                    }
                self._fleet_view = (time.monotonic(), others)
            return others

    @property
    def inputs(self) -> InputLimits:
        return self.limits.inputs

    @property
    def default_policy(self) -> str:
        return self.decider.default_policy

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    async def prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        return await self.decider.prompt_ids(request)

    async def decide(self, request: pb.GenerateRequest) -> Decision:
        return await self.decider.decide(request)

    @property
    def relays_sse(self) -> bool:
        """Whether a streamed HTTP request goes to its replica's own OpenAI port now."""
        return self.registry.relays_http

    async def generate(
        self,
        request: pb.GenerateRequest,
        trace: object = None,
        timeout: float | None = None,
        owner: str = "",
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Route and stream an admitted request (``admit``). Raises ServingError before the
        first response; after it, too. Responses carry the client's request id (or the one
        the router made for it); upstream, the request goes under an id of the router's own.

        ``trace``: the caller's trace context (``tracing.extract``), if any.
        ``timeout``: seconds the caller still waits (its deadline); the replica gets the same.
        ``owner``: the caller's connection, the only one that may ``abort`` it by its own id.
        """
        async with _Routed(self, request, trace, owner, timeout) as routed:
            stream = self.relay.stream(routed.decision, routed.started, timeout, routed.root)
            async with contextlib.aclosing(stream):
                async for response in stream:
                    response.request_id = routed.client_id
                    yield response

    async def generate_sse(
        self,
        request: pb.GenerateRequest,
        chat: bool,
        body: bytes,
        trace: object = None,
        direct: Callable[[], DirectBody | None] | None = None,
    ) -> AsyncIterator[bytes]:
        """Route an admitted streamed HTTP request (one prompt, its client's JSON ``body``)
        and relay its replica's own OpenAI SSE byte for byte (``relays_sse``); spliced into
        the client's connection once its response began, where ``direct`` gives it."""
        async with _Routed(self, request, trace, "") as routed:
            decision = routed.decision
            migratable = (
                bool(self.limits.migration_limit) and why_not_migratable(decision.sampling, chat) is None
            )
            sse = SseRequest(
                chat, body, self.model.api_name, decision.request_id, decision.token_ids, migratable
            )
            stream = self.relay.stream_sse(decision, sse, routed.started, routed.root, direct)
            async with contextlib.aclosing(stream):
                async for block in stream:
                    yield block

    async def stop(self) -> None:
        await self.watch.stop()

    async def abort(self, request_id: str, owner: str = "") -> bool:
        """Abort what ``owner`` sent as ``request_id`` (every such request still streaming)."""
        found = False
        for own_id in self.owned.of(owner, request_id):
            replica_id = self.relay.inflight.get(own_id)
            entry = self.registry.entries.get(replica_id) if replica_id else None
            if entry is None:
                continue
            try:
                reply = await entry.stub.Abort(
                    pb.AbortRequest(request_id=own_id), timeout=5, metadata=entry.auth
                )
            except grpc.aio.AioRpcError as exc:
                raise upstream_error(exc.code(), exc.details()) from None
            found = found or reply.found
        return found


class _Routed:
    """One request's flow control -> decide -> relay bookkeeping: its place in flow control
    (``router/flow.py``), its span, its owner's ids, its metrics (a client that went away,
    its stream closed, counts as cancelled)."""

    def __init__(
        self,
        core: RouterCore,
        request: pb.GenerateRequest,
        trace: object,
        owner: str,
        timeout: float | None = None,
    ):
        self.core, self.request, self.trace, self.owner = core, request, trace, owner
        self.deadline = None if timeout is None else time.monotonic() + timeout

    async def __aenter__(self) -> _Routed:
        core = self.core
        self.root = tracing.start(
            "kvmesh.router.request", self.trace, request_id=self.request.request_id or None
        )
        self.started = time.perf_counter()
        try:
            self.flow = await core.flow.admit(
                FLOW_KEY.get() or FlowKey(), estimated_tokens(self.request), self.deadline
            )
        except BaseException as exc:
            if isinstance(exc, Overloaded):
                core.count_overloaded(self.request.policy)
            tracing.end(self.root, outcome="error")
            raise
        try:
            self.decision = await core.decider.decide(self.request, self.root)
        except BaseException:
            core.flow.end(self.flow, None)
            tracing.end(self.root, outcome="error")
            raise
        core.with_room_first(self.decision)
        core.flow.routed(self.flow)  # the relay counts its load before anything else runs
        self.client_id = self.request.request_id or self.decision.request_id
        self.core.owned.add(self.owner, self.client_id, self.decision.request_id)
        return self

    async def __aexit__(self, kind, exc, tb) -> bool:
        if kind is None:
            outcome = "ok"
        elif issubclass(kind, asyncio.CancelledError | GeneratorExit):
            outcome = "cancelled"
        else:
            outcome = "error"
        core, decision = self.core, self.decision
        core.flow.end(self.flow, decision.served_tokens)
        core.owned.discard(self.owner, self.client_id, decision.request_id)
        core.metrics.requests.labels(decision.policy, outcome).inc()
        core.metrics.latency.observe(time.perf_counter() - self.started)
        tracing.end(self.root, outcome=outcome)
        return kind is FailedInBand  # counted as failed; its client was told already
