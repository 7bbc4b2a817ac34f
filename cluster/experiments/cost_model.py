"""How long one engine iteration takes, for the simulator.

    t = base + prefill_token * (tokens computed for prompts this step)
             + decode_seq * (sequences decoding this step)
             + context_token * (tokens of context all scheduled sequences attend to)

The first two terms are compute, the last is KV reads (memory-bound attention). A model
comes from a preset or from ``kvmesh bench engine``'s calibration section (measured on the
machine that ran it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


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

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return (
            self.base_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.context_token_s * context_tokens
        )

    def as_dict(self) -> dict:
        return asdict(self)


# An H100-SXM-class replica serving an 8B Llama-3 in bf16. From public numbers, not measured
# here: ~30k prompt tokens/s prefill (about 45% MFU of ~990 dense TFLOP/s at 16 GFLOP per
# token); a decode step reads the 16 GB of weights at ~3 TB/s (~6 ms) plus 128 KiB of KV per
# context token; ~55 GB left for KV after weights and activations = ~420k tokens.
H100_LLAMA3_8B = CostModel(
    name="h100-llama3-8b",
    base_s=0.006,
    prefill_token_s=1 / 30_000,
    decode_seq_s=0.00005,
    context_token_s=128 * 1024 / 3.0e12,
    kv_tokens_per_replica=420_000,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    source="public H100 / Llama-3-8B figures, see cost_model.py",
)

PRESETS = {H100_LLAMA3_8B.name: H100_LLAMA3_8B}


def load_cost_model(spec: str) -> CostModel:
    """A preset name, or a JSON file: a CostModel dict or a ``kvmesh bench engine`` result."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"cost model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    data = json.loads(path.read_text())
    data = data.get("cost_model", data)
    try:
        return CostModel(**data)
    except TypeError as exc:
        raise ValueError(f"{spec}: not a cost model ({exc})") from None
