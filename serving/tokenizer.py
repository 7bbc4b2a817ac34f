"""Prompt tokenization without torch: `tokenizers` for ids, jinja2 for chat templates.

The router must tokenize exactly as the replicas do (same ids, same block hashes) but may
not import torch, and ``transformers`` imports torch when it is installed. So this reads
the model folder's ``tokenizer.json`` with the `tokenizers` library (the same Rust
tokenizer ``AutoTokenizer`` wraps) and renders chat templates in a sandboxed jinja2
environment configured like transformers'. Tests check both against ``AutoTokenizer``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str):
    raise ValueError(f"chat template: {message}")


class PromptTokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"model folder {str(path)!r} has no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        # encode_batch_fast skips the character offsets we never use (~35% faster).
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=True)[0].ids

    def render_chat(self, messages: Iterable[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template, ready to answer."""
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if not messages:
            raise ValueError("chat has no messages")
        if self._template is None:
            raise ValueError("this model has no chat template; send text or token ids")
        text = self._template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[
            0
        ].ids  # the template has them
