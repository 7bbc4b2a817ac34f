"""``kvmesh experiments``: the experiment suite W1-W5, regenerating docs/experiments.md."""

from __future__ import annotations

import argparse

from kvmesh.cli.commands.workload_flags import usage_errors
from kvmesh.cli.extras import require_extra


def register(commands) -> None:
    exp = commands.add_parser("experiments", help="the experiment suite W1-W5 -> docs/experiments.md")
    exp.add_argument(
        "--out-dir",
        default="results/experiments",
        help="where experiments.md/.json go (docs: update the docs)",
    )
    exp.add_argument("--quick", action="store_true", help="a smoke run of the same suite, smaller")
    exp.add_argument("--no-real", action="store_true", help="skip the scaled-down real-cluster run")
    exp.add_argument("--cache-dir", default=".cache/tiny-models")
    exp.add_argument(
        "--routers-grid",
        action="store_true",
        help="only the many-routers grid in the simulator (its section of experiments.md, sim_routers.json)",
    )
    exp.add_argument(
        "--fidelity",
        action="store_true",
        help="only the simulator against a real 4-replica cluster (its section of experiments.md, fidelity.json)",
    )
    exp.set_defaults(handler=usage_errors(experiments))


def experiments(args: argparse.Namespace) -> int:
    from kvmesh.bench.experiments.suite import main as suite_main

    require_extra("experiments", "matplotlib")
    if args.routers_grid:
        from kvmesh.bench.experiments.sim_many_routers import main as grid_main

        return grid_main(args.out_dir, args.quick)
    if args.fidelity:
        from kvmesh.bench.experiments.fidelity import main as fidelity_main

        return fidelity_main(args.out_dir, args.quick, args.cache_dir)
    return suite_main(args.out_dir, args.quick, not args.no_real, args.cache_dir)
