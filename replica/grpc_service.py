"""The ``kvmesh.v1.Replica`` gRPC service (grpc.aio) over the engine backend.

``Generate`` streams ``Chunk``s and ends with a ``Complete`` carrying usage (cached tokens
included). Validation errors become INVALID_ARGUMENT before any chunk; a client that goes
away (cancellation, deadline), or stops reading for the write timeout, aborts its request in
the engine, freeing its blocks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from kvmesh.kvcache import KVCacheError
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.backend import EngineBackend
from kvmesh.serving import tracing
from kvmesh.serving.connections import ClientStalled, end_call, send_all
from kvmesh.serving.errors import ServingError


class ReplicaService(pb_grpc.ReplicaServicer):
    def __init__(
        self,
        backend: EngineBackend,
        index_state: Callable[[], tuple[int, bool]],
        effective_config: str = "{}",
        resync: Callable[[str], Awaitable[int]] | None = None,
        write_timeout_s: float = 30.0,
    ):
        self.backend = backend
        self.write_timeout_s = write_timeout_s  # a client that does not read for this long is cut off
        self.effective_config = effective_config  # JSON, secrets left out
        self.engine = backend.engine
        self.replica_id = backend.replica_id
        self.index_state = index_state  # () -> (incarnation, dirty)
        self.resync = resync  # (reason) -> hashes published

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        try:
            with self.backend.admit(1):
                trace = (
                    tracing.extract(dict(context.invocation_metadata() or ())) if tracing.enabled() else None
                )
                stream = self.backend.generate(request, trace, context.peer())
                await send_all(context, stream, self.write_timeout_s)
        except (ServingError, ClientStalled) as exc:  # a stalled one's blocks are free already
            end_call(context, exc.grpc_code, str(exc))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Abort what this connection sent under ``request_id``."""
        return pb.AbortResponse(found=self.backend.abort(request.request_id, context.peer()))

    async def ResetPrefixCache(
        self, request, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        try:
            await self.engine.reset_prefix_cache()
        except KVCacheError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.ResetPrefixCacheResponse()

    async def Resync(self, request: pb.ResyncRequest, context: grpc.aio.ServicerContext) -> pb.ResyncResponse:
        if self.resync is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this replica publishes to no index")
        try:
            published = await self.resync(request.reason or "asked")
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "resync did not finish in time: is the index reachable?"
            )
        return pb.ResyncResponse(num_hashes=published)

    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReplicaStats:
        stats = self.engine.stats()
        incarnation, dirty = self.index_state()
        return pb.ReplicaStats(
            replica_id=self.replica_id,
            incarnation=incarnation,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_blocks=stats.kv.num_blocks,
            num_free_blocks=stats.kv.num_free_blocks,
            num_cached_free_blocks=stats.kv.num_cached_free_blocks,
            block_size=stats.kv.block_size,
            num_cached_hashes=stats.kv.num_cached_hashes,
            prefix_query_tokens=stats.kv.prefix_query_tokens,
            prefix_hit_tokens=stats.kv.prefix_hit_tokens,
            num_preemptions=stats.num_preemptions,
            prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens,
            index_dirty=dirty,
            effective_config=self.effective_config,
        )
