"""``kvmesh demo``: the whole system on this machine, prefix-aware vs round-robin.

Builds the tiny model if missing, starts 4 CPU replicas + the router (Ray, embedded
Valkey), warms every replica up (first forwards and allocations are slow, and were the
slowest requests of whichever policy ran first), sends the same shared-prefix workload
twice over gRPC (caches reset in between), and prints/writes what changed: hit rate, TTFT
p50 and p90 (64 requests support a p90; their p99 is the slowest one), throughput, requests
per replica.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from kvmesh.bench.measure.demo_model import demo_model
from kvmesh.bench.measure.loadgen import run_load
from kvmesh.bench.measure.report import summarize
from kvmesh.bench.measure.workloads import shared_prefix
from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.launcher import LocalCluster

POLICIES = ("round_robin", "prefix")


async def run(
    out_dir: Path, replicas: int, cache_dir: Path, verbose: bool, vllm_python: str | None = None
) -> dict:
    """``vllm_python``: the replicas run vLLM from that Python (engine=vllm), else kvmesh's engine."""
    started = time.monotonic()
    model = demo_model(cache_dir)
    workload = shared_prefix(
        num_groups=8, prompts_per_group=8, system_prompt_len=512, question_len=32, output_len=16, seed=0
    )
    config = ClusterConfig.for_model(
        str(model),
        replicas,
        engine={
            "num_kv_blocks": 1024 if vllm_python is None else 512
        },  # the same tokens: vLLM's blocks are 32
        router={"port": 0, "http_port": -1},
        replica={"engine_kind": "vllm", "vllm_python": vllm_python} if vllm_python else {},
        verbose=verbose,
    )
    print(f"starting {replicas} {'vLLM' if vllm_python else 'kvmesh'} replicas + router ...", flush=True)
    results = {}
    async with LocalCluster(config) as cluster:
        print(f"router on {cluster.router_address}; {len(workload)} requests per policy", flush=True)
        warmup = shared_prefix(
            num_groups=replicas,
            prompts_per_group=2,
            system_prompt_len=64,
            question_len=16,
            output_len=4,
            seed=1,
        )
        await run_load(cluster.router_address, warmup, policy="round_robin", concurrency=replicas)
        for policy in POLICIES:
            await cluster.reset_prefix_caches()
            records = await run_load(
                cluster.router_address, workload, policy=policy, concurrency=8, progress=True
            )
            results[policy] = {"summary": summarize(records), "records": [r.as_dict() for r in records]}
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    write(out_dir, results, replicas)
    return results


def write(out_dir: Path, results: dict, replicas: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "demo.json").write_text(json.dumps(results, indent=2) + "\n")
    rows = [(p, results[p]["summary"]) for p in POLICIES]
    print(
        f"\n{'policy':<13}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p90':>10}{'tok/s':>8}  requests per replica"
    )
    for policy, s in rows:
        spread = " ".join(str(n) for n in s["requests_per_replica"].values())
        print(
            f"{policy:<13}{s['hit_rate']:>9.3f}{s['ttft_p50_ms']:>8.1f}ms{s['ttft_p90_ms']:>8.1f}ms{s['output_tokens_per_s']:>8.1f}  {spread}"
        )
    plot(out_dir / "demo.png", rows, replicas)
    print(f"\nwrote {out_dir / 'demo.json'} and {out_dir / 'demo.png'} ({results['elapsed_s']} s)")


def plot(path: Path, rows: list[tuple[str, dict]], replicas: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p for p, _ in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(names, [s["hit_rate"] for _, s in rows], color=["#999", "#2a7"])
    axes[0].set_title("prefix cache hit rate")
    axes[1].bar([f"{n}\np50" for n in names], [s["ttft_p50_ms"] for _, s in rows], color=["#999", "#2a7"])
    axes[1].bar([f"{n}\np90" for n in names], [s["ttft_p90_ms"] for _, s in rows], color=["#ccc", "#7c9"])
    axes[1].set_title("time to first token (ms)")
    width = 0.8 / len(rows)
    for k, (name, s) in enumerate(rows):
        ids = sorted(s["requests_per_replica"])
        axes[2].bar(
            [i + k * width for i in range(len(ids))],
            [s["requests_per_replica"][r] for r in ids],
            width,
            label=name,
        )
    axes[2].set_title(f"requests per replica ({replicas})")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out_dir: str, replicas: int, cache_dir: str, verbose: bool, vllm_python: str | None = None) -> int:
    asyncio.run(run(Path(out_dir), replicas, Path(cache_dir), verbose, vllm_python))
    return 0
