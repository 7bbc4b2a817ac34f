"""``kvmesh bench gpu``: the one prepared device run (``make gpu-check``), one JSON.

Everything a short GPU lease should measure, in the order that keeps the most if time runs
out, each part written as it finishes:

1. ``limits``: the device's own ceilings, measured now: device-to-device copy bandwidth
   (bytes read and written) and a bf16 matrix product's rate.
2. ``tests``: the CUDA tests (the engine against the CPU path, the Triton kernels compiled,
   the decode graphs captured), by pytest in a subprocess.
3. ``decode``: a decode step at several batch sizes, with CUDA graphs and async scheduling,
   with graphs alone, and with neither: wall time,
   GPU busy time (the profiler's kernel time), the step's roofline (its bytes, weights and
   the KV it reads, over the copy bandwidth; its FLOPs over the matmul rate; whichever is
   longer; ``share_of_limit`` is that floor over the wall time), and its host time by stage.
4. ``ttft``: cold and with all but the last block cached, at 2k and 8k tokens (and 2k with
   1,792 cached, the engine bench's case, and the same prefix restored from the host tier,
   with the restores' bandwidth as a share of the measured host-to-device limit).
5. ``engine``: ``kvmesh bench engine --device cuda``'s throughput against transformers
   ``generate`` and greedy tokens against the CPU path.
6. ``serving``: the chain on the GPU (the embedded Valkey, a replica on the GPU, the router;
   in one process, without Ray, whose wheel is too large to carry to a machine with no
   network): a shared-prefix workload through the router's gRPC, its hit rate, TTFT and the
   router's decision time.

``--device cpu`` runs the same code on a tiny model here (no graphs, no profiler times): the
smoke test that keeps the script working between leases.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

from kvmesh.bench.measure.common import environment, progress, target, write_result
from kvmesh.bench.step_stages import decoding, step_stages
from kvmesh.engine import LLMEngine

# A random model with Qwen3-1.7B's shape and a 1k vocabulary: its weights are the real one's
# less the embedding (what a decode step reads of them is the same).
SHAPE_1_7B = dict(
    arch="qwen3",
    hidden=2048,
    layers=28,
    heads=16,
    kv_heads=8,
    intermediate=6144,
    vocab_size=1024,
    max_position_embeddings=16384,
)
SMOKE_SHAPE = dict(arch="qwen3", hidden=128, layers=2, heads=4, kv_heads=2, vocab_size=1024)
CUDA_TESTS = [
    "tests/engine/test_cuda.py",
    "tests/engine/test_triton_attention.py",
    "tests/engine/test_cuda_graphs.py",
    "tests/engine/test_async_scheduling.py",
]


class Timer:
    """Seconds of ``fn()``: CUDA events on a GPU (the device's own clock), else wall time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if not self.cuda:
            started = time.perf_counter()
            fn()
            return time.perf_counter() - started
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def median(self, fn, repeats: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median(self(fn) for _ in range(repeats))


def limits(device: torch.device, quick: bool) -> dict:
    """Copy bandwidth (bytes read + written a second), host-to-device bandwidth from pinned
    memory (bytes a second: the host tier's restores' ceiling) and matmul rate (FLOP/s), measured."""
    timer = Timer(device)
    elements = (1 << 29) if device.type == "cuda" else (1 << 23)  # 1 GiB of bf16 on a GPU
    src = torch.empty(elements, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = timer.median(lambda: dst.copy_(src), 5 if quick else 10)
    host = torch.empty(elements, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    upload_s = timer.median(lambda: dst.copy_(host, non_blocking=True), 5 if quick else 10)
    n = 8192 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    matmul_s = timer.median(lambda: a @ b, 5 if quick else 10)
    return {
        "copy_bytes_per_s": round(2 * elements * 2 / copy_s),
        "host_to_device_bytes_per_s": round(elements * 2 / upload_s),
        "matmul_flops_per_s": round(2 * n**3 / matmul_s),
        "matmul_dtype": str(dtype).removeprefix("torch."),
    }


def run_tests(out_dir: Path, files: list[str] = CUDA_TESTS, root: Path = Path()) -> dict:
    """The CUDA tests, by pytest in a subprocess (its counts from its JUnit XML). ``files``
    are named from ``root``, which is the inner pytest's working directory and rootdir: else
    pytest takes the common ancestor of its arguments and the test names change with where
    the project lies."""
    report = (out_dir / "gpu_check_tests.xml").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *(f"--rootdir={root.resolve()}", f"--junitxml={report}", *files),
        ],
        capture_output=True,
        text=True,
        cwd=root,
    )
    suite = ElementTree.parse(report).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        "files": files,
        "tests": int(suite.get("tests")),
        "failed": failed,
        "skipped": int(suite.get("skipped")),
        "seconds": round(time.monotonic() - started, 1),
        "exit_code": done.returncode,
        "tail": done.stdout[-3000:] if done.returncode else "",
    }


def step_roofline(engine: LLMEngine, batch: int, context: int, limits_: dict) -> dict:
    """What a decode step of ``batch`` rows at ``context`` tokens must read and compute, and
    the least time that takes on this device."""
    model, spec = engine.runner.model, engine.runner.model.spec
    size = engine.runner.kv_dtype_size
    weights = sum(p.numel() for p in model.parameters())
    if not spec.tie_word_embeddings:
        weights -= model.model.embed_tokens.weight.numel()  # a step reads only its rows
    kv_bytes = batch * context * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * size
    flops = 2 * weights * batch + 4 * batch * context * spec.num_heads * spec.head_dim * spec.num_layers
    bytes_s = (weights * size + kv_bytes) / limits_["copy_bytes_per_s"]
    flops_s = flops / limits_["matmul_flops_per_s"]
    return {
        "weight_bytes": weights * size,
        "kv_bytes": kv_bytes,
        "flops": flops,
        "floor_ms": round(max(bytes_s, flops_s) * 1e3, 3),
        "bound": "memory" if bytes_s >= flops_s else "compute",
    }


def _busy_seconds(profile) -> float:
    """Device time of the kernels a profile saw (the GPU busy, whatever launched them)."""
    total_us = 0.0
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total_us += event.self_device_time_total
    return total_us / 1e6


def decode(engine: LLMEngine, batch: int, context: int, steps: int, limits_: dict) -> dict:
    """A decode step of ``batch`` rows at about ``context`` tokens: median wall time, GPU busy
    time (profiled over separate steps), the roofline."""
    cuda = engine.runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    walls, busy = [], None
    with decoding(engine, batch, context, 2 * steps):  # timed steps, then profiled ones
        sync()
        for _ in range(steps):  # no sync between steps: async scheduling overlaps them
            started = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - started)
        if cuda:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                for _ in range(steps):
                    engine.step()
                sync()
            busy = _busy_seconds(profile) / steps
    wall = statistics.median(walls)
    roof = step_roofline(engine, batch, context + steps, limits_)
    return {
        "batch": batch,
        "context": context,
        "graphs": engine.runner.graphs is not None,
        "async_scheduling": engine.async_scheduling,
        "step_ms": round(wall * 1e3, 3),
        "gpu_busy_ms": None if busy is None else round(busy * 1e3, 3),
        "gpu_busy_share": None if busy is None else round(busy / wall, 3),
        "roofline": roof,
        "share_of_limit": round(roof["floor_ms"] / (wall * 1e3), 3),
        "tokens_per_s": round(batch / wall, 1),
    }


