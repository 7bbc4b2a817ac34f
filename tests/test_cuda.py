"""The CUDA path against the CPU path. Runs only where CUDA is present (not in CPU CI)."""

import pytest
import torch
from reference import BATCH, GREEDY

from kvmesh.replica import LLMEngine
from kvmesh.replica.attention import flash_attn_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_torch_backend_matches_cpu(qwen3_dir):
    cpu = LLMEngine(qwen3_dir, num_kv_blocks=256, device="cpu").generate(BATCH, GREEDY)
    gpu = LLMEngine(qwen3_dir, num_kv_blocks=256, device="cuda", dtype="float32", attention_backend="torch")
    assert [o.token_ids for o in gpu.generate(BATCH, GREEDY)] == [o.token_ids for o in cpu]


@pytest.mark.skipif(not flash_attn_available(), reason="needs flash-attn")
def test_flash_attn_matches_torch_backend_in_bf16(qwen3_dir):
    options = dict(num_kv_blocks=64, block_size=256, device="cuda", dtype="bfloat16")
    flash = LLMEngine(qwen3_dir, attention_backend="flash_attn", **options)
    torch_path = LLMEngine(qwen3_dir, attention_backend="torch", **options)
    assert flash.runner.backend.name == "flash_attn"
    a = [o.token_ids[:4] for o in flash.generate(BATCH, GREEDY)]
    b = [o.token_ids[:4] for o in torch_path.generate(BATCH, GREEDY)]
    assert (
        sum(x == y for x, y in zip(a, b, strict=True)) >= len(BATCH) - 1
    )  # bf16 kernels may flip a near-tie
