"""The load shapes the peers sweep runs, shared with the simulator's fidelity check: guidellm's
synthetic shared-prefix load (and its command line), the sweep's default, and the Mooncake
trace's tail scaled to this machine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bench.measure.workloads import WorkloadRequest, iter_mooncake

MOONCAKE_BLOCK_TOKENS = 4  # the trace's 512-token blocks, shrunk to fit CPU replicas' KV pools


@dataclass(frozen=True)
class GuidellmLoad:
    """guidellm's synthetic shared-prefix data and a Poisson arrival rate, seeded."""

    prefix_tokens: int
    prefix_count: int
    prompt_tokens: int
    output_tokens: int
    rate: float
    requests: int
    max_seconds: float
    seed: int = 1234

    def command(self, venv: Path, target: str, model_id: str, model_dir: str, out: Path) -> list[str]:
        data = (
            f"kind=synthetic_text,prompt_tokens={self.prompt_tokens},output_tokens={self.output_tokens},"
            f"prefix_tokens={self.prefix_tokens},prefix_count={self.prefix_count}"
        )
        return [
            str(venv / "bin" / "guidellm"),
            "run",
            "--backend",
            f"kind=openai_http,target={target},model={model_id},request_format=/v1/completions,timeout=300",
            "--tokenizer",
            f"kind=huggingface_auto,model={model_dir}",
            "--data",
            data,
            "--profile",
            f"kind=poisson,rate={self.rate}",
            "--constraint",
            f"kind=max_requests,count={self.requests}",
            "--constraint",
            f"kind=max_duration,seconds={self.max_seconds}",
            "--seed",
            f"kind=static,value={self.seed}",
            "--output",
            f"kind=json,path={out}",
            "--disable-console",
        ]


DEFAULT_LOAD = GuidellmLoad(
    prefix_tokens=512,
    prefix_count=8,
    prompt_tokens=64,
    output_tokens=16,
    rate=6.0,
    requests=120,  # the default grid (4 routers x 3 workloads x 3 rates x 3 repeats): about 1.7 hours here
    max_seconds=120,
)


def mooncake_at(load: GuidellmLoad) -> list[WorkloadRequest]:
    """The Mooncake synthetic trace's last ``load.requests`` requests, scaled to this machine:
    blocks of 4 tokens (prompts share exactly what the trace's share), answers capped at the
    load's output, and its timestamps stretched or squeezed to ``load.rate`` on average
    (its bursts kept). The tail, because the trace's sharing builds up over time: its first
    120 requests could reuse 5% of their prompts with an infinite cache, its last 120 66%."""
    rows = list(iter_mooncake(block_tokens=MOONCAKE_BLOCK_TOKENS))[-load.requests :]
    start = rows[0].arrival_s
    scale = len(rows) / load.rate / ((rows[-1].arrival_s - start) or 1.0)
    return [
        dataclasses.replace(
            r, arrival_s=(r.arrival_s - start) * scale, max_tokens=min(r.max_tokens, load.output_tokens)
        )
        for r in rows
    ]
