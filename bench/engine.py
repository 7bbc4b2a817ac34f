"""``kvmesh bench engine``: kvmesh's engine against transformers ``generate``, same run.

1. Throughput: the same 64 requests (mixed prompt and output lengths, greedy) through the
   engine's continuous batching and through transformers ``generate`` batched with left
   padding (``max_new_tokens`` = the batch's longest output; only requested tokens count).
2. Time to first token of a 2k-token prompt whose first 1.75k tokens are cached, against
   the same prompt on a cold cache; and with those tokens restored from the host tier (an
   engine whose device pool holds one such prompt, so one other prompt pushes the prefix out
   to host memory), with the measured restore bandwidth.
3. Where a decode step's host time goes, stage by stage (``step_stages.py``), at 1, 16 and 64
   rows greedy, and at 64 rows sampled.
With ``--device cuda`` (``make gpu-check`` runs it first on a GPU machine): the CUDA path's
greedy tokens against the CPU path's (on the small bench model, per attention backend and
dtype), the pool sized by profiling, and the same throughput comparison with transformers on
the same GPU in bfloat16 (flash-attn where it runs). ``--model DIR`` times a model folder of
your own (real weights, or a ``make-tiny-model`` of a real model's shape) instead of the bench
model; the CUDA correctness check stays on the small model, which the CPU can run.
``--vllm-python`` adds vLLM (that Python's) on the same CPU, requests and prompts
(``vllm_contender.py``).
"""

from __future__ import annotations

import gc
import json
import math
import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from kvmesh.bench.measure.common import environment, progress, target, write_result
from kvmesh.bench.step_stages import step_stages
from kvmesh.engine import LLMEngine, SamplingParams
from kvmesh.engine.step_costs import StepCostFit

MODEL = dict(
    arch="qwen3", hidden=512, layers=4, heads=8, kv_heads=4, vocab_size=1024, max_position_embeddings=4096
)


def bench_model_dir(cache: Path) -> Path:
    from kvmesh.engine.models.tiny_model import cached_tiny_model

    return cached_tiny_model(cache / "bench-qwen3-h512-l4", **MODEL)


def model_label(model_dir: Path) -> dict:
    """A model folder as the result names it: its path and shape (config.json)."""
    config = json.loads((model_dir / "config.json").read_text())
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    keys += ("intermediate_size", "vocab_size")
    return {"path": str(model_dir), **{k: config.get(k) for k in keys}}


