"""Prompt tokenization shared by the router and replicas (torch-free)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def render_chat(tokenizer, messages: Iterable[Mapping[str, str]]) -> list[int]:
    """Token ids of a conversation rendered by the model's chat template, ready to answer."""
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not messages:
        raise ValueError("chat has no messages")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; send text or token ids")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)  # the template already has them
