"""Admission, the same on the router and the replicas (so both give the same errors): a
request's checks against the model's limits and its resolved sampling, and the in-flight
slots a request takes before anything is built for it."""

from __future__ import annotations

from kvmesh.protos import pb
from kvmesh.serving.errors import InvalidRequest, Overloaded
from kvmesh.serving.generation_config import GenerationDefaults
from kvmesh.serving.model_info import ModelInfo
from kvmesh.serving.sampling_params import SamplingParams, check_vocabulary, sampling_from_proto


def admit(
    request: pb.GenerateRequest,
    num_prompt_tokens: int,
    model: ModelInfo,
    defaults: GenerationDefaults,
    max_prompt_tokens: int | None = None,
    max_tokens_limit: int | None = None,
) -> tuple[pb.SamplingParams, SamplingParams]:
    """The request's sampling with defaults filled in (to forward) and validated (to run);
    InvalidRequest naming what is wrong."""
    max_prompt = max_prompt_tokens or model.max_model_len - 1
    if num_prompt_tokens > max_prompt:
        raise InvalidRequest(f"prompt has {num_prompt_tokens} tokens, the limit is {max_prompt}")
    ceiling = max_tokens_limit or model.max_model_len - 1
    sampling = defaults.resolve(request, num_prompt_tokens, model.max_model_len, ceiling)
    try:
        params = sampling_from_proto(sampling)
        check_vocabulary(params, model.vocab_size)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    if params.max_tokens > ceiling:
        raise InvalidRequest(f"max_tokens {params.max_tokens} is above the limit {ceiling}")
    if num_prompt_tokens + params.max_tokens > model.max_model_len:
        raise InvalidRequest(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len ({model.max_model_len})"
        )
    return sampling, params


class InflightLimit:
    """Requests in flight on one server, bounded: a request (a batch counts as its number of
    prompts) takes all its slots at once, or is refused with Overloaded, before any of its
    work is built."""

    def __init__(self, limit: int, who: str):
        self.limit = limit
        self.who = who
        self.active = 0

    def take(self, count: int = 1) -> Ticket:
        if self.active + count > self.limit:
            raise Overloaded(
                f"{self.who} at its in-flight limit ({self.limit} requests"
                + (f"; this one counts {count})" if count > 1 else ")")
            )
        self.active += count
        return Ticket(self, count)


class Ticket:
    """Slots held by one request; ``release`` (or leaving the ``with``) gives them back once."""

    def __init__(self, limit: InflightLimit, count: int):
        self._limit, self._count = limit, count
        self.streaming = False  # a response stream holds the slots (and releases them when it ends)

    def release(self) -> None:
        self._limit.active -= self._count
        self._count = 0

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
