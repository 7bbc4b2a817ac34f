"""Exact tokenization of prompts that share text, from cached segments.

Prompts that share a system prompt, a document or a conversation's earlier turns were
tokenized again in full on every request (the largest part of a router's own work on a
prompt of a few hundred tokens). For the tokenizers whose every step is local to
its pre-tokens, a text cut where an ASCII non-space character is followed by " " and an
ASCII letter tokenizes as the concatenation of its parts' tokens:

- NFC (the only normalizer allowed) neither composes nor reorders across ASCII characters,
  so normalizing the parts is normalizing the whole;
- no alternative of the allowed split patterns (GPT-2's, Llama 3's, Qwen 2/3's) matches a
  non-space character followed by a space, so in the whole text a pre-token ends before the
  space and the scan starts again there, as it starts on the part alone; the patterns look
  neither behind nor (``\\s+(?!\\S)``) past a part that ends in a non-space character;
- byte-level BPE (no dropout) works within a pre-token, and no added token holds whitespace
  or strips it, so none spans a cut.

So a text is cut at the first such point after every ``SEGMENT_CHARS`` characters, each part
but the last is looked up by its exact text in a bounded LRU, and the rest are tokenized in
one batch call. A tokenizer outside that family (``segmentable`` says why) is not cached.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from array import array
from collections import OrderedDict

from tokenizers import Tokenizer

SEGMENT_CHARS = 256  # a part's length before its cut: shorter keeps more of a shared prefix
_CUT = re.compile(r"[!-~] [A-Za-z]")  # the cut goes before the space
_ENTRY_OVERHEAD_BYTES = 150  # the LRU's own per-entry cost (its node, the ids' array header)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_SPLIT_PATTERNS = frozenset(
    {
        _GPT2_SPLIT,
        # Llama 3 (and tiktoken's cl100k), then Qwen 2 and 3: digits alone rather than in threes
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)


def segmentable(tokenizer: Tokenizer) -> str | None:
    """None when ``tokenizer`` tokenizes cut texts exactly as whole ones (the module's
    argument), else why not."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("truncation") or spec.get("padding"):
        return "it truncates or pads"
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return f"normalizer {normalizer.get('type')}"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return "its model is not byte-level BPE without dropout"
    if not _splits_at_spaces(spec.get("pre_tokenizer") or {}):
        return "its pre-tokenizer is not a known byte-level split"
    for token in spec.get("added_tokens") or ():
        content = token.get("content", "")
        if token.get("lstrip") or token.get("rstrip") or any(ch.isspace() for ch in content):
            return f"added token {content!r} holds or strips whitespace"
    return None


def _splits_at_spaces(pre: dict) -> bool:
    if pre.get("type") == "ByteLevel":
        return bool(pre.get("use_regex", True))
    steps = pre.get("pretokenizers") or []
    if pre.get("type") != "Sequence" or len(steps) != 2 or steps[1].get("type") != "ByteLevel":
        return False
    split = steps[0]
    pattern = (split.get("pattern") or {}).get("Regex")
    return (
        split.get("type") == "Split"
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and pattern in _SPLIT_PATTERNS
    )


def _special_frame(tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids ``add_special_tokens`` puts before and after a text (a BOS, say), when it does
    only that; None otherwise."""
    frames = set()
    for probe in ("a", "Hello world"):
        plain = tokenizer.encode(probe, add_special_tokens=False).ids
        framed = tokenizer.encode(probe, add_special_tokens=True).ids
        at = next((i for i in range(len(framed) - len(plain) + 1) if framed[i : i + len(plain)] == plain), -1)
        if at < 0:
            return None
        frames.add((tuple(framed[:at]), tuple(framed[at + len(plain) :])))
    if len(frames) != 1:
        return None
    head, tail = frames.pop()
    return list(head), list(tail)


def cut(text: str) -> list[str]:
    """``text`` in parts, each but the last ending at the first cut point after
    ``SEGMENT_CHARS`` characters of it (two texts that share a prefix share its parts)."""
    parts, start = [], 0
    while (found := _CUT.search(text, start + SEGMENT_CHARS)) is not None:
        end = found.start() + 1
        parts.append(text[start:end])
        start = end
    parts.append(text[start:])
    return parts


class SegmentCache:
    """Token ids of text parts, by their exact text, least recently used out first, at most
    ``max_bytes`` (text, ids and overhead). Thread-safe: long prompts tokenize off the loop."""

    @classmethod
    def of(cls, tokenizer: Tokenizer, max_bytes: int) -> SegmentCache | None:
        """A cache for ``tokenizer``; None when it is off (0 bytes) or ``tokenizer`` cannot be
        cut exactly (``segmentable``)."""
        return cls(tokenizer, max_bytes) if max_bytes > 0 and segmentable(tokenizer) is None else None

    def __init__(self, tokenizer: Tokenizer, max_bytes: int):
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self.frame = _special_frame(tokenizer)
        self._parts: OrderedDict[str, array] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._parts)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        """``text``'s ids as the tokenizer gives them; None where the cache cannot frame the
        special tokens (the caller tokenizes the whole text itself)."""
        if add_special_tokens and self.frame is None:
            return None
        parts = cut(text)
        with self._lock:
            known = [self._hit(part) for part in parts[:-1]]
        missing = [i for i, ids in enumerate(known) if ids is None]
        fresh = self.tokenizer.encode_batch_fast(
            [parts[i] for i in missing] + [parts[-1]], add_special_tokens=False
        )
        for i, encoding in zip(missing, fresh, strict=False):
            known[i] = array("i", encoding.ids)
        with self._lock:
            for i in missing:
                self._keep(parts[i], known[i])
        ids = array("i")
        for part_ids in known:
            ids.extend(part_ids)
        ids.extend(fresh[-1].ids)
        if add_special_tokens:
            head, tail = self.frame
            return head + ids.tolist() + tail
        return ids.tolist()

    def _hit(self, part: str) -> array | None:
        ids = self._parts.get(part)
        if ids is not None:
            self._parts.move_to_end(part)
        return ids

    def _keep(self, part: str, ids: array) -> None:
        if part in self._parts:
            return
        size = _size(part, ids)
        if size > self.max_bytes:
            return
        self._parts[part] = ids
        self._bytes += size
        while self._bytes > self.max_bytes:
            old, old_ids = self._parts.popitem(last=False)
            self._bytes -= _size(old, old_ids)


def _size(part: str, ids: array) -> int:
    return sys.getsizeof(part) + ids.itemsize * len(ids) + _ENTRY_OVERHEAD_BYTES
