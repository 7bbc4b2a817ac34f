"""``kvmesh simulate``: discrete-event simulation with the real ledger, scheduler and policies."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import time
from pathlib import Path

from kvmesh.bench.experiments.capacity import measure_capacity
from kvmesh.bench.experiments.cost_model import PRESETS, load_cost_model
from kvmesh.bench.measure import workloads as wl
from kvmesh.bench.measure.model_mix import parse_models
from kvmesh.cli.commands.workload_flags import (
    add_workload_flags,
    model_stream,
    stream_workload,
    usage_errors,
)


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
    sim.add_argument(
        "--host-blocks-per-replica",
        type=int,
        default=0,
        help="blocks of a host KV tier in every replica: blocks leaving the pool move there and come back (0: none)",
    )
    sim.add_argument(
        "--restore-token-s",
        type=float,
        help="seconds to copy one token's KV between the host tier and the device (default: the cost model's)",
    )
    sim.add_argument("--block-size", type=int, default=256)
    sim.add_argument(
        "--cost-model", default="h100-llama3-8b", help=f"preset ({', '.join(PRESETS)}) or a JSON file"
    )
    sim.add_argument(
        "--routers", type=int, default=1, help="routers taking requests in turn (request i: router i mod N)"
    )
    sim.add_argument(
        "--shared-load",
        choices=("on", "off"),
        default="on",
        help="on: every router sees the fleet's in-flight work and speculative entries; off: its own",
    )
    sim.add_argument(
        "--event-lag-ms",
        type=float,
        default=0.0,
        help="how long a replica's KV events take to reach the index",
    )
    sim.add_argument(
        "--heartbeat-ms", type=float, default=0.0, help="how often routers learn replicas' queues (0: live)"
    )
    sim.add_argument(
        "--speeds",
        help="replicas of several speeds: replica i's steps take the i-th (cyclically) of these times "
        "the cost model's, e.g. 1,1.3,2 (the router prices them as it prices real fits)",
    )
    sim.add_argument(
        "--fit-noise",
        type=float,
        default=0.0,
        help="the step-cost fits the router sees are off by up to this fraction either way, drawn "
        "anew every second, e.g. 0.3",
    )
    sim.add_argument(
        "--drift",
        type=float,
        default=0.0,
        help="replicas' speeds wander: a random walk of log speed, this standard deviation per "
        "square root of a minute (within 2x of their own)",
    )
    sim.add_argument(
        "--load",
        type=float,
        help="arrive at this fraction of the fleet's capacity (as --arrivals says; measured first by a probe: "
        "a few replicas saturated with a sample of the workload's groups)",
    )
    sim.add_argument(
        "--model",
        action="append",
        metavar="NAME[,share=S][,workload=W][,replicas=N]",
        help="a mix of models behind one router (repeat it): each its own replicas, workload and "
        "share of --rate; per-model and overall results",
    )
    sim.add_argument("--out", default="results/simulate.json")
    sim.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    sim.set_defaults(handler=usage_errors(simulate))


def _speeds(text: str | None) -> list[float] | None:
    """``--speeds``: positive numbers separated by commas (None: not given)."""
    if text is None:
        return None
    try:
        speeds = [float(part) for part in text.split(",")]
    except ValueError:
        speeds = []
    if not speeds or not all(0 < s < math.inf for s in speeds):
        raise ValueError(
            f"--speeds must be positive numbers separated by commas (e.g. 1,1.3,2), got {text!r}"
        )
    return speeds


CEILING_MAX_REQUESTS = 200_000  # the infinite-cache ceiling keeps every hash: skipped past this


def _check_fleet(args: argparse.Namespace) -> None:
    """ValueError (a usage error) naming the first fleet flag out of its range."""
    if (
        args.replicas <= 0
        or args.block_size <= 0
        or args.routers <= 0
        or (args.blocks_per_replica is not None and args.blocks_per_replica <= 0)
    ):
        raise ValueError("--replicas, --routers, --block-size and --blocks-per-replica must be positive")
    if args.event_lag_ms < 0 or args.heartbeat_ms < 0:
        raise ValueError("--event-lag-ms and --heartbeat-ms must not be negative")
    if args.host_blocks_per_replica < 0:
        raise ValueError("--host-blocks-per-replica must not be negative")
    if args.restore_token_s is not None and not 0 <= args.restore_token_s < math.inf:
        raise ValueError("--restore-token-s must be a number >= 0")
    if not 0 <= args.fit_noise < 1 or not 0 <= args.drift < math.inf:
        raise ValueError("--fit-noise must be in [0, 1) and --drift must not be negative")


def simulate(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from kvmesh.router.policies import POLICIES

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(
            f"unknown policy {unknown[0] if unknown else ''!r}; known: {', '.join(sorted(POLICIES))}"
        )
    _check_fleet(args)
    args.speeds = _speeds(args.speeds)
    if args.load is not None and (args.load <= 0 or args.rate is not None or not args.workload or args.trace):
        raise ValueError("--load needs a generated --workload, no --rate or --trace, and a positive fraction")
    if args.model:
        return simulate_mix(args, policies)
    name, stream, total = stream_workload(args)
    cost = load_cost_model(args.cost_model)
    if args.restore_token_s is not None:
        cost = dataclasses.replace(cost, restore_token_s=args.restore_token_s)
    capacity = None
    if args.load is not None:  # the stream has no arrival times yet: the probe plays it at once
        capacity = measure_capacity(
            stream(), total, args.replicas, policies[0], cost, args.block_size, args.blocks_per_replica
        )
        args.rate = args.load * capacity.per_replica_rps * args.replicas
        print(
            f"capacity {capacity.per_replica_rps:.2f} requests/s a replica ({policies[0]}, "
            f"{capacity.probe_requests} requests saturating {capacity.probe_replicas} replicas): "
            f"rate {args.rate:.1f}/s = {args.load} x capacity x {args.replicas} replicas"
        )
    result = {
        "config": {
            "workload": name,
            "requests": total,
            "replicas": args.replicas,
            "routers": args.routers,
            "shared_load": args.shared_load == "on",
            "event_lag_ms": args.event_lag_ms,
            "heartbeat_ms": args.heartbeat_ms,
            "block_size": args.block_size,
            "blocks_per_replica": args.blocks_per_replica,
            "host_blocks_per_replica": args.host_blocks_per_replica,
            "cost_model": cost.as_dict(),
            "rate": args.rate,
            "load": args.load,
            "capacity": dataclasses.asdict(capacity) if capacity else None,
            "speedup": args.speedup,
            "copies": args.copies,
            "arrivals": args.arrivals,
            "speeds": args.speeds,
            "fit_noise": args.fit_noise,
            "drift": args.drift,
        },
        "hit_rate_ceiling": round(wl.infinite_cache_hit_rate(stream(), args.block_size), 4)
        if total <= CEILING_MAX_REQUESTS
        else None,
        "policies": {},
    }
    for policy in policies:
        start = time.monotonic()
        with tqdm(total=total, desc=f"simulate {policy}", unit="req", disable=args.quiet) as bar:
            sim = _simulation(args, stream(), args.replicas, policy, cost, bar.update)
            result["policies"][policy] = sim.run()
        result["policies"][policy]["wall_s"] = round(time.monotonic() - start, 1)
        del sim  # its replicas' ledgers before the next policy's
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return _written(args.out, result, simulation_table(result))


def _simulation(args: argparse.Namespace, workload, replicas: int, policy: str, cost, progress=None):
    """A Simulation with the command line's fleet settings."""
    from kvmesh.bench.experiments.simulator import Simulation

    return Simulation(
        workload,
        replicas,
        policy,
        cost,
        block_size=args.block_size,
        blocks_per_replica=args.blocks_per_replica,
        host_blocks_per_replica=args.host_blocks_per_replica,
        seed=args.seed,
        progress=progress,
        routers=args.routers,
        shared_load=args.shared_load == "on",
        event_lag_s=args.event_lag_ms / 1000,
        heartbeat_s=args.heartbeat_ms / 1000,
        speeds=args.speeds,
        fit_noise=args.fit_noise,
        drift=args.drift,
    )


