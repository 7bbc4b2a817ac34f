"""What one engine step costs on this replica, measured online.

Every step is one sample of

    seconds = base + prefill_token * (prompt tokens computed) + decode_seq * (sequences decoding)
                   + context_token * (tokens of context the scheduled sequences attend to)

(``serving/step_costs.py``, the model every part prices work with). ``StepCostFit`` keeps a least-squares fit
of the four costs over exponentially decayed sums (a ``half_life`` of steps: a replica that
slows down reports it within a few hundred steps), pulled toward a prior where the samples
say nothing (an idle replica, or one that never decoded), robust to outliers (a sample far
from the prediction, a GC pause or a first compile, counts with a Huber weight), and never
negative. A replica on hardware twice as slow reports costs twice as high.
"""

from __future__ import annotations

import math

import numpy as np

from kvmesh.serving.step_costs import PRIOR, StepCosts

# Before any step the fit is the documented prior (an H100-class replica with an 8B model),
# with the weight of PRIOR_STEPS steps.
PRIOR_STEPS = 0.25
HUBER_K = 3.0  # a residual beyond 3 typical residuals weighs less, in proportion


class StepCostFit:
    def __init__(self, half_life_steps: float = 500.0, prior: StepCosts = PRIOR):
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.prior = np.asarray(prior.terms(), dtype=float)
        # Each term scaled to ~1 at typical sizes, so the ridge toward the prior treats them alike.
        self._scale = np.array([1.0, 1e3, 10.0, 1e4])
        self._xx = np.zeros((4, 4))
        self._xy = np.zeros(4)
        self._abs_residual = 0.0  # decayed mean |residual| (seconds): what "typical" is
        self._weight = 0.0
        self.steps = 0
        self._theta = self.prior.copy()

    def observe(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, seconds: float) -> None:
        """One step's sample (a step that computed nothing, or took no time, says nothing)."""
        if not (seconds > 0 and math.isfinite(seconds)) or prefill_tokens + decode_seqs == 0:
            return
        x = np.array([1.0, prefill_tokens, decode_seqs, context_tokens]) / self._scale
        residual = seconds - float(x @ (self._theta * self._scale))
        typical = self._abs_residual / self._weight if self._weight else abs(residual)
        w = 1.0 if abs(residual) <= HUBER_K * typical or typical == 0 else HUBER_K * typical / abs(residual)
        self._xx = self.decay * self._xx + w * np.outer(x, x)
        self._xy = self.decay * self._xy + w * x * seconds
        self._abs_residual = self.decay * self._abs_residual + abs(residual)
        self._weight = self.decay * self._weight + 1.0
        self.steps += 1
        self._theta = self._solve()

    def _solve(self) -> np.ndarray:
        """The least-squares costs with every term >= 0: a term the data would make negative
        is held at 0 and the others are refitted without it (clipping it after the fact
        would leave the others fitted to a negative term, a steeper slope for a negative
        base, say)."""
        a = self._xx + PRIOR_STEPS * np.eye(4)
        b = self._xy + PRIOR_STEPS * self.prior * self._scale
        scaled = np.linalg.solve(a, b)  # every step: the common case, all terms >= 0, is one solve
        free = np.ones(4, dtype=bool)
        while (scaled < 0).any():
            free[np.argmin(scaled)] = False
            scaled = np.zeros(4)
            if free.any():
                scaled[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        return scaled / self._scale

    def costs(self) -> StepCosts:
        """The four costs in seconds (the prior's before the first step)."""
        return StepCosts(*(float(value) for value in self._theta))

    def typical_step_s(self) -> float:
        """The fit at the average step it has seen (recent steps weigh more): well determined
        even where single terms are not (few prefills, say). 0 before the first step."""
        if not self._xx[0, 0]:
            return 0.0
        mean = self._xx[0] / self._xx[0, 0] * self._scale
        return float(mean @ self._theta)

    def predict(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        x = np.array([1.0, prefill_tokens, decode_seqs, context_tokens])
        return float(x @ self._theta)


class RestoreCostFit:
    """Seconds to restore one block from the host tier, measured online: copy time over blocks
    copied, both decayed by ``half_life`` restores (a link that slows down shows within a few
    dozen), so the router prices a host hit by what it costs now."""

    def __init__(self, half_life: float = 64.0):
        self.decay = 0.5 ** (1.0 / half_life)
        self._seconds = self._blocks = 0.0
        self.blocks = 0  # blocks measured, all time

    def observe(self, blocks: int, seconds: float) -> None:
        if blocks <= 0 or not (seconds >= 0 and math.isfinite(seconds)):
            return
        self._seconds = self.decay * self._seconds + seconds
        self._blocks = self.decay * self._blocks + blocks
        self.blocks += blocks

    def block_seconds(self) -> float | None:
        """The measured seconds per block (None before the first restore)."""
        return self._seconds / self._blocks if self._blocks else None


def step_features(scheduled) -> tuple[int, int, int]:
    """(prompt tokens computed, sequences decoding, context tokens attended) of one scheduled
    batch (sequences with their ``num_scheduled_tokens`` set for this step)."""
    prefill = decode = context = 0
    for seq in scheduled:
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            prefill += seq.num_scheduled_tokens
        else:
            decode += 1
        context += seq.num_computed_tokens + seq.num_scheduled_tokens
    return prefill, decode, context
