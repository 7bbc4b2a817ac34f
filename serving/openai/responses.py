"""kvmesh.v1 responses -> OpenAI response bodies and SSE events (completions and chat).

One ``ResponseBuilder`` per HTTP request follows every choice (n per prompt, prompts of a
batch one after another in the choice index) and writes both shapes: the streamed events
as responses arrive, and the whole body at the end. Log-probabilities follow OpenAI's two
formats: the legacy completions one (tokens, token_logprobs, top_logprobs, text_offset)
and chat's list of {token, logprob, bytes, top_logprobs}; vLLM's ``prompt_logprobs`` list
where asked. Tokens are named as OpenAI names them: each token decoded on its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from kvmesh.protos import pb
from kvmesh.serving.openai.requests import Plan
from kvmesh.serving.tokenizer import PromptTokenizer

LOGPROB_FLOOR = -9999.0  # what vLLM reports for -inf: JSON has no infinity
# One encoder for every streamed event: json.dumps builds a new one per call whenever an
# argument is not its default (3.9 against 5.3 us an event).
_encode = json.JSONEncoder(ensure_ascii=False).encode


def _lp(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


class TokenNames:
    """Token id -> its text, as logprobs show it ("token_id:N" for a model without a tokenizer)."""

    def __init__(self, tokenizer: PromptTokenizer | None):
        self.tokenizer = tokenizer

    def __call__(self, ids: list[int]) -> list[str]:
        if self.tokenizer is None:
            return [f"token_id:{i}" for i in ids]
        return self.tokenizer.token_strings(ids)


@dataclass
class Echo:
    """A completions prompt shown before its choices' text (``echo``)."""

    text: str
    token_ids: list[int] | None = None  # with logprobs: the prompt's ids, to name its tokens


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: dict | list | None = None
    text_offset: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    prompt_logprobs: list | None = None
    started: bool = False