def _written(out: str, result: dict, table: str) -> int:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(table)
    print(f"\nwrote {out}")
    return 0


def simulate_mix(args: argparse.Namespace, policies: list[str]) -> int:
    """Several models behind one router: each an independent fleet (its own replicas, index
    namespace, counts and speculative entries, as a router's per-model routes keep them),
    fed its share of the arrivals; per-model results, and all requests together."""
    from kvmesh.bench.experiments.simulator import request_stats

    if args.load is not None:
        raise ValueError("a mix of --model takes --rate, not --load")
    models = parse_models(args.model)
    cost = load_cost_model(args.cost_model)
    streams = {m.name: model_stream(args, m, k) for k, m in enumerate(models)}
    result = {
        "config": {
            "requests": sum(total for _, _, total in streams.values()),
            "rate": args.rate,
            "block_size": args.block_size,
            "cost_model": cost.as_dict(),
            "routers": args.routers,
            "models": [
                {
                    **dataclasses.asdict(m),
                    "workload": streams[m.name][0],
                    "replicas": m.replicas or args.replicas,
                }
                for m in models
            ],
        },
        "models": {m.name: {"policies": {}} for m in models},
        "policies": {},
    }
    for policy in policies:
        runs = []
        for m in models:
            _, stream, _ = streams[m.name]
            sim = _simulation(args, stream(), m.replicas or args.replicas, policy, cost)
            result["models"][m.name]["policies"][policy] = sim.run()
            runs.append(sim.results)
        result["policies"][policy] = request_stats(runs)
    return _written(args.out, result, mix_table(result))


