"""One replica's request path, shared by its gRPC service and its OpenAI HTTP front end:
prompt ids (tokenized exactly as the router does), engine stream as GenerateResponses,
engine errors as RouterErrors (each with its gRPC code and HTTP status), metrics."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from kvmesh.protos import pb
from kvmesh.replica.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError
from kvmesh.replica.metrics import ReplicaMetrics
from kvmesh.replica.request import RequestOutput
from kvmesh.serving.errors import InvalidRequest, Overloaded, ServingError, Unavailable
from kvmesh.serving.model_info import ModelInfo
from kvmesh.serving.prompt import prompt_ids
from kvmesh.serving.sampling import sampling_from_proto
from kvmesh.serving.tokenizer import PromptTokenizer


def usage(out: RequestOutput) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens,
    )


class EngineBackend:
    """The serving Backend over this replica's engine (the OpenAI app and the gRPC service use it)."""

    def __init__(
        self, engine: AsyncLLMEngine, replica_id: str, model: ModelInfo, tokenizer: PromptTokenizer | None
    ):
        self.engine = engine
        self.replica_id = replica_id
        self.model = model
        self.tokenizer = tokenizer
        self.metrics = ReplicaMetrics(engine.stats)

    async def prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        return await prompt_ids(request, self.tokenizer, self.model.vocab_size)

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one request; closing the stream (client gone, deadline) aborts it in the engine."""
        started = time.perf_counter()
        request_id = request.request_id or uuid.uuid4().hex
        outcome, first = "cancelled", True  # unless it ends otherwise
        try:
            ids = await self.prompt_ids(request)
            with _engine_errors():
                params = sampling_from_proto(request.sampling)
                async with contextlib.aclosing(self.engine.generate(ids, params, request_id)) as stream:
                    async for out in stream:
                        if first:
                            first = False
                            self.metrics.ttft.observe(time.perf_counter() - started)
                        if out.new_token_ids or out.new_text:
                            chunk = pb.Chunk(token_ids=out.new_token_ids, text=out.new_text)
                            yield pb.GenerateResponse(request_id=request_id, chunk=chunk)
                        if out.finished:
                            self.metrics.cached_tokens.inc(out.cached_tokens)
                            self.metrics.finished_prompt_tokens.inc(len(ids))
                            complete = pb.Complete(
                                finish_reason=out.finish_reason or "",
                                usage=usage(out),
                                replica_id=self.replica_id,
                            )
                            yield pb.GenerateResponse(request_id=request_id, complete=complete)
            outcome = "ok"
        except ServingError as exc:
            outcome = exc.grpc_code.name.lower()
            raise
        finally:
            self.metrics.requests.labels(outcome).inc()
            self.metrics.latency.observe(time.perf_counter() - started)


@contextlib.contextmanager
def _engine_errors():
    """The engine's refusals as the errors clients act on."""
    try:
        yield
    except ValueError as exc:  # sampling values, prompt length, vocabulary
        raise InvalidRequest(str(exc)) from None
    except EngineOverloadedError as exc:
        raise Overloaded(str(exc)) from None
    except EngineDeadError as exc:
        raise Unavailable(str(exc)) from None
