"""The ``kvmesh.v1.Replica`` gRPC service (grpc.aio) over an AsyncLLMEngine.

``Generate`` streams ``Chunk``s and ends with a ``Complete`` carrying usage (cached tokens
included). Validation errors become INVALID_ARGUMENT before any chunk; a client that goes
away (cancellation, deadline) aborts its request in the engine, freeing its blocks.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from kvmesh.kvcache import KVCacheError
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError
from kvmesh.replica.request import RequestOutput
from kvmesh.replica.sampling_params import sampling_from_proto
from kvmesh.router.tokenization import PromptTokenizer


def prompt_from_proto(request: pb.GenerateRequest, tokenizer: PromptTokenizer | None) -> str | list[int]:
    """The request's prompt: token ids, text, or chat messages rendered by the chat template."""
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "text":
        return request.text
    if kind == "chat":
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; send token ids")
        return tokenizer.render_chat({"role": m.role, "content": m.content} for m in request.chat.messages)
    raise ValueError("request has no input: set text, token_ids or chat")


def usage(out: RequestOutput) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens,
    )


class ReplicaService(pb_grpc.ReplicaServicer):
    def __init__(
        self,
        engine: AsyncLLMEngine,
        replica_id: str,
        index_state: Callable[[], tuple[int, bool]],
        tokenizer: PromptTokenizer | None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.replica_id = replica_id
        self.index_state = index_state  # () -> (incarnation, dirty)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        try:
            prompt = prompt_from_proto(request, self.tokenizer)
            params = sampling_from_proto(request.sampling)
            async for out in self.engine.generate(prompt, params, request_id):
                if out.new_token_ids or out.new_text:
                    chunk = pb.Chunk(token_ids=out.new_token_ids, text=out.new_text)
                    yield pb.GenerateResponse(request_id=request_id, chunk=chunk)
                if out.finished:
                    complete = pb.Complete(
                        finish_reason=out.finish_reason or "", usage=usage(out), replica_id=self.replica_id
                    )
                    yield pb.GenerateResponse(request_id=request_id, complete=complete)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineOverloadedError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

    async def ResetPrefixCache(
        self, request, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        try:
            await self.engine.call(lambda engine: engine.reset_prefix_cache())
        except KVCacheError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.ResetPrefixCacheResponse()

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
        )
