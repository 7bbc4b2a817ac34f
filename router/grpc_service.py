"""The ``kvmesh.v1.Router`` gRPC service over RouterCore.

It serves from the moment the router listens; until the router has its core (block size
"auto": until a replica stored it) every call is UNAVAILABLE with the reason."""

from __future__ import annotations

import asyncio

import grpc

from kvmesh.kvcache.index import INDEX_ERRORS
from kvmesh.protos import pb, pb_grpc
from kvmesh.router.core import RouterCore
from kvmesh.router.metrics import heartbeat_age
from kvmesh.serving import tracing
from kvmesh.serving.connections import ClientStalled, end_call, send_all
from kvmesh.serving.errors import NotFound, ServingError


class _CutOff(Exception):
    """The drain ran out of time while this stream was running."""


class RouterService(pb_grpc.RouterServicer):
    def __init__(self, core: RouterCore | None, effective_config: str = "{}", write_timeout_s: float = 30.0):
        self.core = core  # set by the router process once the model's block size is known
        self.write_timeout_s = write_timeout_s  # a client that does not read for this long is cut off
        self.effective_config = effective_config  # JSON, secrets left out
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

    async def _ready(self, context: grpc.aio.ServicerContext) -> RouterCore:
        if self.core is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "router starting: waiting for a replica to register the block size",
            )
        return self.core

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        core = await self._ready(context)
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
        core = await self._ready(context)
        try:
            return pb.AbortResponse(found=await core.abort(request.request_id, context.peer()))
        except ServingError as exc:
            await context.abort(exc.grpc_code, str(exc))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        m = (await self._ready(context)).model
        try:
            m.check_named(request.model)
        except NotFound as exc:
            await context.abort(exc.grpc_code, str(exc))
        return pb.ModelInfo(
            model=m.model_id,
            block_size=m.block_size,
            max_model_len=m.max_model_len,
            vocab_size=m.vocab_size,
            hash_seed=m.hash_seed,
            effective_config=self.effective_config,
        )

    async def ListReplicas(self, request: pb.ListReplicasRequest, context: grpc.aio.ServicerContext):
        core = await self._ready(context)
        replicas = []
        for e in sorted(core.registry.live(), key=lambda e: e.record.replica_id):
            rec = e.record
            state, cause = core.watch.state(rec.replica_id)
            replicas.append(
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
                )
            )
        try:
            controller = await core.registry.index.controller_state() or ""
        except INDEX_ERRORS:  # Redis away: the live replicas are still known
            controller = ""
        state, cause = core.watch.overall()
        return pb.ListReplicasResponse(
            replicas=replicas, controller_state=controller, index_state=state, index_state_cause=cause
        )


def _trace(context: grpc.aio.ServicerContext) -> object:
    """The caller's trace context from its call metadata (None unless tracing is on)."""
    return tracing.extract(dict(context.invocation_metadata() or ())) if tracing.enabled() else None
