"""What one engine step costs, in seconds: the one model every kvmesh part prices work with.

    step = base + prefill_token * (prompt tokens computed) + decode_seq * (sequences decoding)
                + context_token * (tokens of context the scheduled sequences attend to)

The first two terms are compute, the last is KV reads (memory-bound attention). Each replica
fits the four costs online from its own steps (``engine/step_costs.py``) and sends them with
its heartbeat as ``cost_<term>`` fields (with ``cost_steps``, how many steps it has fitted);
the router prices a request's time to first token
with them (``router/pricing.py`` bounds and smooths them, ``router/policies.py`` uses them); the simulator runs time by them
(``bench/experiments/cost_model.py``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class StepCosts:
    base_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_token_s: float

    def step_seconds(self, prefill_tokens: float, decode_seqs: float, context_tokens: float) -> float:
        return (
            self.base_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.context_token_s * context_tokens
        )

    def terms(self) -> tuple[float, float, float, float]:
        """The four costs in ``TERMS`` order (``dataclasses.astuple`` deep-copies: ~30x slower,
        and the router reads them on every refresh of its replicas)."""
        return (self.base_s, self.prefill_token_s, self.decode_seq_s, self.context_token_s)

    def as_fields(self) -> dict[str, str]:
        """The heartbeat's ``cost_<term>`` fields (4 significant digits: a fit is no finer)."""
        return {f"cost_{term}": f"{value:.4g}" for term, value in zip(TERMS, self.terms(), strict=True)}

    @classmethod
    def from_fields(cls, load: Callable[[str, float], float]) -> StepCosts:
        """From a record's ``cost_<term>`` fields (``load(name, default)`` parses one); a
        missing or negative term is the prior's (a replica that sends none yet)."""
        values = (load(f"cost_{term}", -1.0) for term in TERMS)
        return cls(*(v if v >= 0 else p for v, p in zip(values, PRIOR.terms(), strict=True)))


TERMS = tuple(f.name for f in fields(StepCosts))
# A replica's fit is its own after this many steps. Before, it is mostly its first steps
# (warm-up, first compiles) pulled toward the prior, and is priced like its measured peers.
MEASURED_AFTER_STEPS = 32


def measured_restore(load: Callable[[str, float], float]) -> float | None:
    """A record's measured seconds per restored block once it has restored
    ``MEASURED_AFTER_STEPS`` blocks, bounded to ``MAX_RESTORE_BLOCK_S``; None before."""
    if load("cost_restore_blocks", 0.0) < MEASURED_AFTER_STEPS:
        return None
    value = load("cost_restore_block_s", -1.0)
    return min(value, MAX_RESTORE_BLOCK_S) if value >= 0 else None


def measured_costs(load: Callable[[str, float], float]) -> StepCosts | None:
    """A record's step costs once its replica has measured them (``cost_steps`` >=
    ``MEASURED_AFTER_STEPS``), else None."""
    return StepCosts.from_fields(load) if load("cost_steps", 0.0) >= MEASURED_AFTER_STEPS else None


def median_costs(measured: Sequence[StepCosts]) -> StepCosts:
    """Each term's median over replicas (what a replica that has not measured yet is priced
    at: like its peers); the prior when none has measured."""
    if not measured:
        return PRIOR
    return StepCosts(
        *(statistics.median(values) for values in zip(*(c.terms() for c in measured), strict=True))
    )


# A host hit before its replica has measured a restore: a block of that same 8B Llama at block
# size 16 (2 MiB of KV) over a pinned PCIe Gen5 link at ~50 GB/s. No record prices one slower
# than a second a block.
PRIOR_RESTORE_BLOCK_S = 2 * 1024 * 1024 / 50e9
MAX_RESTORE_BLOCK_S = 1.0

# Before a replica has measured anything: an H100-SXM-class replica serving an 8B Llama-3 in
# bf16, from public numbers (not measured here): ~30k prompt tokens/s of prefill (about 45% MFU
# of ~990 dense TFLOP/s at 16 GFLOP per token); a step reads the 16 GB of weights at ~3 TB/s
# (~6 ms), plus 128 KiB of KV per context token.
PRIOR = StepCosts(
    base_s=0.006,
    prefill_token_s=1 / 30_000,
    decode_seq_s=0.00005,
    context_token_s=128 * 1024 / 3.0e12,
)
