"""Flags that describe a workload, shared by ``kvmesh simulate`` and ``kvmesh bench serve``, and
the wrapper that turns their ValueErrors into one-line usage errors."""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable, Iterator

from kvmesh.bench.measure import workloads as wl
from kvmesh.bench.measure.model_mix import ModelLoad
from kvmesh.cluster.errors import UsageError

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
    p.add_argument(
        "--copies", type=int, default=1, help="trace: play it this many times in a row, each with new content"
    )
    p.add_argument("--rate", type=float, help="arrivals per second (generated workloads; --arrivals: how)")
    p.add_argument(
        "--arrivals",
        choices=sorted(wl.ARRIVALS),
        default="poisson",
        help="how --rate's requests arrive: one at a time (poisson) or in bursts of 4 on average, "
        "as a load generator's workers send them (bursty)",
    )
    p.add_argument("--requests", type=int, help="use only the first N requests")
    p.add_argument("--seed", type=int, default=0)
    for name, (kind, text) in WORKLOAD_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, help=text)


def stream_workload(args: argparse.Namespace) -> tuple[str, Callable[[], Iterator[wl.WorkloadRequest]], int]:
    """(name, a maker of the request stream the flags describe, in arrival order: a fresh
    stream per call, its length). ValueError (a usage error) when the flags do not fit."""
    if args.requests is not None and args.requests <= 0:
        raise ValueError("--requests must be positive")
    if args.arrivals != "poisson" and (args.trace or args.workload == "mooncake"):
        raise ValueError(
            f"--arrivals {args.arrivals} times a generated workload; a trace keeps its own times"
        )
    if args.arrivals != "poisson" and args.rate is None and getattr(args, "load", None) is None:
        raise ValueError(f"--arrivals {args.arrivals} needs --rate")
    if args.trace or args.workload == "mooncake":
        path = args.trace or wl.MOONCAKE_TRACE
        name = "mooncake"
        base = lambda: wl.iter_mooncake(path, speedup=args.speedup, copies=args.copies)  # noqa: E731
    elif args.workload:
        name = args.workload
        knobs = {k: getattr(args, k) for k in WORKLOAD_FLAGS if getattr(args, k, None) is not None}
        if args.rate is not None and args.rate <= 0:
            raise ValueError("--rate must be positive")

        def base() -> Iterator[wl.WorkloadRequest]:
            stream = wl.make_stream(name, seed=args.seed, **knobs)
            return wl.ARRIVALS[args.arrivals](stream, args.rate, seed=args.seed) if args.rate else stream
    else:
        raise ValueError("give --workload NAME or --trace FILE")

    def make() -> Iterator[wl.WorkloadRequest]:
        return itertools.islice(base(), args.requests)

    try:
        first = make()  # a generated workload's knobs are checked here (its maker is called)
    except TypeError as exc:
        raise ValueError(f"workload {name}: {exc}") from None
    total, last = 0, -math.inf  # one pass now: its length, and any error before a long run starts
    for request in first:
        if request.arrival_s < last:
            raise ValueError(
                f"the {name} workload is not in arrival order (request {total}): sort it by time"
            )
        total, last = total + 1, request.arrival_s
    if not total:
        raise ValueError("the workload has no requests")
    return name, make, total


def model_stream(
    args: argparse.Namespace, model: ModelLoad, k: int
) -> tuple[str, Callable[[], Iterator[wl.WorkloadRequest]], int]:
    """``stream_workload`` for the ``k``-th model of a mix: its workload at its share of
    ``--rate``, with a seed of its own (its own prompts). The workload knobs (``--num-groups``,
    ...) are ``--workload``'s: a model with a workload of its own takes that one's defaults."""
    if args.rate is None or args.trace:
        raise ValueError("a mix of --model needs --rate (shared out by the models' shares), no --trace")
    own = {
        "workload": model.workload or args.workload,
        "rate": args.rate * model.share,
        "seed": args.seed + k,
    }
    if model.workload not in (None, args.workload):
        own |= dict.fromkeys(WORKLOAD_FLAGS)
    return stream_workload(argparse.Namespace(**{**vars(args), **own}))


def build_workload(args: argparse.Namespace) -> tuple[str, list[wl.WorkloadRequest]]:
    """The workload the flags describe, as a list; ValueError (a usage error) when they do not fit."""
    name, make, _ = stream_workload(args)
    return name, list(make())


def usage_errors(handler):
    """Bad flags and files surface as ValueError: report them as one line, exit 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    return run
