"""The OpenAI request bodies kvmesh accepts, and the rule for every field a client may send.

Each field is honoured, or refused with a 400 that names it (``param``) when its value asks
for something kvmesh does not do; a field nobody here knows is accepted, as vLLM does, and
logged once per name. ``FIELD_RULES`` is that list: the "OpenAI fields" table of docs/api.md is
rendered from it (a test keeps the two equal) and the compatibility suite walks it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from kvmesh.serving.errors import InvalidRequest, shown
from kvmesh.serving.sampling_params import MAX_LOGPROBS

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class FieldRule:
    """One request field: where it applies, whether kvmesh honours it, and when it is refused."""

    name: str
    endpoints: str  # "completions", "chat" or "both"
    support: str  # "yes", or "400 unless ..." for a field honoured only at some values
    note: str = ""
    refused_example: Any = None  # a value that gets the 400 (for the compatibility suite)


FIELD_RULES: tuple[FieldRule, ...] = (
    FieldRule("model", "both", "yes", "the served model name or the model id; another name is a 404"),
    FieldRule("prompt", "completions", "yes", "text, token ids, or a list of either (batch)"),
    FieldRule("messages", "chat", "yes", f"roles {', '.join(CHAT_ROLES)}; text content parts"),
    FieldRule(
        "max_tokens", "both", "yes", "chat default: the rest of the context, within the server's limit"
    ),
    FieldRule("max_completion_tokens", "chat", "yes", "takes precedence over max_tokens"),
    FieldRule("temperature", "both", "yes", "below 1e-5 is greedy"),
    FieldRule("top_p", "both", "yes"),
    FieldRule("top_k", "both", "yes", "vLLM extension; 0 or -1 disables"),
    FieldRule("min_p", "both", "yes", "vLLM extension"),
    FieldRule("presence_penalty", "both", "yes"),
    FieldRule("frequency_penalty", "both", "yes"),
    FieldRule("repetition_penalty", "both", "yes", "vLLM extension"),
    FieldRule("min_tokens", "both", "yes", "vLLM extension"),
    FieldRule("logit_bias", "both", "yes", "token id -> bias in [-100, 100]"),
    FieldRule("seed", "both", "yes", "per request: the same tokens whatever shares the batch"),
    FieldRule("stop", "both", "yes", "not included in the output"),
    FieldRule("stop_token_ids", "both", "yes", "vLLM extension"),
    FieldRule("ignore_eos", "both", "yes", "vLLM extension"),
    FieldRule("n", "both", "yes", "up to 16; choices after the first reuse its prefill"),
    FieldRule("best_of", "completions", "400 unless null or n", refused_example=4),
    FieldRule("stream", "both", "yes"),
    FieldRule("stream_options", "both", "yes", "include_usage, continuous_usage_stats; 400 without stream"),
    FieldRule(
        "logprobs", "both", "yes", "completions: top-k count (0-20); chat: true/false; raw log-probabilities"
    ),
    FieldRule("top_logprobs", "chat", "yes", "0-20, needs logprobs: true"),
    FieldRule("prompt_logprobs", "both", "yes", "vLLM extension; such prompts skip the prefix cache"),
    FieldRule("return_tokens_as_token_ids", "both", "yes", "vLLM extension: logprobs name tokens token_id:N"),
    FieldRule(
        "echo", "both", "yes", "completions: the prompt before the text (max_tokens 0: the prompt only)"
    ),
    FieldRule(
        "user",
        "both",
        "yes",
        "a session key: a hint to the prefix policy where a conversation's first turn goes "
        "(the x-session-id header wins)",
    ),
    FieldRule("add_special_tokens", "completions", "yes", "vLLM extension"),
    FieldRule("tools", "chat", "yes", "given to the chat template; tool calls come back as text (no parser)"),
    FieldRule("tool_choice", "chat", "400 unless none or auto", refused_example="required"),
    FieldRule("parallel_tool_calls", "chat", "yes", "accepted; no effect without a tool-call parser"),
    FieldRule("chat_template_kwargs", "chat", "yes", "template variables, e.g. enable_thinking"),
    FieldRule("documents", "chat", "yes", "given to the chat template"),
    FieldRule("add_generation_prompt", "chat", "yes"),
    FieldRule("continue_final_message", "chat", "yes"),
    FieldRule(
        "response_format", "both", '400 unless {"type": "text"}', refused_example={"type": "json_object"}
    ),
    FieldRule("suffix", "completions", "400 unless null", refused_example="end"),
    FieldRule(
        "chat_template", "chat", "400 unless null", "set the template with --chat-template", "{{ messages }}"
    ),
    FieldRule("functions", "chat", "400 unless null", "deprecated by OpenAI: use tools", [{"name": "f"}]),
    FieldRule("function_call", "chat", "400 unless null", "deprecated by OpenAI: use tool_choice", "auto"),
    FieldRule("include_stop_str_in_output", "both", "400 unless false", refused_example=True),
    FieldRule("skip_special_tokens", "both", "400 unless true", refused_example=False),
    FieldRule("policy", "both", "yes", "kvmesh extension: the routing policy for this request"),
)

# Unknown field names are remembered (to log each once) up to this many; names that are not
# plain identifiers are never logged as sent: a client's text does not become a log line.
MAX_UNKNOWN_FIELDS = 64
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_seen_unknown: set[str] = set()


def log_unknown_fields(body: BaseModel) -> None:
    """Fields nobody here knows are accepted (as vLLM does) and logged once per name, for
    the first ``MAX_UNKNOWN_FIELDS`` names seen (what a client sends is bounded in memory)."""
    for name in (body.model_extra or {}).keys() - _seen_unknown:
        if len(_seen_unknown) >= MAX_UNKNOWN_FIELDS:
            return
        shown = name if _PLAIN_NAME.fullmatch(name) else "(a name that is not a plain identifier)"
        if shown in _seen_unknown:
            continue
        _seen_unknown.add(shown)
        log.warning("request field is not supported and was ignored", extra={"field": shown})


def _refuse_unless(body: BaseModel, name: str, allowed: tuple) -> None:
    value = getattr(body, name)
    if value not in allowed:
        only = " or ".join("null" if a is None else repr(a) for a in allowed)
        raise InvalidRequest(f"{name}={shown(value)} is not supported (only {only})", param=name)


def _check_logprobs_count(body: BaseModel, name: str) -> None:
    value = getattr(body, name)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", param=name)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    user: str | None = None  # the session key, unless an x-session-id header gives one
    policy: str | None = None  # kvmesh extension: per-request routing policy
    response_format: dict | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False

    def check_supported(self) -> None:
        """InvalidRequest naming the first field whose value kvmesh does not honour."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options needs stream: true", param="stream_options")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise InvalidRequest(
                f"response_format {shown(self.response_format.get('type'))} is not supported (only text)",
                param="response_format",
            )
        _refuse_unless(self, "include_stop_str_in_output", (False,))
        _refuse_unless(self, "skip_special_tokens", (True,))
        log_unknown_fields(self)

    def logit_bias_ids(self) -> dict[int, float]:
        try:
            return {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise InvalidRequest("logit_bias keys must be token ids", param="logit_bias") from None


def _prompt_form(value: Any) -> str | None:
    """Which prompt form ``value`` is, from its first item, so that only that form is
    validated: trying all four made a batch of 300,000 one-token prompts cost twice as much
    (each item failing the other forms first), all of it with the GIL held."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    return "token_id_lists" if isinstance(first, list) else "texts" if isinstance(first, str) else "token_ids"


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[int], Tag("token_ids")]
    | Annotated[list[str], Tag("texts")]
    | Annotated[list[list[int]], Tag("token_id_lists")],
    Discriminator(
        _prompt_form,
        custom_error_type="prompt_form",
        custom_error_message="must be text, token ids, or a list of either",
    ),
]


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        _refuse_unless(self, "best_of", (None, self.n))
        _refuse_unless(self, "suffix", (None,))
        _check_logprobs_count(self, "logprobs")

    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt per choice group."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequest("prompt is empty", param="prompt")
        return list(p)


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[_ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)}, got {shown(role)}")
        return role

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[_ContentPart] | None) -> str:
        """OpenAI content parts (what guidellm's chat mode sends) join into one string."""
        if content is None or isinstance(content, str):
            return content or ""
        if any(part.type != "text" or part.text is None for part in content):
            raise ValueError("only text content parts are supported")
        return "".join(part.text for part in content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    functions: list | None = None
    function_call: str | dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        _refuse_unless(self, "tool_choice", (None, "none", "auto"))
        _refuse_unless(self, "chat_template", (None,))
        _refuse_unless(self, "functions", (None,))
        _refuse_unless(self, "function_call", (None,))
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        _check_logprobs_count(self, "top_logprobs")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def field_table() -> str:
    """The "OpenAI fields" table of docs/api.md (markdown), rendered from FIELD_RULES."""
    rows = ["| field | endpoints | supported | notes |", "|---|---|---|---|"]
    for rule in FIELD_RULES:
        rows.append(f"| `{rule.name}` | {rule.endpoints} | {rule.support} | {rule.note} |")
    return "\n".join(rows)
