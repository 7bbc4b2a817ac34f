"""The ``kvmesh.v1.Router`` gRPC service over RouterCore.

It serves from the moment the router listens; until the router has its core (block size
"auto": until a replica stored it) every call is UNAVAILABLE with the reason."""

from __future__ import annotations

import asyncio
import time

import grpc

from kvmesh.kvcache.index import INDEX_ERRORS
from kvmesh.protos import pb, pb_grpc
from kvmesh.router.core import RouterCore
from kvmesh.serving.errors import ServingError


class RouterService(pb_grpc.RouterServicer):
    def __init__(self, core: RouterCore | None, effective_config: str = "{}"):
        self.core = core  # set by the router process once the model's block size is known
        self.effective_config = effective_config  # JSON, secrets left out
        self._streams: set[asyncio.Task] = set()  # Generate calls in flight
        self._cut_off = False

    async def cut_off(self, wait_s: float = 1.0) -> None:
        """End every Generate still running with UNAVAILABLE (the drain ran out of time).

        Left to the server's stop, they would end as CANCELLED, which clients read as their
        own cancellation rather than as "retry elsewhere"."""
        self._cut_off = True
        for task in self._streams:
            task.cancel()
        deadline = asyncio.get_running_loop().time() + wait_s
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    async def _ready(self, context: grpc.aio.ServicerContext) -> RouterCore:
        if self.core is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "router starting: waiting for a replica to register the block size",
            )
        return self.core

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        core = await self._ready(context)
        task = asyncio.current_task()
        self._streams.add(task)
        try:
            async for response in core.generate(request, timeout=context.time_remaining()):
                yield response
        except ServingError as exc:
            await context.abort(exc.grpc_code, str(exc))
        except asyncio.CancelledError:
            if not self._cut_off:
                raise  # the client went away
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "router shut down before the request finished (drain timeout)"
            )
        finally:
            self._streams.discard(task)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        core = await self._ready(context)
        try:
            return pb.AbortResponse(found=await core.abort(request.request_id))
        except ServingError as exc:
            await context.abort(exc.grpc_code, str(exc))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        m = (await self._ready(context)).model
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
        now = time.time()
        replicas = []
        for e in sorted(core.registry.live(), key=lambda e: e.record.replica_id):
            rec = e.record
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
                    heartbeat_age_s=max(0.0, now - rec.load("heartbeat_at", now)),
                )
            )
        try:
            controller = await core.registry.index.controller_state() or ""
        except INDEX_ERRORS:  # Redis away: the live replicas are still known
            controller = ""
        return pb.ListReplicasResponse(replicas=replicas, controller_state=controller)
