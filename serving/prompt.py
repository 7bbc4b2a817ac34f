"""A GenerateRequest's prompt as token ids: one definition for the router and the replicas,
so both tokenize (and therefore hash) every input kind the same way."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from kvmesh.protos import pb
from kvmesh.serving.errors import InvalidRequest
from kvmesh.serving.offload import sized
from kvmesh.serving.tokenizer import PromptTokenizer


async def prompt_ids(
    request: pb.GenerateRequest, tokenizer: PromptTokenizer | None, vocab_size: int
) -> list[int]:
    """Token ids of text, chat messages (chat template) or ids; InvalidRequest with the reason.
    Off the event loop when the request is large (its whole size decides, not its text's)."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("request has no input: set text, token_ids or chat")
    if kind != "token_ids" and tokenizer is None:
        raise InvalidRequest("this model has no tokenizer; send token ids")
    ids = await sized(request.ByteSize(), _prompt_ids, request, kind, tokenizer, vocab_size)
    if not ids:
        raise InvalidRequest("prompt is empty")
    return ids


def _prompt_ids(
    request: pb.GenerateRequest, kind: str, tokenizer: PromptTokenizer | None, vocab_size: int
) -> list[int]:
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        return ids
    if kind == "text":
        return tokenizer.encode(request.text) if request.text else []
    messages, options = chat_arguments(request.chat)
    try:
        return tokenizer.render_chat(messages, **options)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def chat_arguments(chat: pb.ChatMessages) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, renderer options) of a ``kvmesh.v1.ChatMessages``, as transformers takes them."""
    messages = [_message(m) for m in chat.messages]
    options: dict[str, Any] = {
        "tools": _json(chat.tools_json, "tools_json", list),
        "documents": _json(chat.documents_json, "documents_json", list),
        "template_kwargs": _json(chat.template_kwargs_json, "template_kwargs_json", dict),
        "add_generation_prompt": chat.add_generation_prompt
        if chat.HasField("add_generation_prompt")
        else True,
        "continue_final_message": chat.continue_final_message,
    }
    return messages, options


def _message(m: pb.ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        message["name"] = m.name
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls_json:
        calls = _json(m.tool_calls_json, "tool_calls_json", list)
        for call in calls:  # templates expect arguments as an object, OpenAI sends a JSON string
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                with contextlib.suppress(ValueError):  # not JSON: the template gets the string
                    function["arguments"] = json.loads(function["arguments"])
        message["tool_calls"] = calls
    return message


def _json(text: str, name: str, kind: type):
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, kind):
        raise InvalidRequest(f"{name} must be a JSON {'list' if kind is list else 'object'}")
    return value
