"""OpenAI request bodies -> ``kvmesh.v1.GenerateRequest``s (one per prompt of a batch).

Every honoured field is mapped here; values out of the proto's range are a 400 naming the
field. Defaults (generation_config.json, the max_tokens rule) are left to the router or
replica, which resolve them the same way for gRPC clients.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from kvmesh.protos import pb
from kvmesh.serving.errors import InvalidRequest, shown
from kvmesh.serving.limits import InputLimits
from kvmesh.serving.openai.protocol import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    TokenizeRequest,
    _Sampling,
)
from kvmesh.serving.tokenizer import PromptTokenizer

SESSION_HEADER = "x-session-id"
_UNSIGNED = frozenset({"max_tokens", "seed", "min_tokens", "logprobs", "prompt_logprobs", "n"})


@dataclass
class Plan:
    """What to send, and how to present what comes back."""

    requests: list[pb.GenerateRequest]  # one per prompt
    n: int  # choices per prompt
    logprobs: int | None  # alternatives per token shown, None: no logprobs
    echo_prompt: bool  # completions: the prompt's text (and logprobs) before each choice's
    echo_only: bool  # max_tokens 0 with echo: the prompt alone, nothing generated
    chat_prefix: str  # chat echo: the assistant message being continued
    prompt_logprobs: bool  # the client asked for vLLM's prompt_logprobs field


def _set(sampling: pb.SamplingParams, name: str, value) -> None:
    if value is None:
        return
    if name in _UNSIGNED and value < 0:
        raise InvalidRequest(f"{name} must be non-negative, got {value}", param=name)
    try:
        setattr(sampling, name, value)
    except (ValueError, TypeError, OverflowError):
        raise InvalidRequest(f"{name} {shown(value)} is out of range", param=name) from None


def sampling_of(body: _Sampling, max_tokens: int | None, logprobs: int | None) -> pb.SamplingParams:
    """The fields both endpoints share, as ``kvmesh.v1.SamplingParams``."""
    sampling = pb.SamplingParams(ignore_eos=body.ignore_eos)
    if body.stop_token_ids and any(not 0 <= t < 2**32 for t in body.stop_token_ids):
        raise InvalidRequest("stop_token_ids must be in [0, 2**32)", param="stop_token_ids")
    sampling.stop_token_ids.extend(body.stop_token_ids or [])
    sampling.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop or [])
    bias = body.logit_bias_ids()
    if any(not 0 <= t < 2**32 for t in bias):
        raise InvalidRequest("logit_bias keys must be token ids in [0, 2**32)", param="logit_bias")
    sampling.logit_bias.update(bias)
    top_k = 0 if body.top_k == -1 else body.top_k  # vLLM's "disabled"
    for name, value in (
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("top_k", top_k),
        ("min_p", body.min_p),
        ("presence_penalty", body.presence_penalty),
        ("frequency_penalty", body.frequency_penalty),
        ("repetition_penalty", body.repetition_penalty),
        ("min_tokens", body.min_tokens),
        ("seed", body.seed),
        ("max_tokens", max_tokens),
        ("logprobs", logprobs),
        ("prompt_logprobs", body.prompt_logprobs),
        ("n", body.n),
    ):
        _set(sampling, name, value)
    if body.prompt_logprobs is not None and body.stream:
        raise InvalidRequest("prompt_logprobs is not available with stream: true", param="prompt_logprobs")
    return sampling


def _request(body: _Sampling, sampling: pb.SamplingParams, session_key: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(sampling=sampling, policy=body.policy or "", affinity_key=session_key)


def session_key_of(headers: Mapping[str, str], body: _Sampling, inputs: InputLimits) -> str:
    """A request's session key, the prefix policy's hint for where a conversation goes: its
    ``x-session-id`` header, else its body's ``user`` (for clients that set no headers);
    bounded, and named in the error as the client sent it."""
    header = headers.get(SESSION_HEADER)
    field, key = (SESSION_HEADER, header) if header else ("user", body.user or "")
    inputs.check_session_key(field, key)
    return key


def completion_plan(
    body: CompletionRequest, tokenizer: PromptTokenizer | None, session_key: str = ""
) -> Plan:
    """``session_key``: ``session_key_of``'s; none where nothing is routed (a render, a
    request a router relayed here)."""
    echo_only = body.echo and body.max_tokens == 0
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequest("max_tokens must be positive (0 only with echo)", param="max_tokens")
    # echo with max_tokens 0 (lm-eval's loglikelihood): one token is generated and dropped.
    sampling = sampling_of(body, 1 if echo_only else body.max_tokens, body.logprobs)
    if body.echo and body.logprobs is not None and not sampling.HasField("prompt_logprobs"):
        sampling.prompt_logprobs = body.logprobs
    requests = []
    for prompt in body.prompts():
        request = _request(body, sampling, session_key)
        if isinstance(prompt, str) and body.add_special_tokens:
            request.text = prompt
        elif isinstance(prompt, str):
            if tokenizer is None:
                raise InvalidRequest("this model has no tokenizer; send token ids", param="prompt")
            request.token_ids.ids.extend(tokenizer.encode(prompt, add_special_tokens=False))
        else:
            set_token_ids(request, prompt, "prompt")
        requests.append(request)
    return Plan(requests, body.n, body.logprobs, body.echo, echo_only, "", body.prompt_logprobs is not None)


def set_token_ids(request: pb.GenerateRequest, ids: list[int], param: str) -> None:
    if any(not 0 <= t < 2**32 for t in ids):
        raise InvalidRequest(f"{param}: token ids must be in [0, 2**32)", param=param)
    request.token_ids.ids.extend(ids)


def chat_plan(body: ChatRequest, session_key: str = "") -> Plan:
    """``session_key``: as for ``completion_plan``."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request = _request(body, sampling_of(body, max_tokens, logprobs), session_key)
    set_chat(request.chat, body.messages, body.tools, body.chat_template_kwargs)
    request.chat.add_generation_prompt = body.add_generation_prompt
    request.chat.continue_final_message = body.continue_final_message
    if body.documents is not None:
        request.chat.documents_json = json.dumps(body.documents)
    last = body.messages[-1]
    prefix = last.content if body.echo and last.role == "assistant" else ""
    return Plan([request], body.n, logprobs, False, False, prefix, body.prompt_logprobs is not None)