def mix_table(result: dict) -> str:
    lines = [f"{'model':<16}{'policy':<16}{'requests':>9}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p90':>10}"]
    rows = [(name, m["policies"]) for name, m in result["models"].items()] + [("all", result["policies"])]
    for name, by_policy in rows:
        for policy, s in by_policy.items():
            lines.append(
                f"{name:<16}{policy:<16}{s['num_requests']:>9}{s['hit_rate']:>9.3f}"
                f"{s['ttft_p50']:>9.3f}s{s['ttft_p90']:>9.3f}s"
            )
    return "\n".join(lines)


def simulation_table(result: dict) -> str:
    cfg = result["config"]
    routers = (
        f", {cfg['routers']} routers ({'shared' if cfg['shared_load'] else 'own'} load)"
        if cfg["routers"] > 1
        else ""
    )
    lines = [
        f"{cfg['workload']}: {cfg['requests']} requests, {cfg['replicas']} replicas{routers}, "
        f"ceiling hit rate {result['hit_rate_ceiling']}, peak RSS {result['peak_rss_mb']} MB",
        f"{'policy':<16}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p90':>10}{'TTFT p99':>10}{'tok/s':>11}{'max/mean':>9}"
        f"{'cold/fair':>10}{'alarms':>7}{'wall':>8}",
    ]
    for policy, s in result["policies"].items():
        lines.append(
            f"{policy:<16}{s['hit_rate']:>9.3f}{s['ttft_p50']:>9.3f}s{s['ttft_p90']:>9.3f}s{s['ttft_p99']:>9.3f}s"
            f"{s['throughput_tok_s']:>11.0f}{s['load_imbalance_max_over_mean']:>9.2f}"
            f"{s['cold_share_max_over_fair']:>10.2f}{s['share_alarms']:>7}{s['wall_s']:>7.0f}s"
        )
    return "\n".join(lines)