def workload(n: int, rng: random.Random, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs: prompts 32-512 tokens, outputs 16-256 tokens."""
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


def engine_throughput(engine: LLMEngine, reqs: list[tuple[list[int], int]]) -> float:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    start = time.perf_counter()
    outs = engine.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outs) == sum(n for _, n in reqs)
    return sum(n for _, n in reqs) / elapsed


def hf_throughput(model, reqs: list[tuple[list[int], int]], batch_size: int, device: str) -> float:
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (p, _) in enumerate(batch):  # left padding, as generate expects
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        config = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in batch), pad_token_id=0)
        with torch.inference_mode():
            model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=config)
    elapsed = time.perf_counter() - start
    return sum(n for _, n in reqs) / elapsed


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished_requests():
                    engine.step()
                return elapsed


def ttft_prompts(rng: random.Random, vocab: int, repeats: int) -> list[tuple[list[int], list[int]]]:
    """(cold, warm) prompt pairs of 2048 tokens sharing their first 1792: each contender times
    the same ones."""
    shared = [rng.randrange(3, vocab) for _ in range(1792)]
    tail = lambda: [rng.randrange(3, vocab) for _ in range(256)]  # noqa: E731
    return [(shared + tail(), shared + tail()) for _ in range(repeats)]


def ttft_summary(cold: list[float], warm: list[float]) -> dict:
    return {
        "prompt_tokens": 2048,
        "cached_tokens": 1792,
        "cold_ttft_ms": round(statistics.median(cold) * 1e3, 1),
        "cached_ttft_ms": round(statistics.median(warm) * 1e3, 1),
        "speedup": round(statistics.median(cold) / statistics.median(warm), 2),
    }


def bench_ttft(engine: LLMEngine, rng: random.Random, repeats: int) -> dict:
    warm, cold = [], []
    for cold_prompt, warm_prompt in ttft_prompts(rng, engine.vocab_size, repeats):
        engine.reset_prefix_cache()
        cold.append(ttft(engine, cold_prompt))  # cold: nothing cached
        warm.append(ttft(engine, warm_prompt))  # the 1792 shared tokens are cached now
    return ttft_summary(cold, warm)


def bench_ttft_from_host(model_dir: Path, rng: random.Random, repeats: int, **options) -> dict:
    """Cold against restored from the host tier, the same prompts as ``bench_ttft``: after the
    cold prompt, one unrelated prompt of its length fills the device pool, so the shared
    prefix moves to host memory; the warm prompt then restores it."""
    probe = LLMEngine(model_dir, num_kv_blocks=1, block_size=16, **options)
    blocks = 2048 // 16 + 8  # one 2k-token prompt and a little room
    engine = LLMEngine(
        model_dir,
        num_kv_blocks=blocks,
        block_size=16,
        host_kv_gib=4 * blocks * probe.runner.block_bytes / 2**30,
        max_num_batched_tokens=2048,
        **options,
    )
    del probe
    cold, restored, from_host = [], [], []
    for cold_prompt, warm_prompt in ttft_prompts(rng, engine.vocab_size, repeats):
        engine.reset_prefix_cache()
        cold.append(ttft(engine, cold_prompt))
        ttft(engine, [rng.randrange(3, engine.vocab_size) for _ in range(2048)])  # the prefix leaves
        before = engine.stats().host.hit_tokens
        restored.append(ttft(engine, warm_prompt))
        from_host.append(engine.stats().host.hit_tokens - before)
    host = engine.stats().host
    block_bytes = engine.runner.block_bytes
    return {
        "prompt_tokens": 2048,
        "restored_tokens": statistics.median(from_host),
        "cold_ttft_ms": round(statistics.median(cold) * 1e3, 1),
        "restored_ttft_ms": round(statistics.median(restored) * 1e3, 1),
        "speedup": round(statistics.median(cold) / statistics.median(restored), 2),
        "restore_gb_per_s": round(host.restored_blocks * block_bytes / host.restore_seconds / 1e9, 2)
        if host.restore_seconds
        else None,
        "restore_s_per_block": host.restore_seconds / host.restored_blocks if host.restored_blocks else None,
    }


def _step_time(engine: LLMEngine, prompts: list[list[int]], decode_steps: int) -> tuple[float, float]:
    """(seconds of the prefill step, median seconds of a decode step) for one batch."""
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    start = time.perf_counter()
    while not any(r.num_completion_tokens for r in engine.requests.values()):
        engine.step()
    prefill = time.perf_counter() - start
    decode = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - start)
    return prefill, statistics.median(decode[:-1] or decode)


def calibrate(engine: LLMEngine, rng: random.Random, model: dict) -> dict:
    """The simulator's cost model for this engine: t = base + a*prefill_tokens +
    b*decode_seqs + c*context_tokens, from prefill and decode steps of known shapes, fitted by
    the engine's own online fit (``engine/step_costs.py``, what replicas send in their
    heartbeats), started fresh and without decay for the calibration."""
    engine.step_costs = StepCostFit(half_life_steps=math.inf)
    vocab = engine.vocab_size
    for n in (128, 512, 1024, 2000):
        engine.reset_prefix_cache()
        _step_time(engine, [[rng.randrange(3, vocab) for _ in range(n)]], 1)
    for batch in (1, 8, 32):
        for context in (64, 512):
            engine.reset_prefix_cache()
            _step_time(engine, [[rng.randrange(3, vocab) for _ in range(context)] for _ in range(batch)], 8)
    return {
        "name": "calibrated-cpu",
        **asdict(engine.step_costs.costs()),
        "kv_tokens_per_replica": engine.block_manager.num_blocks * engine.block_size,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "source": f"kvmesh bench engine calibration, {model}",
    }


def throughput_vs_transformers(
    engine: LLMEngine, model_dir: Path, reqs: list[tuple[list[int], int]], repeats: int, dtype: torch.dtype
) -> dict:
    """The same requests through the engine and through transformers ``generate`` on the
    engine's device and in ``dtype``; medians over ``repeats``, alternating."""
    from transformers import AutoModelForCausalLM

    device = engine.runner.device
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype).to(device).eval()
    ours, base = [], []
    for i in range(repeats):
        ours.append(engine_throughput(engine, reqs))
        engine.reset_prefix_cache()
        base.append(hf_throughput(hf, reqs, batch_size=64, device=str(device)))
        progress(
            f"throughput repeat {i + 1}/{repeats}: kvmesh {ours[-1]:.0f} tok/s, transformers {base[-1]:.0f} tok/s"
        )
    return {
        "requests": len(reqs),
        "output_tokens": sum(k for _, k in reqs),
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "kvmesh_tokens_per_s": round(statistics.median(ours), 1),
        "transformers_tokens_per_s": round(statistics.median(base), 1),
        "speedup": round(statistics.median(ours) / statistics.median(base), 2),
    }


