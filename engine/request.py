"""A request inside the engine: its Sequence plus sampling state, stops and output cursor."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.kvcache import Sequence
from kvmesh.serving.sampling_params import SamplingParams

if TYPE_CHECKING:  # the simulator schedules these without torch
    import torch

    from kvmesh.engine.detokenizer import IncrementalDetokenizer
    from kvmesh.engine.protocol import TokenLogprob


# Holds a sampled token's place until its step lands; outside the vocabulary, so a stand-in
# read by mistake fails loudly instead of passing for a token.
PENDING_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestTimes:
    """When a finished request arrived, was first scheduled, produced its first token and
    ended (monotonic seconds; a request aborted early may lack the middle ones)."""

    arrival: float
    scheduled: float | None
    first_token: float | None
    finished: float


@dataclass(frozen=True)
class PrefixFacts:
    """What the replica's prefix cache held for a request when it was first admitted: the
    router compares them with its prediction to tell an index that lags from one that lies.
    Their ages count from the request's arrival, when the router had just read the index: a
    block evicted or stored while the request queued here is no fault of the index."""

    first_block_hash: int | None  # the replica's own hash of the prompt's first full block
    hit_stored_at: tuple[float, ...]  # when each reused block became hittable (monotonic)
    miss_evicted_at: float | None  # when the first block past the hit was evicted, if lately
    arrived_at: float


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta; ``finished`` on the last one)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    host_cached_tokens: int = 0  # of those, the ones restored from the host tier
    logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when asked
    prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 2.., once, when asked
    times: RequestTimes | None = None  # on the last output
    prefix: PrefixFacts | None = None  # on the last output, once admitted
    error: str | None = None  # why it ended, when it failed ("error")
    engine_fault: bool = False  # the failure was the engine's (a failed step), not this request's


class Request(Sequence):
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        block_size: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        stop_ids: frozenset[int],
        detokenizer: IncrementalDetokenizer | None,
    ):
        super().__init__(prompt_token_ids, block_size)
        self.request_id = request_id
        self.params = params
        self.generator = generator
        self.stop_ids = stop_ids  # eos (unless ignore_eos) and the request's stop token ids
        self.detokenizer = detokenizer
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None  # set when it failed
        self.engine_fault = False
        self.cached_prompt_tokens: int | None = None  # prefix hit at first admission
        self.host_cached_prompt_tokens = 0  # of that hit, what came from the host tier
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None  # first admission
        self.prefix_facts: PrefixFacts | None = None  # at first admission
        self.first_token_time: float | None = None
        self.emitted_tokens = 0  # completion tokens already handed out
        self.logprobs: list[TokenLogprob] = []  # of completion tokens, when asked
        self.prompt_logprobs: list[TokenLogprob] = []  # of prompt tokens 1.., when asked
        self.prompt_logprobs_sent = False
        self.sampling_tensors: dict[str, object] = {}  # the sampler's per-request state (prompt ids, tally)
        # Its row in the tokens of a launched step not yet landed (async scheduling): a stand-in
        # token holds the place of the one that step samples, so the next step can be planned.
        self.pending_row: int | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still computing a prompt whose log-probabilities were asked for."""
        return (
            self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    def record_prompt_logprobs(self, log_probs: torch.Tensor, start: int) -> None:
        """Row j of ``log_probs`` is the distribution after position ``start + j``: it scores
        prompt token ``start + j + 1`` (computed again after a preemption: kept once)."""
        from kvmesh.engine.sampler import logprobs_of

        targets = range(
            max(start + 1, len(self.prompt_logprobs) + 1),
            min(start + len(log_probs) + 1, self.num_prompt_tokens),
        )
        if targets:
            rows = log_probs[targets.start - start - 1 : targets.stop - start - 1]
            ids = [self.prompt_token_ids[t] for t in targets]
            self.prompt_logprobs += logprobs_of(rows, ids, self.params.prompt_logprobs)

    @property
    def ends_when_pending_lands(self) -> bool:
        """Its held place is its last token (``max_tokens``): no step after it is its."""
        return self.pending_row is not None and self.num_completion_tokens >= self.params.max_tokens

    def expect_token(self, row: int) -> None:
        """A launched step samples this request's next token in ``row``: its place is held by
        ``PENDING_TOKEN`` until the step lands (the device reads the real one in the meantime)."""
        self.append_token(PENDING_TOKEN)
        self.pending_row = row

    def forget_pending(self) -> None:
        """Drop the held place (the request ended before its pending token landed)."""
        if self.pending_row is not None:
            self.token_ids.pop()
            self.pending_row = None

    def add_token(self, token: int, logprob: TokenLogprob | None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if self.pending_row is not None:  # the landed token takes its held place
            self.token_ids[-1], self.pending_row = token, None
        else:
            self.append_token(token)
        if logprob is not None:
            self.logprobs.append(logprob)

    def output(self, new_text: str = "") -> RequestOutput:
        new_ids = self.completion_token_ids[self.emitted_tokens :]
        new_logprobs = self.logprobs[self.emitted_tokens :] if self.params.logprobs is not None else None
        prompt_logprobs = None
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent and new_ids:
            prompt_logprobs, self.prompt_logprobs_sent = list(self.prompt_logprobs), True
        self.emitted_tokens = self.num_completion_tokens
        finished = self.status is Status.FINISHED
        times = (
            RequestTimes(self.arrival_time, self.scheduled_time, self.first_token_time, time.monotonic())
            if finished
            else None
        )
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=self.finish_reason,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_completion_tokens,
            cached_tokens=self.cached_prompt_tokens or 0,
            host_cached_tokens=self.host_cached_prompt_tokens,
            logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs,
            times=times,
            prefix=self.prefix_facts if finished else None,
            error=self.error,
            engine_fault=self.engine_fault,
        )
