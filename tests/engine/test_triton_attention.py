"""kvmesh's Triton paged-attention kernels, run by Triton's interpreter on the CPU, against
the torch backend and plain causal attention: every step shape the engine makes (decode,
prefill on a cached prefix ending mid-block, chunked prefill, mixed batches), block sizes
16 to 256, grouped-query ratios 1 to 8, head sizes 64 and 128, fp32 and fp16 (the
interpreter's bf16 matmuls are wrong, a known Triton issue), contexts split across programs;
the KV write, whose padding rows touch no slot; and the engine on the Triton backend.
A missing Triton fails these tests: it is a test dependency."""

import os
import subprocess
import sys

import pytest
import torch
from paged_attention_cases import paged_case

from kvmesh.engine import LLMEngine, SamplingParams
from kvmesh.engine.kernels import paged_attention as kernels
from kvmesh.engine.models.attention import TorchPagedAttention, TritonPagedAttention

CPU = torch.device("cpu")
# Compiled on a GPU (`make gpu-check` runs this file there, bf16 too), interpreted elsewhere.
DEVICE = torch.device("cuda") if torch.cuda.is_available() else CPU
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# fp16 and bf16 cases are the `slow` tier's (make test runs them; make test-fast the fp32 ones)
DTYPES = [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow)]
DTYPES += [pytest.param(torch.bfloat16, marks=pytest.mark.slow)] if DEVICE.type == "cuda" else []

# (query_lens, cached tokens before them, block size, heads, kv heads, head dim, segments)
CASES = {
    "decode": ([1, 1, 1], [6, 0, 13], 16, 8, 8, 64, 1),
    "decode-gqa8-split": ([1, 1], [300, 70], 16, 8, 1, 64, 4),
    "decode-long-split": ([1], [4095], 32, 4, 2, 128, 16),
    "prefill-empty-prefix": ([37], [0], 32, 4, 1, 128, 1),
    "prefill-mid-block-prefix": ([20, 9], [21, 45], 16, 8, 2, 64, 1),
    "chunked-prefill": ([64, 64], [128, 300], 32, 8, 4, 64, 1),
    "mixed": ([3, 12, 1, 1], [40, 0, 17, 2], 16, 8, 2, 128, 1),
    "block-256": ([33, 1, 1], [100, 5, 700], 256, 16, 2, 64, 1),
    "block-256-split": ([1, 1], [600, 255], 256, 4, 4, 64, 8),
    "one-token-prompt": ([1], [0], 16, 2, 1, 64, 1),
}


def run(case, segments: int) -> torch.Tensor:
    """The kernels on DEVICE over the case's cache (written back to it); the output on the CPU."""
    block = case.k_cache.shape[1]
    plan = TritonPagedAttention(block, DEVICE).plan(case.layout)
    k_cache, v_cache = case.k_cache.to(DEVICE), case.v_cache.to(DEVICE)
    kernels.store_kv(case.new_k.to(DEVICE), case.new_v.to(DEVICE), k_cache, v_cache, plan.slots)
    out = kernels.paged_attention(
        case.q.to(DEVICE),
        k_cache,
        v_cache,
        plan.block_tables,
        plan.query_start,
        plan.context_lens,
        case.q.shape[2] ** -0.5,
        decode_only=plan.decode_only,
        segments=segments,
    )
    case.k_cache.copy_(k_cache.cpu())
    case.v_cache.copy_(v_cache.cpu())
    return out.cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_the_torch_backend_and_plain_attention(name, dtype):
    query_lens, cached, block, heads, kv_heads, dim, segments = CASES[name]
    case = paged_case(query_lens, cached, block, heads, kv_heads, dim, dtype=dtype, num_blocks=160, seed=3)
    reference = paged_case(
        query_lens, cached, block, heads, kv_heads, dim, dtype=dtype, num_blocks=160, seed=3
    )
    torch_backend = TorchPagedAttention(block, CPU)
    expected = torch_backend.forward(
        reference.q,
        reference.new_k,
        reference.new_v,
        reference.k_cache,
        reference.v_cache,
        torch_backend.plan(reference.layout),
        dim**-0.5,
    )
    out = run(case, segments)
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    case.check(out, dim**-0.5, tol=TOLERANCE[dtype])
    torch.testing.assert_close(case.k_cache, reference.k_cache)  # the same slots written, and only them


