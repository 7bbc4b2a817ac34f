"""Per-request sampling and stopping parameters, validated once at admission."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_MAX_TOKENS = 16  # vLLM's default when a request does not say
# Temperatures below this are greedy (as in vLLM): dividing logits by, say, 1e-40 overflows
# to inf and the softmax to NaN, which would fail the whole batch's step.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` (or below ``GREEDY_BELOW``) is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes a sampled request reproducible whatever else is in the batch.
    ``stop`` strings end generation and are not returned; ``stop_token_ids`` end it too.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        """Raise ``ValueError`` with a message naming the bad field."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")


def sampling_from_proto(p) -> SamplingParams:
    """``kvmesh.v1.SamplingParams`` -> SamplingParams; unset optional fields keep the defaults.

    Raises ``ValueError`` (with the field named) for values the engine would reject.
    """
    kwargs: dict = {
        "ignore_eos": p.ignore_eos,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
    }
    for name in ("temperature", "top_p", "top_k", "max_tokens", "seed"):
        if p.HasField(name):
            kwargs[name] = getattr(p, name)
    return SamplingParams(**kwargs)
