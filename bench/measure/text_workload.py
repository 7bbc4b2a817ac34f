"""Token-id workloads as text, for routers that only see text (OpenAI HTTP peers).

Each token id becomes one whole word of the model's own vocabulary (a space-led,
alphabetic token that encodes back to itself alone). Equal token segments give equal
text, and because every word starts with a space, a byte-level tokenizer splits at the
same places whatever follows: requests that share a prefix in ids share it in text and,
re-tokenized, again in ids (so in KV blocks), about one token per word.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from kvmesh.bench.measure.workloads import DEFAULT_VOCAB, Segment, WorkloadRequest, segment_tokens


def word_table(model_dir: str | Path) -> list[str]:
    """Space-led words that are exactly one token each, in a stable order."""
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    words = []
    for token in sorted(tokenizer.get_vocab()):
        word = tokenizer.decode([tokenizer.token_to_id(token)])
        alphabetic = word.startswith(" ") and word[1:].isascii() and word[1:].isalpha()
        if alphabetic and len(tokenizer.encode(word, add_special_tokens=False).ids) == 1:
            words.append(word)
    if len(words) < 16:
        raise ValueError(f"the tokenizer in {model_dir} has too few whole-word tokens ({len(words)})")
    return words


def as_text(requests: Sequence[WorkloadRequest], words: Sequence[str]) -> list[str]:
    return ["".join(segment_text(s, words, r.vocab) for s in r.segments) for r in requests]


def segment_text(segment: Segment, words: Sequence[str], vocab: int = DEFAULT_VOCAB) -> str:
    """One segment's tokens as words (conversations build their prompts a segment at a time)."""
    return "".join(words[t % len(words)] for t in segment_tokens(segment, vocab).tolist())