@pytest.mark.slow
def test_a_split_context_equals_the_unsplit_one():
    case = paged_case([1, 1, 1], [1000, 31, 64], 16, 8, 2, 64, num_blocks=80)
    whole = run(case, 1)
    for segments in (2, 4, 16):  # more slices than a short context has tiles: empty ones weigh 0
        torch.testing.assert_close(run(case, segments), whole, rtol=1e-5, atol=1e-5)


def test_padding_rows_write_no_slot():
    k_cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(3, 2, 64, device=DEVICE), torch.randn(3, 2, 64, device=DEVICE)
    kernels.store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 40], device=DEVICE))
    flat_k, flat_v = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_v[40], v[2])
    written = torch.zeros(64, dtype=torch.bool, device=DEVICE)
    written[[5, 40]] = True
    assert not flat_k[~written].any() and not flat_v[~written].any()  # the padding row wrote nowhere


def test_a_fused_projections_strided_views_are_read_as_they_are():
    """The engine passes q and k as views of one projection (rows strided past their heads)."""
    qk = torch.randn(5, 8 + 2, 64)
    q, k = qk.split([8, 2], dim=1)
    v = torch.randn(5, 2, 64)
    case = paged_case([5], [11], 16, 8, 2, 64)
    case.q, case.new_k, case.new_v = q, k, v
    case.full_k[0][11:], case.full_v[0][11:] = k, v
    out = run(case, 1)
    case.check(out, 64**-0.5, tol=1e-4)


def test_decode_splits_only_where_programs_would_be_too_few():
    assert kernels.decode_segments(256, 8, 4096, programs_wanted=264) == 1  # the batch fills the GPU
    assert kernels.decode_segments(1, 8, 8192, programs_wanted=264) == 16  # one long row: split wide
    assert kernels.decode_segments(4, 8, 200, programs_wanted=264) == 2  # short contexts: few slices
    assert kernels.decode_segments(4, 8, 40, programs_wanted=264) == 1  # under two tiles: no split


@pytest.mark.slow
def test_the_engine_on_the_triton_backend_generates_the_torch_backends_tokens(qwen3_dir):
    """A shared prefix (hits mid-block), a small token budget (chunked prefill) and decode: the
    real engine on Triton's kernels gives the torch backend's greedy tokens."""
    options = dict(
        num_kv_blocks=40, block_size=16, max_num_batched_tokens=32, max_num_seqs=4, dtype="float32"
    )
    shared = [(13 * j) % 900 + 3 for j in range(40)]
    prompts = [shared + [5, 6, 7], shared + [8, 9], shared[:21] + [11] * 5]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = [
        o.token_ids
        for o in LLMEngine(qwen3_dir, attention_backend="torch", **options).generate(prompts, params)
    ]
    engine = LLMEngine(qwen3_dir, attention_backend="triton", **options)
    assert engine.runner.backend.name == "triton"
    first = engine.generate(prompts[:1], params)  # warms the prefix cache
    rest = engine.generate(prompts[1:], params)
    assert [o.token_ids for o in first + rest] == expected
    assert rest[0].num_cached_tokens == 32  # a prefix hit, read through the block table


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on CUDA the kernels compile: no interpreter to turn on"
)
def test_triton_imported_before_the_interpreter_was_on_is_one_clear_error():
    code = "import triton.language, kvmesh.engine.kernels"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "start the process with TRITON_INTERPRET=1" in done.stderr
