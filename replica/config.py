"""Engine configuration: one dataclass whose field names are the public config names.

``LLMEngine(model_dir, **config)`` and the CLI flags use exactly these names; an unknown
name is a ``ValueError``, never silently ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

GiB = 1 << 30


@dataclass
class EngineConfig:
    block_size: int | None = None  # tokens per KV block; None: 256 with flash-attn, else 16
    num_kv_blocks: int | None = None  # fixed pool size (wins over the memory settings)
    kv_cache_memory: int = GiB // 2  # bytes for the KV pool on CPU
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights + activations + KV
    max_num_seqs: int = 64  # sequences in one batch
    max_num_batched_tokens: int = 2048  # tokens computed in one step (chunked prefill budget)
    max_queued_requests: int = 1024  # waiting requests beyond this are refused (RESOURCE_EXHAUSTED)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's half type on CUDA
    device: str | None = None  # None: cuda if available, else cpu
    seed: int = 0  # engine RNG: seeds requests that carry no seed of their own
    attention_backend: str | None = None  # None: flash-attn where usable, else torch

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        config = cls(**kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        positive = ["max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "max_queued_requests"]
        positive += [
            n for n in ("block_size", "num_kv_blocks", "max_model_len") if getattr(self, n) is not None
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in (None, "torch", "flash_attn"):
            raise ValueError(
                f"attention_backend must be 'torch' or 'flash_attn', got {self.attention_backend!r}"
            )
