"""The ``kvmesh.v1.Router`` gRPC service over the router's models (a RouterCore each).

It serves from the moment the router listens; until a model's route has its core (block
size "auto": until a replica stored it) every call for that model is UNAVAILABLE with the
reason. A call names its model as OpenAI's requests do (empty: the router's only model)."""

from __future__ import annotations

import asyncio

import grpc

from kvmesh.kvcache.index.redis import INDEX_ERRORS
from kvmesh.protos import pb, pb_grpc
from kvmesh.router.flow import FLOW_KEY
from kvmesh.router.metrics import heartbeat_age
from kvmesh.router.routes import ModelRoute, ModelRoutes
from kvmesh.serving import tracing
from kvmesh.serving.background import failing_loops
from kvmesh.serving.connections import ClientStalled, end_call, send_all
from kvmesh.serving.errors import ServingError


class _CutOff(Exception):
    """The drain ran out of time while this stream was running."""


class RouterService(pb_grpc.RouterServicer):
    def __init__(self, models: ModelRoutes, write_timeout_s: float = 30.0):
        self.models = models
        self.write_timeout_s = write_timeout_s  # a client that does not read for this long is cut off
        self._streams: set[asyncio.Task] = set()  # Generate calls in flight
        self._cut_off = False

    async def cut_off(self, wait_s: float = 1.0) -> None:
        """End every Generate still running with UNAVAILABLE (the drain ran out of time).

        Left to the server's stop, they would end as CANCELLED, which clients read as their
        own cancellation rather than as "retry elsewhere". A streaming call ends at its next
        response; one still waiting for its replica is cancelled there. (Cancelling a call
        while gRPC writes its response would close the handler before it can set a status.)"""
        self._cut_off = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        cut = bool(self._streams)
        while self._streams and loop.time() < deadline:
            if loop.time() > deadline - wait_s / 2:
                for task in self._streams:
                    task.cancel()
            await asyncio.sleep(0.01)
        if cut:
            # A few loop turns for gRPC to write their UNAVAILABLE statuses before the server
            # stops; kept short: a client that retries at once could otherwise send a call the
            # stop then cancels mid-refusal (CANCELLED instead of UNAVAILABLE).
            await asyncio.sleep(0.005)

    async def _ready(self, context: grpc.aio.ServicerContext, model: str) -> ModelRoute:
        """The route of the model a call names, routing (NOT_FOUND, or UNAVAILABLE while starting)."""
        try:
            return self.models.ready(model)
        except ServingError as exc:
            await context.abort(exc.grpc_code, str(exc))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        route = await self._ready(context, request.model)
        core = route.core
        FLOW_KEY.set(route.config.flow.key(dict(context.invocation_metadata() or ())))
        task = asyncio.current_task()
        self._streams.add(task)
        try:
            with core.admit(1, request.policy):
                stream = core.generate(request, _trace(context), context.time_remaining(), context.peer())
                await send_all(context, stream, self.write_timeout_s, self._stop_if_cut_off)
        except (ServingError, ClientStalled) as exc:  # a stalled one's slot and blocks are free already
            end_call(context, exc.grpc_code, str(exc))
        except (_CutOff, asyncio.CancelledError):
            if not self._cut_off:
                raise  # the client went away
            end_call(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "router shut down before the request finished (drain timeout)",
            )
        finally:
            self._streams.discard(task)

    def _stop_if_cut_off(self) -> None:
        if self._cut_off:
            raise _CutOff

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Abort what this connection sent under ``request_id`` (another client's requests
        with the same id are not this client's to abort)."""
        found = False
        try:
            for core in self.models.cores:  # request ids are the router's, across its models
                found = await core.abort(request.request_id, context.peer()) or found
        except ServingError as exc:
            await context.abort(exc.grpc_code, str(exc))
        return pb.AbortResponse(found=found)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        route = await self._ready(context, request.model)
        m = route.model
        return pb.ModelInfo(
            model=m.model_id,
            block_size=m.block_size,
            max_model_len=m.max_model_len,
            vocab_size=m.vocab_size,
            hash_seed=m.hash_seed,
            effective_config=route.effective_config,
        )

    async def ListReplicas(self, request: pb.ListReplicasRequest, context: grpc.aio.ServicerContext):
        """The live replicas of the model named (of every model when none is); the controller
        state and the index's trust are those of the model named (or of the first)."""
        try:
            routes = [self.models.route(request.model)] if request.model else self.models.routes
        except ServingError as exc:
            await context.abort(exc.grpc_code, str(exc))
        started = [route for route in routes if route.core is not None]
        if not started:
            await self._ready(context, request.model or routes[0].api_name)  # UNAVAILABLE, why
        replicas = [info for route in started for info in _replica_infos(route)]
        first = started[0]
        try:
            controller = await first.index.controller_state() or ""
        except INDEX_ERRORS:  # Redis away: the live replicas are still known
            controller = ""
        state, cause = first.core.watch.overall()
        return pb.ListReplicasResponse(
            replicas=replicas,
            controller_state=controller,
            index_state=state,
            index_state_cause=cause,
            failing_loops=failing_loops(),
        )


def _replica_infos(route: ModelRoute) -> list[pb.ReplicaInfo]:
    core = route.core
    infos = []
    for e in sorted(core.registry.live(), key=lambda e: e.record.replica_id):
        rec = e.record
        state, cause = core.watch.state(rec.replica_id)
        infos.append(
            pb.ReplicaInfo(
                replica_id=rec.replica_id,
                address=rec.address,
                incarnation=rec.incarnation,
                num_running=int(rec.load("num_running")),
                num_waiting=int(rec.load("num_waiting")),
                num_free_blocks=int(rec.load("num_free_blocks")),
                num_blocks=int(rec.load("num_blocks")),
                tokens_per_s=rec.load("tokens_per_s"),
                heartbeat_age_s=heartbeat_age(rec.load("heartbeat_at")),
                index_state=state,
                index_state_cause=cause,
                model=route.api_name,
                share_alarm=rec.replica_id in core.registry.alarm.on,
                engine=rec.fields.get("engine", "kvmesh")[:16],  # a replica's own words: bounded
                num_host_blocks=max(0, int(rec.load("num_host_blocks"))),
                num_host_used_blocks=max(0, int(rec.load("num_host_used_blocks"))),
                restore_block_s=e.restore_block_s or 0.0,
            )
        )
    return infos


def _trace(context: grpc.aio.ServicerContext) -> object:
    """The caller's trace context from its call metadata (None unless tracing is on)."""
    return tracing.extract(dict(context.invocation_metadata() or ())) if tracing.enabled() else None
