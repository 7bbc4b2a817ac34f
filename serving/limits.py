"""Bounds on every count and size a client controls, checked before any work is done for them.

The router and every replica check the same bounds (replicas are reachable directly), with
the same flags: a request over one is a 400 / INVALID_ARGUMENT whose message starts with
the field, and a batch is counted before one prompt of it is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.protos import pb
from kvmesh.serving.errors import InvalidRequest
from kvmesh.serving.options import option


@dataclass(frozen=True)
class InputLimits:
    max_batch_prompts: int = option(256, help="prompts in one completions request (a batch)")
    max_choices: int = option(256, help="sequences one request may start: n x prompts")
    max_messages: int = option(1024, help="messages in one chat")
    max_stop_strings: int = option(32, flag="max-stop", help="stop strings per request")
    max_stop_chars: int = option(512, help="characters in one stop string")
    max_stop_token_ids: int = option(256, help="stop token ids per request")
    max_logit_bias: int = option(1024, help="logit_bias entries per request")
    max_template_bytes: int = option(
        512 << 10, help="bytes of tools, documents, chat_template_kwargs and tool calls, together"
    )
    max_request_id_chars: int = option(
        256, help="characters in a client's request id (echoed in every response)"
    )
    max_session_key_bytes: int = option(
        256, help="bytes of a session key (gRPC affinity_key, the x-session-id header or OpenAI's user)"
    )

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check_batch(self, prompts: int, n: int) -> None:
        """A completions batch, counted before anything is built for it."""
        _at_most("prompt", prompts, self.max_batch_prompts, "prompts in one request", "--max-batch-prompts")
        what = f"sequences ({n} choices x {prompts} prompts)"
        _at_most("n", prompts * n, self.max_choices, what, "--max-choices")

    def check_session_key(self, field: str, key: str) -> None:
        """A session key, under the name the client gave it (a field or a header)."""
        size = len(key.encode())
        _at_most(field, size, self.max_session_key_bytes, "bytes", "--max-session-key-bytes")

    def check(self, request: pb.GenerateRequest) -> None:
        """One request's counts and sizes (before it is rendered, tokenized or queued)."""
        _at_most(
            "request_id",
            len(request.request_id),
            self.max_request_id_chars,
            "characters",
            "--max-request-id-chars",
        )
        self.check_session_key("affinity_key", request.affinity_key)
        s = request.sampling
        _at_most("stop", len(s.stop), self.max_stop_strings, "stop strings", "--max-stop")
        longest = max((len(text) for text in s.stop), default=0)
        _at_most("stop", longest, self.max_stop_chars, "characters in a stop string", "--max-stop-chars")
        _at_most(
            "stop_token_ids", len(s.stop_token_ids), self.max_stop_token_ids, "ids", "--max-stop-token-ids"
        )
        _at_most("logit_bias", len(s.logit_bias), self.max_logit_bias, "entries", "--max-logit-bias")
        _at_most("n", s.n, self.max_choices, "choices", "--max-choices")
        if request.WhichOneof("input") == "chat":
            chat = request.chat
            _at_most("messages", len(chat.messages), self.max_messages, "messages", "--max-messages")
            texts = [chat.tools_json, chat.documents_json, chat.template_kwargs_json]
            template = sum(len(t.encode()) for t in texts + [m.tool_calls_json for m in chat.messages])
            _at_most(
                "tools",
                template,
                self.max_template_bytes,
                "bytes of tools, documents, chat_template_kwargs and tool calls",
                "--max-template-bytes",
            )


def _at_most(field: str, value: int, limit: int, what: str, flag: str) -> None:
    if value > limit:
        raise InvalidRequest(f"{field}: {value} {what}, the limit is {limit} ({flag})", param=field)
