"""Incremental detokenization with stop strings.

Byte-level BPE tokens can end inside a UTF-8 character, and sentencepiece tokens carry
their leading space only in context, so each new token is decoded together with a few
tokens before it and text is released only once it is stable (no trailing U+FFFD). When
stop strings are set, the last ``max(len(stop)) - 1`` characters are held back until it
is clear they do not start a stop string; a matched stop string is never returned.
"""

from __future__ import annotations

from collections.abc import Callable

_CONTEXT_TOKENS = 5


def token_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``ids -> text`` as ``tokenizer.decode(ids, skip_special_tokens=True)`` gives it: straight
    from the Rust tokenizer where that is the whole of it (transformers' wrapper costs several
    times the decode itself, twice per token per request), else through the wrapper."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], prompt_token_ids: list[int], stop: list[str]):
        """``decode``: ``token_decoder(tokenizer)``, made once per tokenizer by the engine."""
        self._decode = decode
        self.tokens = list(prompt_token_ids[-(_CONTEXT_TOKENS + 1) :])
        self.prefix_offset = max(len(self.tokens) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # output text so far (stop string removed once matched)
        self.emitted = 0  # characters of ``text`` already handed out

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one token; returns (text that is now safe to emit, whether a stop string matched)."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        new = ""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += new
        if new and self.stop and self._truncate_at_stop(len(new)):
            return self.flush(), True
        safe_end = len(self.text) - self.hold_back if self.stop else len(self.text)
        if safe_end <= self.emitted:
            return "", False
        delta = self.text[self.emitted : safe_end]
        self.emitted = safe_end
        return delta, False

    def _truncate_at_stop(self, new_chars: int) -> bool:
        start = max(0, len(self.text) - new_chars - self.hold_back)
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def flush(self) -> str:
        """Everything not yet emitted (call when the request finishes)."""
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