def run_cpu(repeats: int, quick: bool, model_dir: Path, vllm_python: str | None = None) -> dict:
    torch.manual_seed(0)
    n = 16 if quick else 64
    rng = random.Random(0)
    engine = LLMEngine(
        model_dir, num_kv_blocks=4096, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048
    )
    reqs = workload(n, rng, engine.vocab_size)
    throughput = throughput_vs_transformers(engine, model_dir, reqs, repeats, torch.float32)
    ttft_result = bench_ttft(engine, random.Random(1), repeats)
    progress(f"ttft: cold {ttft_result['cold_ttft_ms']} ms, cached {ttft_result['cached_ttft_ms']} ms")
    host = bench_ttft_from_host(model_dir, random.Random(1), repeats)
    progress(f"ttft: cold {host['cold_ttft_ms']} ms, restored from host {host['restored_ttft_ms']} ms")
    stages = [step_stages(engine, batch, 512, 5 if quick else 20) for batch in (1, 16, 64)]
    stages.append(step_stages(engine, 64, 512, 5 if quick else 20, temperature=0.8))  # the sampler's share
    progress(f"host stages of a 64-row decode step: {stages[-1]}")
    cost_model = calibrate(engine, random.Random(2), model_label(model_dir))
    progress(
        f"cost model: {cost_model['prefill_token_s'] * 1e6:.1f} us per prefill token, base {cost_model['base_s'] * 1e3:.2f} ms"
    )
    contenders = {}
    if vllm_python:
        from kvmesh.bench.vllm_contender import vllm_contender

        prompts = ttft_prompts(random.Random(1), engine.vocab_size, repeats)  # bench_ttft's very prompts
        del engine  # its pool goes before vLLM takes its own
        gc.collect()
        contenders["vllm"] = vllm_contender(model_dir, vllm_python, reqs, prompts, repeats)
    return {
        **contenders,
        "cost_model": cost_model,
        "dtype": "float32",
        "device": "cpu",
        "throughput": throughput,
        "ttft": ttft_result,
        "ttft_from_host": host,
        "step_stages": stages,
        "targets": [
            target("throughput vs transformers generate", throughput["speedup"], ">=", 2.0),
            target("TTFT cold / cached (1.75k of 2k cached)", ttft_result["speedup"], ">=", 4.0),
            target("TTFT cold / restored from the host tier (1.75k of 2k)", host["speedup"], ">=", 3.0),
        ],
    }


def greedy_vs_cpu(model_dir: Path, quick: bool) -> dict:
    """Each CUDA variant's greedy tokens against the CPU path's in float32, same requests: fp32
    must agree token for token; bf16 rounds, so its first tokens are the comparable part."""
    from kvmesh.engine.models.attention import flash_attn_available

    cpu = LLMEngine(model_dir, num_kv_blocks=2048, block_size=256, device="cpu")
    reqs = workload(8 if quick else 32, random.Random(0), cpu.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True) for _ in reqs]
    reference = [o.token_ids for o in cpu.generate([p for p, _ in reqs], params)]
    checks: dict = {"model": model_label(model_dir)}
    variants = {
        "torch_fp32": dict(dtype="float32", attention_backend="torch"),
        "torch_bf16": dict(dtype="bfloat16", attention_backend="torch"),
    }
    if flash_attn_available():
        variants["flash_attn_bf16"] = dict(dtype="bfloat16", attention_backend="flash_attn")
    for name, options in variants.items():  # no num_kv_blocks: the pool is sized by profiling
        engine = LLMEngine(
            model_dir, block_size=256, device="cuda", max_num_seqs=64, gpu_memory_utilization=0.3, **options
        )
        got = [o.token_ids for o in engine.generate([p for p, _ in reqs], params)]
        same = sum(a == b for a, b in zip(got, reference, strict=True))
        checks[name] = {
            "identical_outputs": same,
            "first_token_equal": sum(a[0] == b[0] for a, b in zip(got, reference, strict=True)),
            "requests": len(reqs),
            "num_kv_blocks": engine.block_manager.num_blocks,
        }
        progress(f"{name}: {same}/{len(reqs)} outputs identical to CPU fp32")
        del engine
        gc.collect()  # the pool goes back before the next variant sizes its own
        torch.cuda.empty_cache()
    return checks


