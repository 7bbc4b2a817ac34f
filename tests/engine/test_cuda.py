"""The CUDA path against the CPU path. Runs only where CUDA is present (not in CPU CI);
``make gpu-check`` runs it first on a GPU machine. The comparison itself also runs on the CPU
(two block sizes), so CI keeps the harness working: its first run on a GPU found it broken.

Every case has a shared prefix longer than a 256-token block (so later prompts hit the prefix
cache through the block table) and a small token budget (so prefill runs in chunks). The
engines are compared by their logits, step by step while their tokens agree, with a
tolerance per dtype: greedy tokens of a random model in bf16 flip on rounding.
"""

import pytest
import torch

from kvmesh.engine import LLMEngine, SamplingParams
from kvmesh.engine.models.attention import flash_attn_available

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHARED = [(17 * j) % 900 + 3 for j in range(300)]
PROMPTS = [SHARED + [5, 6, 7], SHARED + [8, 9, 10, 11], SHARED[:200] + [12] * 40]
STEPS = 6
OPTIONS = dict(block_size=256, max_num_batched_tokens=128, max_num_seqs=4)


def logits_per_step(engine: LLMEngine) -> list[list[torch.Tensor]]:
    """Each prompt alone, in order (later ones hit the first one's blocks): its logits at
    every step, as float32 on the CPU."""
    seen: list[torch.Tensor] = []
    compute = engine.runner.model.compute_logits

    def recording(hidden):
        out = compute(hidden)
        if len(out):  # a prefill chunk that samples nothing asks for no rows
            seen.append(out.float().cpu())
        return out

    engine.runner.model.compute_logits = recording
    per_prompt = []
    for prompt in PROMPTS:
        seen.clear()
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
        per_prompt.append([row[0] for row in seen])
    return per_prompt


def assert_logits_close(got, expected, rel: float) -> None:
    """Logits equal within ``rel`` of their scale, at each step until the tokens part ways."""
    for prompt_got, prompt_expected in zip(got, expected, strict=True):
        assert len(prompt_got) == len(prompt_expected) == STEPS
        for a, b in zip(prompt_got, prompt_expected, strict=True):
            scale = b.abs().max().item()
            assert (a - b).abs().max().item() <= rel * scale, "logits differ beyond the dtype's rounding"
            if a.argmax() != b.argmax():
                break  # a near-tie flipped: what follows is another continuation


@pytest.fixture(scope="module")
def cpu_reference(qwen3_dir):
    return logits_per_step(LLMEngine(qwen3_dir, num_kv_blocks=32, device="cpu", **OPTIONS))


def test_block_size_does_not_change_the_logits(qwen3_dir, cpu_reference):
    """The harness on the CPU: 16-token blocks against the reference's 256."""
    options = {**OPTIONS, "block_size": 16}
    engine = LLMEngine(qwen3_dir, num_kv_blocks=512, device="cpu", **options)
    assert_logits_close(logits_per_step(engine), cpu_reference, rel=1e-4)


@needs_cuda
def test_cuda_torch_backend_matches_cpu(qwen3_dir, cpu_reference):
    engine = LLMEngine(
        qwen3_dir, num_kv_blocks=32, device="cuda", dtype="float32", attention_backend="torch", **OPTIONS
    )
    assert engine.runner.device.index is not None
    assert_logits_close(logits_per_step(engine), cpu_reference, rel=1e-3)


@needs_cuda
@pytest.mark.skipif(not flash_attn_available(), reason="needs flash-attn")
def test_flash_attn_matches_cpu_in_bf16(qwen3_dir, cpu_reference):
    engine = LLMEngine(
        qwen3_dir,
        num_kv_blocks=32,
        device="cuda",
        dtype="bfloat16",
        attention_backend="flash_attn",
        **OPTIONS,
    )
    assert engine.runner.backend.name == "flash_attn"
    assert_logits_close(logits_per_step(engine), cpu_reference, rel=5e-2)


@needs_cuda
def test_pool_sized_by_profiling_serves(qwen3_dir):
    """No num_kv_blocks: the warm-up forward measures the activations and the pool takes a
    share of what is left (and of what is free)."""
    engine = LLMEngine(qwen3_dir, device="cuda", gpu_memory_utilization=0.3, **OPTIONS)
    free, total = torch.cuda.mem_get_info(engine.runner.device)
    assert engine.block_manager.num_blocks > len(PROMPTS) * 2
    assert engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size() <= 0.3 * total
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    assert all(len(o.token_ids) == STEPS for o in outs) and free > 0


@needs_cuda
@pytest.mark.parametrize("dtype, rel", [("float32", 1e-3), ("bfloat16", 5e-2)])
def test_triton_kernels_and_decode_graphs_match_cpu(qwen3_dir, cpu_reference, dtype, rel):
    """kvmesh's Triton kernels compiled, decode replayed from the graphs captured at start."""
    engine = LLMEngine(
        qwen3_dir, num_kv_blocks=32, device="cuda", dtype=dtype, attention_backend="triton", **OPTIONS
    )
    assert engine.runner.backend.name == "triton" and engine.runner.graph_capture is not None
    assert_logits_close(logits_per_step(engine), cpu_reference, rel=rel)
    assert engine.runner.graphs.replays >= len(PROMPTS) * (STEPS - 1)


@needs_cuda
def test_enforce_eager_captures_nothing(qwen3_dir):
    engine = LLMEngine(
        qwen3_dir, num_kv_blocks=32, device="cuda", attention_backend="triton", enforce_eager=True, **OPTIONS
    )
    assert engine.runner.graphs is None and engine.stats().graph_capture_seconds == 0


@needs_cuda
def test_a_launched_step_never_waits_for_the_device(qwen3_dir):
    """Async scheduling's premise: launching a step (its plan, forward, penalties,
    log-probabilities and draws) only queues work; the step's one wait is its landing.
    torch's sync debug mode turns a hidden wait inside a launch into an error."""
    engine = LLMEngine(
        qwen3_dir,
        num_kv_blocks=64,
        device="cuda",
        dtype="bfloat16",
        attention_backend="triton",
        async_scheduling=True,
        **OPTIONS,
    )
    launch, launched = engine.runner.launch, []

    def strict(requests, previous):
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = launch(requests, previous)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        launched.append(len(requests))
        return step

    engine.runner.launch = strict
    base = dict(max_tokens=STEPS, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, **base),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, seed=3, **base),
        SamplingParams(
            temperature=0.7,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.2,
            logprobs=3,
            **base,
        ),
        SamplingParams(temperature=0, min_tokens=3, logit_bias={7: 2.0}, **base),
    ]
    outs = engine.generate([*PROMPTS, PROMPTS[0][:50]], params)
    assert [len(o.token_ids) for o in outs] == [STEPS] * 4 and len(outs[2].logprobs) == STEPS
    assert sum(launched) >= 4 * STEPS
