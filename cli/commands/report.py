"""``kvmesh report``: tables and plots from ``bench serve`` runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmesh.cli.commands.workload_flags import usage_errors
from kvmesh.cli.extras import require_extra


def register(commands) -> None:
    rep = commands.add_parser("report", help="tables and plots from bench serve runs")
    rep.add_argument("runs", nargs="+", help="JSONL files written by kvmesh bench serve")
    rep.add_argument("--out-dir", default="results/report")
    rep.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT SLO for goodput")
    rep.set_defaults(handler=usage_errors(report))


def report(args: argparse.Namespace) -> int:
    from kvmesh.bench.measure.report import report as make_report

    require_extra("experiments", "matplotlib")

    paths = [Path(p) for p in args.runs]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"no such run file: {missing[0]}")
    print(make_report(paths, Path(args.out_dir), args.slo_ttft_ms))
    print(f"\nwrote {Path(args.out_dir) / 'report.md'} and plots")
    return 0
