"""The ``kvmesh`` command line. Sub-commands register themselves in ``build_parser``.

Errors a user can fix (bad flags, missing files) print one line and exit 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EXIT_USAGE = 2


class UsageError(Exception):
    """A problem with what the user asked for; printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (``kvmesh: error: ...``) instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvmesh", description="Distributed LLM serving with a shared prefix index.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    bench = commands.add_parser("bench", help="run a benchmark (JSON results, ratios vs a same-run baseline)")
    benches = bench.add_subparsers(dest="bench", metavar="BENCH", parser_class=_Parser)
    benches.required = True
    kv = benches.add_parser(
        "kvcache", help="block ledger ops/s and prefix hashing vs the nano-vllm algorithm"
    )
    kv.add_argument("--out", default="results/bench_kvcache.json", help="JSON result file")
    kv.add_argument("--repeats", type=int, default=5, help="timed repeats per case (median reported)")
    kv.add_argument("--quick", action="store_true", help="smaller traces, for a smoke run")
    kv.set_defaults(handler=_run_bench_kvcache)
    return parser


def _run_bench_kvcache(args: argparse.Namespace) -> int:
    from kvmesh.cluster.benchmarks.kvcache_bench import main as bench_main

    if args.repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
    return bench_main(out=args.out, repeats=args.repeats, quick=args.quick)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as exc:
        print(f"kvmesh: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvmesh: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
