"""Per-request sampling and stopping parameters, validated once at admission."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

DEFAULT_MAX_TOKENS = 16  # vLLM's default when a request does not say
MAX_LOGPROBS = 20  # alternatives per token, at most (OpenAI's top_logprobs limit)
MAX_N = 16  # choices per request, at most
# Temperatures below this are greedy (as in vLLM): dividing logits by, say, 1e-40 overflows
# to inf and the softmax to NaN, which would fail the whole batch's step.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` (or below ``GREEDY_BELOW``) is greedy. ``top_k <= 0``, ``top_p == 1``
    and ``min_p == 0`` disable those filters. ``seed`` makes a sampled request reproducible
    whatever else is in the batch. ``stop`` strings end generation and are not returned;
    ``stop_token_ids`` end it too.

    Penalties as in vLLM and OpenAI: ``repetition_penalty`` divides positive (multiplies
    negative) logits of tokens seen in the prompt or output; ``frequency_penalty`` subtracts
    ``count`` and ``presence_penalty`` subtracts 1 for each token in the output so far;
    ``logit_bias`` adds to token ids' logits; ``min_tokens`` forbids EOS and the stop token ids
    until that many tokens are out. ``logprobs``: the sampled token's log-probability and that
    many alternatives, computed from the raw logits (before temperature, penalties and
    filters, vLLM V1's default); ``prompt_logprobs`` the same for the prompt's tokens (such a
    request computes its whole prompt: no prefix-cache hit). ``n`` choices per request.
    ``continued_tokens``: set by ``continued`` only (a migrated stream).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    continued_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the logits before the pick (penalties, bias, min tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def continued(self, sent: int) -> SamplingParams:
        """These parameters for the rest of a migrated stream whose last ``sent`` prompt
        tokens are its own output: what is left of max_tokens and min_tokens, and the seed
        advanced (a sampled continuation does not draw the first attempt's numbers again).
        ``ValueError`` where there is nothing to continue or more than one choice."""
        if self.n != 1 or self.prompt_logprobs is not None:
            raise ValueError("continued_tokens: a continued stream is one choice without prompt_logprobs")
        if not 0 < sent < self.max_tokens:
            raise ValueError(f"continued_tokens must be in [1, max_tokens={self.max_tokens}), got {sent}")
        seed = None if self.seed is None else (self.seed + sent) % 2**64
        return dataclasses.replace(
            self,
            max_tokens=self.max_tokens - sent,
            min_tokens=max(0, self.min_tokens - sent),
            seed=seed,
            continued_tokens=sent,
        )

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for token, bias in self.logit_bias.items():
            if token < 0 or not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias: token ids >= 0 and biases in [-100, 100], got {token}: {bias}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")


def check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """``ValueError`` naming the field when a token id it names is outside the vocabulary
    (an index past the logits row fails the whole batch's step, and on CUDA the device)."""
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")


_OPTIONAL_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "n",
)


def sampling_from_proto(p) -> SamplingParams:
    """``kvmesh.v1.SamplingParams`` -> SamplingParams; unset optional fields keep the defaults.

    Raises ``ValueError`` (with the field named) for values the engine would reject.
    """
    kwargs: dict = {
        "ignore_eos": p.ignore_eos,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
        "logit_bias": dict(p.logit_bias),
    }
    for name in _OPTIONAL_FIELDS:
        if p.HasField(name):
            kwargs[name] = getattr(p, name)
    return SamplingParams(**kwargs)
