"""One replica's request path, shared by its gRPC service and its OpenAI HTTP front end:
prompt ids (tokenized exactly as the router does), parameters resolved by the same rules,
n choices fanned out, the engine's stream as GenerateResponses, engine errors as
ServingErrors (each with its gRPC code and HTTP status), metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

from kvmesh.engine.protocol import (
    EngineDeadError,
    EngineOverloadedError,
    PrefixFacts,
    RequestOutput,
    ServingEngine,
    TokenLogprob,
)
from kvmesh.protos import pb
from kvmesh.replica.metrics import ReplicaMetrics
from kvmesh.serving import tracing
from kvmesh.serving.admission import InflightLimit, Ticket, admit
from kvmesh.serving.errors import InvalidRequest, Overloaded, ServingError, Unavailable
from kvmesh.serving.generation_config import GenerationDefaults
from kvmesh.serving.limits import InputLimits
from kvmesh.serving.model_info import ModelInfo
from kvmesh.serving.offload import sized
from kvmesh.serving.prompt import prompt_ids
from kvmesh.serving.request_ids import OwnedRequests, new_request_id
from kvmesh.serving.sampling_params import MAX_N, SamplingParams
from kvmesh.serving.streams import merge
from kvmesh.serving.tokenizer import PromptTokenizer

LOGPROB_BYTES = 8  # about what one scored token (id and value) takes in a message


def usage(out: RequestOutput, sent: int = 0) -> pb.Usage:
    """``sent``: the continued tokens at the prompt's end, counted as output (a migrated
    stream's usage counts each token once, as the uninterrupted stream's would)."""
    prompt = out.prompt_tokens - sent
    cached = min(out.cached_tokens, prompt)
    return pb.Usage(
        prompt_tokens=prompt,
        completion_tokens=out.completion_tokens + sent,
        cached_tokens=cached,
        host_cached_tokens=min(out.host_cached_tokens, cached),
    )


class EngineBackend:
    """The serving Backend over this replica's engine (the OpenAI app and the gRPC service use it)."""

    relays_sse = False  # a replica is where a relayed stream is made

    def __init__(
        self,
        engine: ServingEngine,
        replica_id: str,
        model: ModelInfo,
        tokenizer: PromptTokenizer | None,
        defaults: GenerationDefaults | None = None,
        inputs: InputLimits | None = None,
    ):
        self.engine = engine
        self.inputs = inputs or InputLimits()
        self.replica_id = replica_id
        self.model = model
        self.tokenizer = tokenizer
        self.defaults = defaults or GenerationDefaults()
        self.metrics = ReplicaMetrics(model.api_name, model.max_model_len, engine.stats)
        config = engine.config
        # What the engine can hold: running plus queued; beyond it, refused before any work.
        self.inflight = InflightLimit(config.max_num_seqs + config.max_queued_requests, "replica")
        self.owned = OwnedRequests()  # the engine's request ids, by caller connection and caller id
        self.incarnation: Callable[[], int] = lambda: 0  # the replica's index incarnation (set by its server)
        self.draining = False  # set on drain: new requests are refused UNAVAILABLE (a router retries them)

    async def prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        self.inputs.check(request)
        return await prompt_ids(request, self.tokenizer, self.model.vocab_size)

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def admit(self, count: int = 1, policy: str = "") -> Ticket:
        """Slots for a request before anything is built for it (a batch: one per prompt)."""
        if self.draining:
            raise Unavailable("the replica is draining; retry on another replica")
        return self.inflight.take(count)

    def abort(self, request_id: str, owner: str = "") -> bool:
        """Abort what ``owner`` sent as ``request_id`` (all its choices); False if none streams."""
        owned = self.owned.of(owner, request_id)
        found = [self.engine.abort(i) for own in owned for i in [own, *_engine_ids(own, MAX_N)]]
        return any(found)

    async def generate(
        self, request: pb.GenerateRequest, trace: object = None, owner: str = ""
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one admitted request (``admit``); closing the stream (client gone, deadline)
        aborts it in the engine. Its engine requests go under ids of the replica's own; the
        caller's id is echoed in the responses, and ``owner`` (the caller's connection) may
        abort it by that id.

        ``trace``: the caller's trace context; the request's span, with its queue and prefill, goes under it."""
        started = time.perf_counter()
        own_id = new_request_id()
        if not request.request_id:
            request.request_id = own_id  # the handler's own message: echoed in the responses
        self.owned.add(owner, request.request_id, own_id)
        outcome, first = "cancelled", True  # unless it ends otherwise
        span = tracing.start(
            "kvmesh.replica.engine.request", trace, replica_id=self.replica_id, request_id=request.request_id
        )
        try:
            self.model.check_named(request.model)
            ids = await self.prompt_ids(request)
            sent = request.continued_tokens
            if sent >= len(ids):
                raise InvalidRequest(
                    "continued_tokens must be below the prompt's length", param="continued_tokens"
                )
            _, params = admit(request, len(ids) - sent, self.model, self.defaults)
            if sent and sent == params.max_tokens:  # every token was out, only the end was lost
                yield self._ended(request, len(ids) - sent, sent)
                outcome = "ok"
                return
            if sent:
                try:
                    params = params.continued(sent)
                except ValueError as exc:
                    raise InvalidRequest(str(exc), param="continued_tokens") from None
            with _engine_errors():
                async for response in self._choices(ids, params, request, own_id, span):
                    if first:
                        first = False
                        self.metrics.ttft.observe(time.perf_counter() - started)
                    yield response
            outcome = "ok"
        except ServingError as exc:
            outcome = exc.grpc_code.name.lower()
            raise
        finally:
            self.owned.discard(owner, request.request_id, own_id)
            self.metrics.requests.labels(outcome).inc()
            self.metrics.e2e.observe(time.perf_counter() - started)
            tracing.end(span, outcome=outcome)

    def _ended(self, request: pb.GenerateRequest, prompt_tokens: int, sent: int) -> pb.GenerateResponse:
        """The end of a continued stream that had sent all its max_tokens: nothing to compute."""
        usage = pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=sent)
        complete = pb.Complete(
            finish_reason="length", usage=usage, replica_id=self.replica_id, incarnation=self.incarnation()
        )
        return pb.GenerateResponse(request_id=request.request_id, complete=complete)

    async def _choices(
        self, ids: list[int], params: SamplingParams, request: pb.GenerateRequest, own_id: str, span: object
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The n choices' responses, interleaved. Choice 0 runs first; the others start once
        it has produced (its prefill is then in the prefix cache, so they reuse it)."""
        single = dataclasses.replace(params, n=1)
        engine_ids = _engine_ids(own_id, params.n)
        if params.n == 1:
            async for response in self._choice(ids, single, request, engine_ids[0], 0, span):
                yield response
            return

        def choice(i: int) -> AsyncIterator[pb.GenerateResponse]:
            seeded = (
                single if params.seed is None else dataclasses.replace(single, seed=(params.seed + i) % 2**64)
            )
            return self._choice(ids, seeded, request, engine_ids[i], i, span)

        first = choice(0)
        async with contextlib.aclosing(first):
            yield await anext(first)
            async with contextlib.aclosing(merge([first, *map(choice, range(1, params.n))])) as rest:
                async for _, response in rest:
                    yield response

    async def _choice(
        self,
        ids: list[int],
        params: SamplingParams,
        request: pb.GenerateRequest,
        engine_id: str,
        index: int,
        span: object,
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id
        first, last_token_at = True, None
        async with contextlib.aclosing(self.engine.generate(ids, params, engine_id)) as stream:
            async for out in stream:
                if out.new_token_ids:
                    now = time.perf_counter()
                    if last_token_at is not None:  # one sample per token, as vLLM's per step
                        gap = (now - last_token_at) / len(out.new_token_ids)
                        for _ in out.new_token_ids:
                            self.metrics.itl.observe(gap)
                    last_token_at = now
                if out.new_token_ids or out.new_text:
                    prompt_tokens = len(ids) - params.continued_tokens if first else 0
                    chunk = await sized(_logprob_bytes(out), _chunk, out, prompt_tokens, index)
                    first = False
                    yield pb.GenerateResponse(request_id=request_id, chunk=chunk)
                if out.finished:
                    self.metrics.finished(out)
                    complete = pb.Complete(
                        finish_reason=out.finish_reason or "",
                        usage=usage(out, params.continued_tokens),
                        replica_id=self.replica_id,
                        index=index,
                        incarnation=self.incarnation(),
                    )
                    if out.prefix is not None:
                        prediction_facts(complete, out.prefix, request)
                    if index == 0:
                        _trace_phases(span, out, request)
                    yield pb.GenerateResponse(request_id=request_id, complete=complete)


def _engine_ids(own_id: str, n: int) -> list[str]:
    """The engine ids of a request's choices: its own id alone, or ``id/0`` .. ``id/n-1``."""
    return [own_id] if n == 1 else [f"{own_id}/{i}" for i in range(n)]


def prediction_facts(complete: pb.Complete, facts: PrefixFacts, request: pb.GenerateRequest) -> None:
    """What the router needs to tell a lagging index from a lying one (``router/index_trust/predictions.py``)."""
    if request.first_block_hash and facts.first_block_hash is not None:
        complete.hash_mismatch = request.first_block_hash != facts.first_block_hash
    if facts.miss_evicted_at is not None:
        complete.miss_evicted_age_ms = _age_ms(facts.arrived_at, facts.miss_evicted_at)
    unpredicted = facts.hit_stored_at[request.predicted_cached_blocks :]
    if unpredicted:
        complete.unindexed_hit_age_ms = _age_ms(facts.arrived_at, max(unpredicted))


def _trace_phases(span: object, out: RequestOutput, request: pb.GenerateRequest) -> None:
    t = out.times
    if t is None:
        return
    tracing.set_attributes(
        span,
        prompt_tokens=out.prompt_tokens,
        cached_tokens=out.cached_tokens,
        completion_tokens=out.completion_tokens,
        predicted_cached_blocks=request.predicted_cached_blocks or None,
    )
    phases = [
        ("kvmesh.replica.queue", t.arrival, t.scheduled),
        ("kvmesh.replica.prefill", t.scheduled, t.first_token),
    ]
    tracing.record_phases(span, phases, cached_tokens=out.cached_tokens)


def _age_ms(now: float, then: float) -> int:
    return min(2**32 - 1, max(0, int((now - then) * 1000)))


def _chunk(out: RequestOutput, prompt_tokens: int, index: int) -> pb.Chunk:
    return pb.Chunk(
        prompt_tokens=prompt_tokens,
        token_ids=out.new_token_ids,
        text=out.new_text,
        index=index,
        logprobs=_logprobs(out.logprobs),
        prompt_logprobs=_logprobs(out.prompt_logprobs),
    )


def _logprob_bytes(out: RequestOutput) -> int:
    """About the bytes an output's log-probabilities take in its chunk: a prompt's, with their
    alternatives, are large enough to be built off the loop that keeps the heartbeat."""
    scored = (*(out.logprobs or ()), *(out.prompt_logprobs or ()))
    return LOGPROB_BYTES * sum(1 + len(s.top) for s in scored)


def _logprobs(scored: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=s.token_id,
            logprob=s.logprob,
            rank=s.rank,
            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in s.top],
        )
        for s in scored or ()
    ]


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
