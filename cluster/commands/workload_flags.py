"""Flags that describe a workload, shared by ``kvmesh simulate`` and ``kvmesh bench serve``, and
the wrapper that turns their ValueErrors into one-line usage errors."""

from __future__ import annotations

import argparse

from kvmesh.cluster.errors import UsageError
from kvmesh.cluster.experiments import workloads as wl

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


def usage_errors(handler):
    """Bad flags and files surface as ValueError: report them as one line, exit 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    return run
