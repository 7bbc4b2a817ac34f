"""``kvmesh demo``: 4 CPU replicas, prefix vs round-robin routing on a shared-prefix workload."""

from __future__ import annotations

import argparse

from kvmesh.cli.commands.engine_flags import add_engine_flags, vllm_python
from kvmesh.cli.extras import require_extra


def register(commands) -> None:
    demo = commands.add_parser(
        "demo", help="4 CPU replicas, prefix vs round-robin on a shared-prefix workload"
    )
    demo.add_argument("--out-dir", default="results/demo")
    demo.add_argument("--replicas", type=int, default=4)
    demo.add_argument("--cache-dir", default=".cache/tiny-models", help="where the tiny model is built once")
    add_engine_flags(demo)
    demo.add_argument("-v", "--verbose", action="store_true")
    demo.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.cli.logs import setup_logging
    from kvmesh.cluster.errors import UsageError

    if args.replicas <= 0:
        raise UsageError("--replicas must be positive")
    require_extra("experiments", "matplotlib")
    from kvmesh.bench.demo import main as demo_main  # Ray and torch: only now

    setup_logging(args.verbose)
    return demo_main(args.out_dir, args.replicas, args.cache_dir, args.verbose, vllm_python(args))
