"""Sampling defaults and the max_tokens rule: one place, so the router and the replicas
resolve a request's parameters the same way.

``--generation-config auto`` (the default, as in vLLM) takes the model's
``generation_config.json`` sampling values as defaults for requests that leave a field
unset; ``vllm`` uses the engine's own defaults; a folder path reads that folder's file.
Like vLLM, only values that differ from transformers' own defaults count (a file that
writes ``top_k: 50`` has not chosen top-k sampling, it has left transformers' default).

max_tokens left unset: a chat gets the rest of the context window, anything else 16
(vLLM's completions default); either is lowered to the file's ``max_new_tokens`` and to
the server's max-tokens limit, never refused. A max_tokens the client set is checked, not
changed.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.protos import pb
from kvmesh.serving.sampling_params import DEFAULT_MAX_TOKENS

# generation_config.json key -> (kvmesh.v1.SamplingParams field, transformers' default)
_KEYS = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 50),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}
SOURCES = ("auto", "vllm")  # or a folder path


class GenerationDefaults:
    """The defaults a request's unset sampling fields take."""

    def __init__(self, values: dict[str, float | int] | None = None, source: str = "vllm"):
        self.values = dict(values or {})
        self.source = source

    @classmethod
    def load(cls, source: str, model_dir: str | Path | None) -> GenerationDefaults:
        """``auto`` (the model folder's file), ``vllm`` (none) or a folder; ValueError if a
        named folder has no readable file."""
        if source == "vllm":
            return cls(source=source)
        folder = Path(model_dir) if source == "auto" and model_dir else Path(source)
        path = folder / "generation_config.json"
        if not path.is_file():
            if source == "auto":
                return cls(source=source)  # a model without one: engine defaults
            raise ValueError(f"--generation-config: {str(path)!r} does not exist")
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--generation-config: cannot read {str(path)!r}: {exc}") from None
        values = {
            field: config[key]
            for key, (field, hf_default) in _KEYS.items()
            if config.get(key) is not None and config[key] != hf_default
        }
        return cls(values, source)

    def resolve(
        self,
        request: pb.GenerateRequest,
        num_prompt_tokens: int,
        max_model_len: int,
        max_tokens_limit: int | None = None,
    ) -> pb.SamplingParams:
        """The request's sampling with every default filled in (a copy)."""
        sampling = pb.SamplingParams()
        sampling.CopyFrom(request.sampling)
        for field, value in self.values.items():
            if field != "max_tokens" and not sampling.HasField(field):
                setattr(sampling, field, value)
        if not sampling.HasField("max_tokens"):
            room = max_model_len - num_prompt_tokens
            default = room if request.WhichOneof("input") == "chat" else DEFAULT_MAX_TOKENS
            bounds = (default, room, self.values.get("max_tokens"), max_tokens_limit)
            sampling.max_tokens = max(1, min(b for b in bounds if b is not None))
        return sampling
