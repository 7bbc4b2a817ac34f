"""``kvmesh bench serve``, ``kvmesh simulate`` and ``kvmesh report``: flags to experiments."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from kvmesh.cluster.errors import UsageError
from kvmesh.cluster.experiments import workloads as wl
from kvmesh.cluster.experiments.cost_model import PRESETS, load_cost_model

WORKLOAD_FLAGS = {
    # flag: (type, help)
    "num_groups": (int, "shared prefix: groups"),
    "prompts_per_group": (int, "shared prefix: prompts per group"),
    "system_prompt_len": (int, "shared prefix / multi-turn: system prompt tokens"),
    "question_len": (int, "shared prefix: question tokens"),
    "output_len": (int, "tokens to generate"),
    "num_requests": (int, "no sharing: requests"),
    "num_sessions": (int, "multi-turn: conversations"),
    "turns": (int, "multi-turn: turns per conversation"),
    "zipf": (float, "zipf: popularity exponent"),
}


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=sorted(wl.WORKLOADS), help="a generated workload or mooncake")
    p.add_argument("--trace", help="a Mooncake-format JSONL trace (implies --workload mooncake)")
    p.add_argument("--speedup", type=float, default=1.0, help="trace replay speed-up factor")
    p.add_argument("--rate", type=float, help="Poisson arrivals per second (generated workloads)")
    p.add_argument("--requests", type=int, help="use only the first N requests")
    p.add_argument("--seed", type=int, default=0)
    for name, (kind, text) in WORKLOAD_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, help=text)


def build_workload(args: argparse.Namespace) -> tuple[str, list[wl.WorkloadRequest]]:
    """The workload the flags describe; ValueError (a usage error) when they do not fit."""
    if args.trace:
        name, requests = "mooncake", wl.mooncake(args.trace, speedup=args.speedup)
    elif args.workload == "mooncake":
        name, requests = "mooncake", wl.mooncake(speedup=args.speedup)
    elif args.workload:
        name = args.workload
        knobs = {k: getattr(args, k) for k in WORKLOAD_FLAGS if getattr(args, k, None) is not None}
        try:
            requests = wl.make_workload(name, seed=args.seed, **knobs)
        except TypeError as exc:
            raise ValueError(f"workload {name}: {exc}") from None
        if args.rate:
            if args.rate <= 0:
                raise ValueError("--rate must be positive")
            requests = wl.poisson_arrivals(requests, args.rate, seed=args.seed)
    else:
        raise ValueError("give --workload NAME or --trace FILE")
    if args.requests:
        requests = requests[: args.requests]
    if not requests:
        raise ValueError("the workload has no requests")
    return name, requests


# ---------------------------------------------------------------------- simulate


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


# ---------------------------------------------------------------------- bench serve


def bench_serve(args: argparse.Namespace) -> int:
    name, requests = build_workload(args)
    if args.duration:
        requests = (
            [r for r in requests if r.arrival_s <= args.duration]
            if (args.rate or args.trace_time)
            else requests
        )
    if not args.address and not args.model:
        raise ValueError("give --address of a running router, or --model DIR to start a local cluster")
    return asyncio.run(_bench_serve(args, name, requests))


async def _bench_serve(args: argparse.Namespace, name: str, requests: list) -> int:
    from kvmesh.cluster.experiments.loadgen import run_load
    from kvmesh.cluster.experiments.report import summarize, write_run
    from kvmesh.cluster.launcher import ClusterConfig, LocalCluster

    cluster = None
    address = args.address
    if not address:
        config = ClusterConfig(args.model, replicas=args.replicas, http_port=None, block_size=args.block_size)
        cluster = await LocalCluster(config).start()
        address = cluster.router_address
    try:
        block_size = await _router_block_size(address)
        ceiling = wl.infinite_cache_hit_rate(requests, block_size)
        records = await run_load(
            address, requests, policy=args.policy or "", concurrency=args.concurrency,
            use_arrival_times=bool(args.rate or args.trace_time), progress=not args.quiet,
        )  # fmt: skip
    finally:
        if cluster:
            await cluster.stop()
    meta = {
        "workload": name, "policy": args.policy, "rate": args.rate, "trace_time": args.trace_time,
        "speedup": args.speedup, "requests": len(requests), "hit_rate_ceiling": ceiling, "address": address,
    }  # fmt: skip
    write_run(Path(args.out), meta, records)
    print(json.dumps(summarize(records, ceiling=ceiling), indent=2))
    print(f"\nwrote {args.out}")
    return 0


async def _router_block_size(address: str) -> int:
    import grpc

    from kvmesh.protos import pb, pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        info = await pb_grpc.RouterStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    return info.block_size


# ---------------------------------------------------------------------- report


def report(args: argparse.Namespace) -> int:
    from kvmesh.cluster.experiments.report import report as make_report

    paths = [Path(p) for p in args.runs]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"no such run file: {missing[0]}")
    print(make_report(paths, Path(args.out_dir), args.slo_ttft_ms))
    print(f"\nwrote {Path(args.out_dir) / 'report.md'} and plots")
    return 0


def experiments(args: argparse.Namespace) -> int:
    from kvmesh.cluster.experiments.suite import main as suite_main

    return suite_main(args.out_dir, args.quick, not args.no_real, args.cache_dir)


def _usage(handler):
    """Bad flags and files surface as ValueError: report them as one line, exit 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    return run


def add_parsers(commands, benches) -> None:
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
    sim.set_defaults(handler=_usage(simulate))

    serve = benches.add_parser("serve", help="load a router over gRPC with a workload; per-request JSONL")
    add_workload_flags(serve)
    serve.add_argument("--trace-time", action="store_true", help="send at the trace's timestamps")
    serve.add_argument("--duration", type=float, help="only requests arriving in the first S seconds")
    serve.add_argument("--policy", help="routing policy for every request (default: the router's)")
    serve.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    serve.add_argument("--address", help="router gRPC address (default: start a local cluster)")
    serve.add_argument("--model", help="model folder for the local cluster")
    serve.add_argument("--replicas", type=int, default=4)
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--out", default="results/serve.jsonl")
    serve.add_argument("-q", "--quiet", action="store_true")
    serve.set_defaults(handler=_usage(bench_serve))

    rep = commands.add_parser("report", help="tables and plots from bench serve runs")
    rep.add_argument("runs", nargs="+", help="JSONL files written by kvmesh bench serve")
    rep.add_argument("--out-dir", default="results/report")
    rep.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT SLO for goodput")
    rep.set_defaults(handler=_usage(report))

    exp = commands.add_parser("experiments", help="the experiment suite W1-W5 -> docs/experiments.md")
    exp.add_argument("--out-dir", default="docs")
    exp.add_argument("--quick", action="store_true", help="a smoke run of the same suite, smaller")
    exp.add_argument("--no-real", action="store_true", help="skip the scaled-down real-cluster run")
    exp.add_argument("--cache-dir", default=".cache/tiny-models")
    exp.set_defaults(handler=_usage(experiments))