class ResponseBuilder:
    def __init__(
        self,
        plan: Plan,
        chat: bool,
        model: str,
        names: TokenNames,
        response_id: str,
        created: int,
        echoes: list[Echo] | None = None,
    ):
        self.plan, self.chat, self.model, self.names = plan, chat, model, names
        self.id, self.created = response_id, created
        self.echoes = echoes
        self.choices: dict[int, _Choice] = {}
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        self.kvmesh: dict | None = None  # where the first prompt ran, what the router expected

    # ------------------------------------------------------------------ responses in

    def choice(self, prompt: int, index: int) -> _Choice:
        i = prompt * self.plan.n + index
        return self.choices.setdefault(i, _Choice(i))

    def add(self, prompt: int, response: pb.GenerateResponse) -> dict | None:
        """Take one response; returns the OpenAI choice delta it makes (None: nothing to show)."""
        if response.WhichOneof("kind") == "complete":
            return self._complete(prompt, response.complete)
        chunk = response.chunk
        choice = self.choice(prompt, chunk.index)
        text, ids, entries = chunk.text, list(chunk.token_ids), list(chunk.logprobs)
        if self.plan.echo_only:
            text, ids, entries = "", [], []
        choice.completion_tokens += len(ids)
        if not choice.started:
            choice.started = True
            choice.prompt_tokens = chunk.prompt_tokens
            if self.plan.prompt_logprobs:
                choice.prompt_logprobs = self._prompt_logprobs(chunk)
            if self.plan.echo_prompt:
                echo = self.echoes[prompt]
                text = echo.text + text
                if self.plan.logprobs is not None:
                    ids, entries = [*echo.token_ids, *ids], [None, *chunk.prompt_logprobs, *entries]
        if self.plan.logprobs is None:
            logprobs = None
        elif self.chat:
            logprobs = {"content": self._chat_logprobs(entries)}
        else:
            logprobs = self._completion_logprobs(choice, entries, ids)
        choice.text.append(text)
        self._keep_logprobs(choice, logprobs)
        return self._delta(choice, text, logprobs, None)

    def _complete(self, prompt: int, complete: pb.Complete) -> dict:
        choice = self.choice(prompt, complete.index)
        choice.finish_reason = "length" if self.plan.echo_only else complete.finish_reason
        usage = complete.usage
        if complete.index == 0:
            self.usage["prompt_tokens"] += usage.prompt_tokens
            self.usage["cached_tokens"] += usage.cached_tokens
        if not self.plan.echo_only:
            self.usage["completion_tokens"] += usage.completion_tokens
        if self.kvmesh is None:
            self.kvmesh = {
                "replica_id": complete.replica_id,
                "predicted_cached_tokens": complete.predicted_cached_tokens,
            }
        return self._delta(choice, "", None, choice.finish_reason)

    # ------------------------------------------------------------------ log-probabilities

    def _completion_logprobs(self, choice: _Choice, entries: list, ids: list[int]) -> dict:
        names = self.names(ids)
        offsets = []
        for name in names:
            offsets.append(choice.text_offset)
            choice.text_offset += len(name)
        top = []
        for name, entry in zip(names, entries, strict=True):
            if entry is None:
                top.append(None)
                continue
            top_names = self.names([t.token_id for t in entry.top])
            alternatives = {n: _lp(t.logprob) for n, t in zip(top_names, entry.top, strict=True)}
            alternatives.setdefault(name, _lp(entry.logprob))
            top.append(alternatives)
        return {
            "tokens": names,
            "token_logprobs": [None if e is None else _lp(e.logprob) for e in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _chat_logprobs(self, entries: list[pb.TokenLogprob]) -> list[dict]:
        names = self.names([e.token_id for e in entries])
        content = []
        for name, entry in zip(names, entries, strict=True):
            top_names = self.names([t.token_id for t in entry.top])
            content.append(
                {
                    **_named(name, entry.logprob),
                    "top_logprobs": [_named(n, t.logprob) for n, t in zip(top_names, entry.top, strict=True)],
                }
            )
        return content

    def _prompt_logprobs(self, chunk: pb.Chunk) -> list:
        """vLLM's shape: None for the first token, then {token_id: {logprob, rank, decoded_token}}
        with the prompt's token and its top alternatives."""
        out: list = [None]
        for entry in chunk.prompt_logprobs:
            ids = [entry.token_id, *(t.token_id for t in entry.top)]
            names = self.names(ids)
            position = {
                str(t.token_id): {"logprob": _lp(t.logprob), "rank": rank, "decoded_token": name}
                for rank, (t, name) in enumerate(zip(entry.top, names[1:], strict=True), start=1)
            }
            position[str(entry.token_id)] = {
                "logprob": _lp(entry.logprob),
                "rank": entry.rank,
                "decoded_token": names[0],
            }
            out.append(position)
        return out

    def _keep_logprobs(self, choice: _Choice, logprobs: dict | None) -> None:
        if logprobs is None:
            return
        if self.chat:
            choice.logprobs = choice.logprobs or {"content": []}
            choice.logprobs["content"] += logprobs["content"]
        elif choice.logprobs is None:
            choice.logprobs = {k: list(v) for k, v in logprobs.items()}
        else:
            for key, values in logprobs.items():
                choice.logprobs[key] += values

    # ------------------------------------------------------------------ bodies out

    def _delta(self, choice: _Choice, text: str, logprobs, finish: str | None) -> dict:
        if self.chat:
            delta = {"content": text} if text or finish is None else {}
            return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def openai_usage(self) -> dict:
        u = self.usage
        return {
            "prompt_tokens": u["prompt_tokens"],
            "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
        }

    def event(self, choices: list[dict], usage: dict | None = None) -> str:
        payload = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            payload["usage"] = usage
        return f"data: {_encode(payload)}\n\n"

    def opening_events(self) -> list[str]:
        """Chat streams open each choice with the assistant role (and an echoed prefix)."""
        if not self.chat:
            return []
        events = []
        for i in range(self.plan.n):
            delta = {"role": "assistant", "content": ""}
            events.append(self.event([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]))
            if self.plan.chat_prefix:
                delta = {"content": self.plan.chat_prefix}
                events.append(
                    self.event([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
                )
        return events

    def running_usage(self, index: int) -> dict:
        """``continuous_usage_stats``: this choice's usage so far."""
        choice = self.choices[index]
        return {
            "prompt_tokens": choice.prompt_tokens,
            "completion_tokens": choice.completion_tokens,
            "total_tokens": choice.prompt_tokens + choice.completion_tokens,
        }

    def body(self) -> dict:
        choices = []
        for i in sorted(self.choices):
            c = self.choices[i]
            choice: dict = {"index": i, "finish_reason": c.finish_reason, "logprobs": c.logprobs}
            text = "".join(c.text)
            if self.chat:
                choice["message"] = {"role": "assistant", "content": self.plan.chat_prefix + text}
            else:
                choice["text"] = text
            if c.prompt_logprobs is not None:
                choice["prompt_logprobs"] = c.prompt_logprobs
            choices.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.openai_usage(),
            "kvmesh": self.kvmesh or {},
        }


def _named(name: str, logprob: float) -> dict:
    return {"token": name, "logprob": _lp(logprob), "bytes": list(name.encode("utf-8"))}
