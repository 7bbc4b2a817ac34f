"""What a server tells clients about the model it serves (and what prompts are checked against)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvmesh.kvcache import namespace_seed
from kvmesh.serving.errors import NotFound, shown

# What may compute a replica's model: kvmesh's own engine, or a vLLM server the replica runs.
ENGINE_KINDS = ("kvmesh", "vllm")


def model_id_of(model_dir: str | Path, model_id: str | None = None) -> str:
    """A model's name in the index and the API: its given id, else its folder's name (what the
    router, the replicas and the launcher must agree on)."""
    return model_id or Path(model_dir).resolve().name


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    block_size: int
    max_model_len: int
    vocab_size: int
    hash_seed: int
    served_model_name: str | None = None  # the name in the API, when not the model id

    @property
    def api_name(self) -> str:
        return self.served_model_name or self.model_id

    def check_named(self, name: str | None) -> None:
        """NotFound unless ``name``, a request's model field, names this model: its served
        name, its id, or nothing (a server of one model takes a request that names none)."""
        if name not in (None, "", self.api_name, self.model_id):
            raise NotFound(f"model {shown(name)} is not served here; this server serves {self.api_name!r}")

    @classmethod
    def from_folder(
        cls,
        model_dir: str | Path,
        model_id: str | None,
        block_size: int,
        max_model_len: int | None,
        served_model_name: str | None = None,
    ) -> ModelInfo:
        """From a model folder's ``config.json`` alone (no weights, no torch): the router's view.

        ``model_id`` defaults to the folder's name and ``max_model_len`` to the model's
        ``max_position_embeddings``, as the replicas' engines choose them.
        """
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {str(path)!r} has no config.json")
        hf = json.loads((path / "config.json").read_text())
        model_id = model_id_of(path, model_id)
        return cls(
            model_id=model_id,
            block_size=block_size,
            max_model_len=max_model_len or hf.get("max_position_embeddings") or 4096,
            vocab_size=hf["vocab_size"],
            hash_seed=namespace_seed(model_id, block_size),
            served_model_name=served_model_name,
        )