def ttft(engine: LLMEngine, lengths: list[int], repeats: int) -> list[dict]:
    """Time to first token of a prompt, cold and with all but its last block cached."""
    from kvmesh.bench.engine import ttft as first_token

    rng, rows = random.Random(5), []
    for length in lengths:
        cold, cached = [], []
        for _ in range(repeats):
            prompt = [rng.randrange(3, engine.vocab_size) for _ in range(length)]
            engine.reset_prefix_cache()
            cold.append(first_token(engine, prompt))
            tail = [rng.randrange(3, engine.vocab_size) for _ in range(engine.block_size)]
            cached.append(first_token(engine, prompt[: length - engine.block_size] + tail))
        rows.append(
            {
                "prompt_tokens": length,
                "cached_tokens": length - engine.block_size,
                "cold_ms": round(statistics.median(cold) * 1e3, 2),
                "cached_ms": round(statistics.median(cached) * 1e3, 2),
                "cached_over_cold": round(statistics.median(cached) / statistics.median(cold), 3),
            }
        )
    return rows


async def serving(model_dir: Path, device: str, dtype: str, quick: bool) -> dict:
    """The chain in one process: embedded Valkey, one replica on the device, the router; a
    shared-prefix workload through the router's gRPC: each prefix's first question, then the
    others 8 at a time."""
    import grpc

    from kvmesh.cluster.embedded_redis import EmbeddedRedis
    from kvmesh.engine.config import EngineConfig
    from kvmesh.protos import pb, pb_grpc
    from kvmesh.replica.config import ReplicaConfig
    from kvmesh.replica.process import ReplicaServer
    from kvmesh.router.config import RouterConfig
    from kvmesh.router.process import RouterServer

    block = 16
    redis = EmbeddedRedis().start()
    engine = EngineConfig(block_size=block, device=device, dtype=dtype, max_num_seqs=64)
    if device == "cpu":
        engine.num_kv_blocks = 512
    replica = ReplicaServer(ReplicaConfig(str(model_dir), "gpu-0", redis.url, engine=engine, http_port=-1))
    router = RouterServer([RouterConfig(str(model_dir), redis.url, port=0, http_port=-1, block_size=block)])
    prefixes, questions = (2, 4) if quick else (8, 8)
    prefix_len, tail_len = (64, 16) if quick else (1024, 64)
    rng = random.Random(9)
    shared = [[rng.randrange(3, 1000) for _ in range(prefix_len)] for _ in range(prefixes)]
    prompts = [
        p + [rng.randrange(3, 1000) for _ in range(tail_len)] for _ in range(questions) for p in shared
    ]
    try:
        await replica.start()
        await router.start()
        for _ in range(200):
            if router.registry.live():
                break
            await router.registry.refresh()
            await asyncio.sleep(0.05)
        channel = grpc.aio.insecure_channel(router.address)
        stub, gate, rows = pb_grpc.RouterStub(channel), asyncio.Semaphore(8), []

        async def send(prompt: list[int]) -> None:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
            )
            async with gate:
                started, first = time.perf_counter(), None
                async for response in stub.Generate(request, timeout=300):
                    if response.WhichOneof("kind") == "chunk" and first is None:
                        first = time.perf_counter() - started
                    elif response.WhichOneof("kind") == "complete":
                        done = response.complete
                rows.append(
                    (first, done.usage.prompt_tokens, done.usage.cached_tokens, done.router_decision_us)
                )

        started = time.perf_counter()
        await asyncio.gather(*(send(p) for p in prompts[:prefixes]))  # each prefix's first question
        await asyncio.gather(*(send(p) for p in prompts[prefixes:]))  # then the rest, 8 at a time
        elapsed = time.perf_counter() - started
        await channel.close()
    finally:
        await router.stop(grace=0.5)
        await replica.stop(grace=0.5)
        redis.close()
    ttfts = sorted(r[0] for r in rows)
    return {
        "requests": len(rows),
        "prefixes": prefixes,
        "prefix_tokens": prefix_len,
        "tail_tokens": tail_len,
        "hit_rate": round(sum(r[2] for r in rows) / sum(r[1] for r in rows), 3),
        # every prefix computed once, by its first question (to whole blocks), the rest cached
        "ideal_hit_rate": round(
            (questions - 1) * (prefix_len // block * block) / (questions * (prefix_len + tail_len)), 3
        ),
        "ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1e3, 2),
        "ttft_p90_ms": round(ttfts[int(len(ttfts) * 0.9)] * 1e3, 2),
        "router_decision_p50_us": statistics.median(r[3] for r in rows),
        "requests_per_s": round(len(rows) / elapsed, 2),
    }


class Report:
    """The run's JSON, written again as each part is added (a lease that ends early keeps
    what was measured)."""

    def __init__(self, out: str, result: dict):
        self.out, self.result = out, result

    def save(self, part: str, value) -> None:
        self.result[part] = value
        write_result(self.out, self.result)


def decode_and_ttft(model_dir: Path, device: str, dtype: str, quick: bool, report: Report) -> None:
    """Decode steps at each batch size, each with its host stages: on a GPU with graphs and
    async scheduling, with graphs alone, and with neither; TTFT on the last engine."""
    from kvmesh.bench.engine import bench_ttft, bench_ttft_from_host

    cuda = device == "cuda"
    batches, context, steps = ([1, 16, 64, 256], 512, 20) if cuda else ([1, 4], 64, 3)
    limits_, save = report.result["limits"], report.save
    rows = []
    passes = [(True, True), (True, False), (False, False)] if cuda else [(False, True), (False, False)]
    for graphs, overlap in passes:
        engine = LLMEngine(
            model_dir,
            device=device,
            dtype=dtype,
            max_num_seqs=max(batches),
            max_num_batched_tokens=8192,
            enforce_eager=not graphs,
            async_scheduling=overlap,
            **({"gpu_memory_utilization": 0.5} if cuda else {"num_kv_blocks": 256}),
        )
        for batch in batches:
            progress(f"decode steps: batch {batch}, graphs {graphs}, async scheduling {overlap}")
            stages = step_stages(engine, batch, context, steps)
            rows.append(
                {
                    "attention_backend": engine.runner.backend.name,
                    **decode(engine, batch, context, steps, limits_),
                    "host_stages_ms": {k: v for k, v in stages.items() if k.endswith("_ms")},
                }
            )
        if graphs and overlap:
            capture = engine.runner.graph_capture
            save(
                "graph_capture",
                {
                    "buckets": len(capture.buckets),
                    "seconds": round(capture.seconds, 2),
                    "bytes": capture.bytes,
                },
            )
        save("decode", rows)
        if not graphs and not overlap:
            progress("time to first token")
            lengths = [2048, 8192] if cuda else [128]
            cases = {
                "all_but_last_block": ttft(engine, lengths, 2 if quick else 3),
                "2k_1792_cached": bench_ttft(engine, random.Random(1), 3),
            }
            del engine
            host = bench_ttft_from_host(model_dir, random.Random(1), 3, device=device, dtype=dtype)
            bandwidth = limits_["host_to_device_bytes_per_s"]
            cases["2k_1792_from_host"] = {
                **host,
                "restore_share_of_limit": round(host["restore_gb_per_s"] * 1e9 / bandwidth, 3)
                if host["restore_gb_per_s"]
                else None,
            }
            save("ttft", cases)
        engine = None  # an engine in a reference cycle is collected when the next one starts
        if cuda:
            torch.cuda.empty_cache()


def main(
    out: str, device: str, quick: bool, model: str | None, cache_dir: str, tests: bool, serve: bool
) -> int:
    from kvmesh.bench.engine import bench_model_dir, model_label, run_cuda
    from kvmesh.engine.models.tiny_model import cached_tiny_model

    cuda = device == "cuda"
    shape = SHAPE_1_7B if cuda else SMOKE_SHAPE
    model_dir = Path(model) if model else cached_tiny_model(Path(cache_dir) / "gpu-check-model", **shape)
    dev = torch.device("cuda" if cuda else "cpu")
    result: dict = {
        "benchmark": "gpu",
        "statistic": "median",
        "quick": quick,
        "environment": environment(
            torch=torch.__version__, device=torch.cuda.get_device_name() if cuda else "cpu"
        ),
        "model": model_label(model_dir),
    }

    report = Report(out, result)
    save = report.save

    progress("measuring the device's limits")
    save("limits", limits(dev, quick))
    if tests:
        progress("running the CUDA tests")
        save("tests", run_tests(Path(out).parent))
    dtype = "bfloat16" if cuda else "float32"
    decode_and_ttft(model_dir, device, dtype, quick, report)
    if cuda:
        progress("engine vs transformers")
        save("engine", run_cuda(2 if quick else 3, True, bench_model_dir(Path(cache_dir)), model_dir))
    if serve:
        progress("the serving chain")
        save("serving", asyncio.run(serving(model_dir, device, dtype, quick)))
    save("targets", targets(result))
    return 0


def targets(result: dict) -> list[dict]:
    """Issue 51's targets, where this run measured them."""
    found = []
    at64 = [r for r in result.get("decode", []) if r["batch"] == 64 and r["graphs"] and r["async_scheduling"]]
    if at64:
        row = at64[0]
        found.append(
            target("decode step at batch 64 within 2x of its roofline", row["share_of_limit"], ">=", 0.5)
        )
        if row["gpu_busy_share"] is not None:
            found.append(target("GPU busy share of a decode step", row["gpu_busy_share"], ">=", 0.9))
    engine = result.get("engine", {}).get("throughput")
    if at64 and engine:  # 64 requests decoding: at best 64 tokens per floor of a 64-row step
        limit = 64 / (at64[0]["roofline"]["floor_ms"] / 1e3)
        found.append(
            target(
                "engine throughput share of its memory-bound limit",
                round(engine["kvmesh_tokens_per_s"] / limit, 3),
                ">=",
                0.4,
            )
        )
    ttft_ = result.get("ttft", {}).get("2k_1792_cached")
    if ttft_:
        found.append(target("2k TTFT cached over cold", round(1 / ttft_["speedup"], 3), "<=", 0.25))
    if serving_ := result.get("serving"):
        found.append(
            target(
                "serving hit rate of its ideal",
                round(serving_["hit_rate"] / serving_["ideal_hit_rate"], 3),
                ">=",
                0.9,
            )
        )
    return found
