"""``kvmesh simulate``: discrete-event simulation with the real ledger, scheduler and policies."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvmesh.cluster.commands.workload_flags import add_workload_flags, build_workload, usage_errors
from kvmesh.cluster.experiments import workloads as wl
from kvmesh.cluster.experiments.cost_model import PRESETS, load_cost_model


def register(commands) -> None:
    sim = commands.add_parser("simulate", help="discrete-event simulation with the real ledger and policies")
    add_workload_flags(sim)
    sim.add_argument("--replicas", type=int, default=8)
    sim.add_argument(
        "--policy", default="prefix", help="one policy or a comma-separated list, run side by side"
    )
    sim.add_argument(
        "--blocks-per-replica", type=int, help="KV blocks per replica (default: from the cost model)"
    )
    sim.add_argument("--block-size", type=int, default=256)
    sim.add_argument(
        "--cost-model", default="h100-llama3-8b", help=f"preset ({', '.join(PRESETS)}) or a JSON file"
    )
    sim.add_argument("--out", default="results/simulate.json")
    sim.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    sim.set_defaults(handler=usage_errors(simulate))


def simulate(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from kvmesh.cluster.experiments.simulator import Simulation
    from kvmesh.router.policies import POLICIES

    name, requests = build_workload(args)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(
            f"unknown policy {unknown[0] if unknown else ''!r}; known: {', '.join(sorted(POLICIES))}"
        )
    if (
        args.replicas <= 0
        or args.block_size <= 0
        or (args.blocks_per_replica is not None and args.blocks_per_replica <= 0)
    ):
        raise ValueError("--replicas, --block-size and --blocks-per-replica must be positive")
    cost = load_cost_model(args.cost_model)
    result = {
        "config": {
            "workload": name,
            "requests": len(requests),
            "replicas": args.replicas,
            "block_size": args.block_size,
            "blocks_per_replica": args.blocks_per_replica,
            "cost_model": cost.as_dict(),
            "rate": args.rate,
            "speedup": args.speedup,
        },
        "hit_rate_ceiling": round(wl.infinite_cache_hit_rate(requests, args.block_size), 4),
        "policies": {},
    }
    for policy in policies:
        with tqdm(total=len(requests), desc=f"simulate {policy}", unit="req", disable=args.quiet) as bar:
            sim = Simulation(
                requests, args.replicas, policy, cost, block_size=args.block_size,
                blocks_per_replica=args.blocks_per_replica, seed=args.seed, progress=bar.update,
            )  # fmt: skip
            result["policies"][policy] = sim.run()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(simulation_table(result))
    print(f"\nwrote {args.out}")
    return 0


def simulation_table(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"{cfg['workload']}: {cfg['requests']} requests, {cfg['replicas']} replicas, ceiling hit rate {result['hit_rate_ceiling']}",
        f"{'policy':<16}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p90':>10}{'TTFT p99':>10}{'tok/s':>11}{'max/mean':>9}",
    ]
    for policy, s in result["policies"].items():
        lines.append(
            f"{policy:<16}{s['hit_rate']:>9.3f}{s['ttft_p50']:>9.3f}s{s['ttft_p90']:>9.3f}s{s['ttft_p99']:>9.3f}s"
            f"{s['throughput_tok_s']:>11.0f}{s['load_imbalance_max_over_mean']:>9.2f}"
        )
    return "\n".join(lines)
