"""The ``kvmesh.v1.Router`` gRPC service over RouterCore."""

from __future__ import annotations

import time

import grpc

from kvmesh.kvcache.index import INDEX_ERRORS
from kvmesh.protos import pb, pb_grpc
from kvmesh.router.core import RouterCore
from kvmesh.serving.errors import ServingError


class RouterService(pb_grpc.RouterServicer):
    def __init__(self, core: RouterCore, effective_config: str = "{}"):
        self.core = core
        self.effective_config = effective_config  # JSON, secrets left out

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            async for response in self.core.generate(request, timeout=context.time_remaining()):
                yield response
        except ServingError as exc:
            await context.abort(exc.grpc_code, str(exc))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            return pb.AbortResponse(found=await self.core.abort(request.request_id))
        except ServingError as exc:
            await context.abort(exc.grpc_code, str(exc))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        m = self.core.model
        return pb.ModelInfo(
            model=m.model_id,
            block_size=m.block_size,
            max_model_len=m.max_model_len,
            vocab_size=m.vocab_size,
            hash_seed=m.hash_seed,
            effective_config=self.effective_config,
        )

    async def ListReplicas(self, request: pb.ListReplicasRequest, context: grpc.aio.ServicerContext):
        now = time.time()
        replicas = []
        for e in sorted(self.core.registry.live(), key=lambda e: e.record.replica_id):
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
            controller = await self.core.registry.index.controller_state() or ""
        except INDEX_ERRORS:  # Redis away: the live replicas are still known
            controller = ""
        return pb.ListReplicasResponse(replicas=replicas, controller_state=controller)
