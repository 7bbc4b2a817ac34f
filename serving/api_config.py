"""How a server presents its model to clients, with the flag names vLLM users know.

Shared by the router and the replicas (``kvmesh up`` passes one set of these flags to both),
so both tokenize with the same tokenizer and template and apply the same defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmesh.serving.generation_config import SOURCES, GenerationDefaults
from kvmesh.serving.options import option
from kvmesh.serving.tokenizer import PromptTokenizer


@dataclass(frozen=True)
class APIConfig:
    served_model_name: str | None = option(
        None, help="the model's name in the API (/v1/models, the 'model' field; default: the model id)"
    )
    tokenizer: str | None = option(None, help="folder with the tokenizer files (default: the model folder)")
    chat_template: str | None = option(
        None, help="chat template: a file, or the template itself (default: the tokenizer's)"
    )
    tokenizer_cache_bytes: int = option(
        64 << 20,
        former="tokenizer-cache-mb",
        former_unit=1 << 20,
        help="bytes of shared prompt text kept tokenized, so a shared prefix is tokenized once (0: off)",
    )
    generation_config: str = option(
        "auto",
        help="sampling defaults: auto (the model's generation_config.json), vllm (none), or a folder",
    )

    def __post_init__(self) -> None:
        # Paths are checked where they are read: a replica's folders are on its own node.
        if self.served_model_name == "":
            raise ValueError("served_model_name must not be empty")
        if self.tokenizer_cache_bytes < 0:
            raise ValueError("tokenizer_cache_bytes must be >= 0")
        if not self.generation_config:
            raise ValueError(f"generation_config must be one of {', '.join(SOURCES)} or a folder")

    def tokenizer_dir(self, model_dir: str) -> str:
        return self.tokenizer or model_dir

    def load_tokenizer(self, model_dir: str) -> PromptTokenizer | None:
        """The prompt tokenizer; None for a model folder without one (token ids only)."""
        folder = Path(self.tokenizer_dir(model_dir))
        if self.tokenizer is None and not (folder / "tokenizer.json").is_file():
            return None
        return PromptTokenizer(folder, self.template_text(), self.tokenizer_cache_bytes)

    def load_defaults(self, model_dir: str) -> GenerationDefaults:
        return GenerationDefaults.load(self.generation_config, model_dir)

    def template_text(self) -> str | None:
        """The --chat-template override: a file's text, or the flag's value as the template."""
        if not self.chat_template:
            return None
        path = Path(self.chat_template)
        if path.is_file():
            return path.read_text()
        if "{" not in self.chat_template:  # neither a file nor a template: most likely a typo'd path
            raise ValueError(f"--chat-template {self.chat_template!r} is neither a file nor a template")
        return self.chat_template