def run_cuda(repeats: int, quick: bool, bench_model: Path, model_dir: Path) -> dict:
    """CUDA path vs CPU path greedy tokens on the bench model, then ``model_dir``'s CUDA
    throughput in bfloat16 against transformers on the same GPU (needs a CUDA machine)."""
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda needs a CUDA machine")
    from kvmesh.engine.models.attention import flash_attn_available

    checks = greedy_vs_cpu(bench_model, quick)
    # half the GPU: transformers' model and its cache share the device with the engine's pool
    engine = LLMEngine(
        model_dir, device="cuda", dtype="bfloat16", max_num_seqs=64, gpu_memory_utilization=0.5
    )
    big = workload(64 if quick else 256, random.Random(2), engine.vocab_size)
    throughput = throughput_vs_transformers(engine, model_dir, big, repeats, engine.runner.dtype)
    return {
        "device": torch.cuda.get_device_name(),
        "flash_attn": flash_attn_available(),
        "greedy_vs_cpu": checks,
        "throughput": throughput,
        "attention_backend": engine.runner.backend.name,
        "block_size": engine.block_size,
        "num_kv_blocks": engine.block_manager.num_blocks,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "ttft": bench_ttft(engine, random.Random(1), repeats),
        "ttft_from_host": bench_ttft_from_host(
            model_dir, random.Random(1), repeats, device="cuda", dtype="bfloat16"
        ),
        "targets": [target("CUDA throughput vs transformers generate", throughput["speedup"], ">=", 2.0)],
    }


def main(
    out: str,
    repeats: int,
    quick: bool,
    device: str,
    cache_dir: str,
    model: str | None = None,
    vllm_python: str | None = None,
) -> int:
    model_dir = Path(model) if model else bench_model_dir(Path(cache_dir))
    result = {
        "benchmark": "engine",
        "statistic": "median",
        "repeats": repeats,
        "quick": quick,
        "environment": environment(torch=torch.__version__),
        "model": model_label(model_dir),
    }
    if device == "cuda":
        result["cuda"] = run_cuda(repeats, quick, bench_model_dir(Path(cache_dir)), model_dir)
        result["targets"] = result["cuda"].pop("targets")
    else:
        result.update(run_cpu(repeats, quick, model_dir, vllm_python))
    _print(result)
    write_result(out, result)
    return 0


def _print(result: dict) -> None:
    if "cuda" in result:
        print(json.dumps(result["cuda"], indent=2))
        return
    t, f = result["throughput"], result["ttft"]
    print(f"\nthroughput, {t['requests']} requests, {t['output_tokens']} output tokens (greedy, fp32, CPU)")
    print(f"  kvmesh        {t['kvmesh_tokens_per_s']:>9.1f} tok/s")
    print(f"  transformers  {t['transformers_tokens_per_s']:>9.1f} tok/s   ratio {t['speedup']}x")
    print(f"time to first token, {f['prompt_tokens']}-token prompt")
    print(f"  cold          {f['cold_ttft_ms']:>9.1f} ms")
    print(f"  1792 cached   {f['cached_ttft_ms']:>9.1f} ms   ratio {f['speedup']}x")
    h = result["ttft_from_host"]
    print(
        f"  {h['restored_tokens']:.0f} from host {h['restored_ttft_ms']:>7.1f} ms   ratio {h['speedup']}x"
        f"   (cold {h['cold_ttft_ms']} ms; restores at {h['restore_gb_per_s']} GB/s)"
    )
    if v := result.get("vllm"):
        print(f"vLLM {v['version']} (its OpenAI server on loopback, block size {v['block_size']})")
        print(
            f"  throughput    {v['tokens_per_s']:>9.1f} tok/s   kvmesh / vLLM {t['kvmesh_tokens_per_s'] / v['tokens_per_s']:.2f}x"
        )
        print(
            f"  TTFT cold     {v['ttft']['cold_ttft_ms']:>9.1f} ms   cached {v['ttft']['cached_ttft_ms']} ms"
        )
