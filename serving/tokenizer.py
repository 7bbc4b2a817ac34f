"""Prompt tokenization without torch: `tokenizers` for ids, transformers' own chat-template
renderer for chats.

The router must tokenize exactly as the replicas do (same ids, same block hashes) but may
not import torch, and ``import transformers`` (``AutoTokenizer``) imports torch when it is
installed. So this reads the ``tokenizer.json`` with the `tokenizers` library (the Rust
tokenizer ``AutoTokenizer`` wraps) and renders chats with
``transformers.utils.chat_template_utils.render_jinja_template``: the function
``apply_chat_template`` calls, which imports neither torch nor the tokenizer classes. So
tools, documents, ``continue_final_message``, ``add_generation_prompt``, the
``{% generation %}`` tag and template kwargs behave as in transformers and vLLM. Tests
check ids and rendered chats against ``AutoTokenizer``, and that the router stays torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kvmesh.serving.segment_cache import SEGMENT_CHARS, SegmentCache

# Variables the renderer sets itself: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template"}
)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _default_template(config: dict, folder: Path) -> str | None:
    """The folder's chat template: ``chat_template.jinja``, else tokenizer_config.json's
    (a list of named templates: the one named "default")."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template or None


class PromptTokenizer:
    def __init__(self, tokenizer_dir: str | Path, chat_template: str | None = None, cache_bytes: int = 0):
        """``cache_bytes``: how much text and ids of shared prompt parts to keep
        (``segment_cache``; 0, or a tokenizer it cannot cut exactly: none)."""
        path = Path(tokenizer_dir)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer folder {str(path)!r} has no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self._token_strings: dict[int, str] = {}
        self._vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.segments = SegmentCache.of(self.tokenizer, cache_bytes)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        # What transformers gives every template: its special tokens, by name.
        self.special_tokens = {
            name: _token_text(config[name]) or ""
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if config.get(name) is not None
        }
        self.special_tokens.setdefault("bos_token", "")
        self.special_tokens.setdefault("eos_token", "")
        self.template = chat_template or _default_template(config, path)
        # Imported here, not at module level: the CLI imports this module, and importing
        # transformers (even this corner of it) reads HF_HUB_OFFLINE once, before
        # `kvmesh download-model` can turn it off for itself.
        from transformers.utils.chat_template_utils import render_jinja_template

        self._render = render_jinja_template

    @property
    def has_chat_template(self) -> bool:
        return self.template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.segments is not None and len(text) > 2 * SEGMENT_CHARS:  # shorter: no part to share
            ids = self.segments.encode(text, add_special_tokens)
            if ids is not None:
                return ids
        # encode_batch_fast skips the character offsets we never use (~35% faster).
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token decoded on its own (how OpenAI and vLLM name tokens in logprobs),
        remembered: a prompt's log-probabilities name every alternative of every token, mostly
        the same few tokens again, and decoding each anew cost more than the rest of the answer."""
        known = self._token_strings
        new = list({i for i in ids if i not in known})
        fresh = {}
        if new:
            decoded = self.tokenizer.decode_batch([[i] for i in new], skip_special_tokens=False)
            fresh = dict(zip(new, decoded, strict=True))
        if len(known) + len(fresh) <= self._vocab_size:  # ids past the vocabulary never grow it more
            known.update(fresh)
        return [fresh[i] if i in fresh else known[i] for i in ids]

    def render_chat_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as the model's chat template writes it; ValueError with the reason."""
        if not messages:
            raise ValueError("chat has no messages")
        if self.template is None:
            raise ValueError(
                "this model has no chat template; send text or token ids (or use --chat-template)"
            )
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys())
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        try:
            rendered, _ = self._render(
                [messages],
                tools=tools,
                documents=documents,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **{**self.special_tokens, **kwargs},
            )
        except Exception as exc:  # the template's raise_exception, a jinja error, bad data
            raise ValueError(f"chat template: {exc}") from None
        return rendered[0]

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """Token ids of the rendered conversation (the template writes the special tokens)."""
        return self.encode(self.render_chat_text(messages, **options), add_special_tokens=False)
