"""A request's checks against the model's limits and its resolved sampling: the router and
the replicas admit requests by the same rules (and so give the same errors)."""

from __future__ import annotations

from kvmesh.protos import pb
from kvmesh.serving.errors import InvalidRequest
from kvmesh.serving.generation_config import GenerationDefaults
from kvmesh.serving.model_info import ModelInfo
from kvmesh.serving.sampling import SamplingParams, sampling_from_proto


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
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    bad_bias = next((t for t in params.logit_bias if t >= model.vocab_size), None)
    if bad_bias is not None:
        raise InvalidRequest(
            f"logit_bias: token id {bad_bias} is outside the vocabulary [0, {model.vocab_size})"
        )
    if params.max_tokens > ceiling:
        raise InvalidRequest(f"max_tokens {params.max_tokens} is above the limit {ceiling}")
    if num_prompt_tokens + params.max_tokens > model.max_model_len:
        raise InvalidRequest(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len ({model.max_model_len})"
        )
    return sampling, params
