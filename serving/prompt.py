"""A GenerateRequest's prompt as token ids: one definition for the router and the replicas,
so both tokenize (and therefore hash) every input kind the same way."""

from __future__ import annotations

import asyncio

from kvmesh.protos import pb
from kvmesh.serving.errors import InvalidRequest
from kvmesh.serving.tokenizer import PromptTokenizer

_INLINE_TOKENIZE_CHARS = 8192


async def prompt_ids(
    request: pb.GenerateRequest, tokenizer: PromptTokenizer | None, vocab_size: int
) -> list[int]:
    """Token ids of text, chat messages (chat template) or ids; InvalidRequest with the reason."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("request has no input: set text, token_ids or chat")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    elif tokenizer is None:
        raise InvalidRequest("this model has no tokenizer; send token ids")
    elif kind == "text":
        ids = await _off_loop(tokenizer.encode, request.text) if request.text else []
    else:
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        try:
            ids = await _off_loop(tokenizer.render_chat, messages)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
    if not ids:
        raise InvalidRequest("prompt is empty")
    return ids


async def _off_loop(fn, arg):
    """Tokenize long inputs in a thread (the tokenizer releases the GIL) so one long prompt
    does not stall every other stream; short ones inline (cheaper)."""
    size = len(arg) if isinstance(arg, str) else sum(len(m["content"]) for m in arg)
    return await asyncio.to_thread(fn, arg) if size > _INLINE_TOKENIZE_CHARS else fn(arg)