def set_chat(
    chat: pb.ChatMessages, messages: list[ChatMessage], tools: list[dict] | None, template_kwargs: dict | None
) -> None:
    for m in messages:
        chat.messages.append(
            pb.ChatMessage(
                role=m.role,
                content=m.content,
                name=m.name or "",
                tool_call_id=m.tool_call_id or "",
                tool_calls_json=json.dumps(m.tool_calls) if m.tool_calls else "",
            )
        )
    if tools is not None:
        chat.tools_json = json.dumps(tools)
    if template_kwargs:
        chat.template_kwargs_json = json.dumps(template_kwargs)


def tokenize_request(body: TokenizeRequest, tokenizer: PromptTokenizer | None) -> pb.GenerateRequest:
    """``/tokenize``'s input as a GenerateRequest (its prompt ids come out as a generation's do)."""
    request = pb.GenerateRequest()
    if body.messages:
        set_chat(request.chat, body.messages, body.tools, body.chat_template_kwargs)
        request.chat.add_generation_prompt = body.add_generation_prompt
        request.chat.continue_final_message = body.continue_final_message
    elif isinstance(body.prompt, str) and not body.add_special_tokens and tokenizer:
        request.token_ids.ids.extend(tokenizer.encode(body.prompt, add_special_tokens=False))
    elif isinstance(body.prompt, str):
        request.text = body.prompt
    elif body.prompt is not None:
        set_token_ids(request, body.prompt, "prompt")
    else:
        raise InvalidRequest("set prompt or messages", param="prompt")
    return request
