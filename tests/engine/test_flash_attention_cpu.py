"""The flash-attn path on a machine without CUDA: kvmesh's real ``FlashPagedAttention`` and
engine against the plain-torch reference of the two flash-attn functions they call
(``flash_attn_reference.py``, installed as ``flash_attn`` for this module only), plus the
backend choice, device resolution and KV-pool profiling that would decide a first GPU run."""

import sys

import flash_attn_reference
import pytest
import torch
from paged_attention_cases import paged_case

from kvmesh.engine import LLMEngine, SamplingParams
from kvmesh.engine.model_runner import kv_pool_bytes, resolve_device
from kvmesh.engine.models import attention
from kvmesh.engine.models.attention import FlashPagedAttention, choose_backend

CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def reference_flash_attn():
    """``import flash_attn`` finds the reference while a test of this module runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "flash_attn", flash_attn_reference)
        attention.flash_attn_available.cache_clear()
        yield
    attention.flash_attn_available.cache_clear()


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch believes a CUDA device of the given compute capability is present."""

    def install(capability=(8, 0)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        attention.flash_attn_available.cache_clear()

    return install


# ---------------------------------------------------------------------- FlashPagedAttention


CASES = {
    "decode": ([1, 1, 1], [300, 5, 511]),
    "mixed": ([17, 1, 300], [0, 257, 100]),
    "long-prefill": ([700], [0]),
    "prefix-cached-prefill": ([40, 3], [512, 256]),  # fewer queries than keys, page edges
    "page-edges": ([2, 1], [255, 511]),  # the new tokens cross into the next page
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", list(CASES))
def test_flash_paged_attention_matches_naive(name, heads, kv_heads, dtype):
    query_lens, cached = CASES[name]
    case = paged_case(query_lens, cached, 256, heads, kv_heads, 32, dtype=dtype, num_blocks=16)
    backend = FlashPagedAttention(256, CPU)
    plan = backend.plan(case.layout)
    assert plan.decode_only == (name == "decode")  # both flash-attn entry points are exercised
    out = backend.forward(case.q, case.new_k, case.new_v, case.k_cache, case.v_cache, plan, 32**-0.5)
    assert out.dtype == dtype and out.shape == case.q.shape
    case.check(out, 32**-0.5, tol=2e-2)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.update(q=c["q"].float()), "only support fp16 and bf16"),
        (lambda c: c.update(block_table=c["block_table"].long()), "block_table must have dtype torch.int32"),
        (lambda c: c.update(cu_seqlens_q=c["cu_seqlens_q"].long()), "cu_seqlens_q must have dtype int32"),
        (lambda c: c.update(k=c["k"][:, :128], v=c["v"][:, :128]), "divisible by 256"),
        (lambda c: c["block_table"].__setitem__((0, 0), 99), "block ids outside"),
        (lambda c: c.update(q=c["q"][..., :12].contiguous()), "multiple of 8"),
    ],
    ids=["fp32", "int64-table", "int64-cu-seqlens", "page-128", "bad-block-id", "head-dim-12"],
)
def test_the_reference_refuses_what_flash_attn_refuses(change, message):
    case = paged_case([3], [300], 256, 4, 2, 16, dtype=torch.bfloat16, num_blocks=4)
    plan = FlashPagedAttention(256, CPU).plan(case.layout)
    call = dict(
        q=case.q,
        k=case.k_cache,
        v=case.v_cache,
        cu_seqlens_q=plan.cu_seqlens_q,
        cu_seqlens_k=plan.cu_seqlens_k,
        max_seqlen_q=plan.max_q,
        max_seqlen_k=plan.max_k,
        causal=True,
        block_table=plan.block_tables,
    )
    flash_attn_reference.flash_attn_varlen_func(**call)  # as built: accepted
    change(call)
    with pytest.raises(RuntimeError, match=message):
        flash_attn_reference.flash_attn_varlen_func(**call)


def test_engine_on_the_flash_path_generates_the_torch_paths_tokens(qwen3_dir, monkeypatch):
    """Block 256, a shared prefix longer than a block (prefix hits) and a 96-token budget (chunked
    prefill): the real engine with FlashPagedAttention gives the torch backend's greedy tokens."""
    options = dict(
        num_kv_blocks=12, block_size=256, dtype="bfloat16", max_num_batched_tokens=96, max_num_seqs=4
    )
    shared = [(17 * j) % 900 + 3 for j in range(300)]
    prompts = [shared + [5, 6, 7], shared + [8, 9], shared[:150] + [11] * 20]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = LLMEngine(qwen3_dir, attention_backend="torch", **options)
    calls = {"flash_attn_varlen_func": 0, "flash_attn_with_kvcache": 0}

    def counted(name):
        real = getattr(flash_attn_reference, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    for name in calls:
        monkeypatch.setattr(flash_attn_reference, name, counted(name))
    flash = LLMEngine(qwen3_dir, attention_backend="torch", **options)
    flash.runner.backend = FlashPagedAttention(256, CPU)  # the CPU cannot pass choose_backend's CUDA check
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    first = flash.generate(prompts[:1], params)  # warms the prefix cache
    rest = flash.generate(prompts[1:], params)
    assert [o.token_ids for o in first + rest] == expected
    assert rest[0].num_cached_tokens == 256  # a prefix hit, read through the block table
    assert calls["flash_attn_varlen_func"] > 0 and calls["flash_attn_with_kvcache"] > 0


# ---------------------------------------------------------------------- choosing, devices, profiling


def test_flash_attn_is_chosen_only_where_it_can_run(fake_gpu, caplog):
    fake_gpu((8, 0))
    assert choose_backend(None, 256, CUDA0, torch.bfloat16, 72)[0] == "flash_attn"
    refusals = {
        "float32": (256, torch.float32, 64, "the weights are float32; flash-attn runs float16 and bfloat16"),
        "block 16": (16, torch.float16, 64, "block size 16 is not a multiple of 256"),
        "head_dim 36": (256, torch.float16, 36, "head_dim 36; flash-attn needs a multiple of 8"),
    }
    for block, dtype, head_dim, why in refusals.values():  # Triton's kernels take over on CUDA
        chosen, reason = choose_backend(None, block, CUDA0, dtype, head_dim)
        assert chosen == "triton" and why in reason and "Triton's kernels take any block size" in reason
    with pytest.MonkeyPatch.context() as mp:  # without Triton: torch, with the same reason
        mp.setattr(attention, "triton_available", lambda: False)
        for block, dtype, head_dim, why in refusals.values():
            chosen, reason = choose_backend(None, block, CUDA0, dtype, head_dim)
            assert chosen == "torch" and why in reason
        with pytest.raises(ValueError, match="needs the triton package"):
            choose_backend("triton", 16, CUDA0, torch.float16, 64)
    assert choose_backend("triton", 16, CUDA0, torch.float16, 64) == ("triton", "asked for")
    assert choose_backend("triton", 16, CPU, torch.float32, 64)[0] == "triton"  # the interpreter
    with pytest.raises(ValueError, match="cannot run here: the weights are float32"):
        choose_backend("flash_attn", 256, CUDA0, torch.float32, 64)
    assert choose_backend("torch", 256, CUDA0, torch.bfloat16, 64) == ("torch", "asked for")
    fake_gpu((7, 5))
    assert "compute capability 7.5" in choose_backend(None, 256, CUDA0, torch.float16, 64)[1]
    assert "needs CUDA" in choose_backend(None, 256, CPU, torch.float16, 64)[1]
    with caplog.at_level("INFO", logger="kvmesh.engine.models.attention"):
        attention.make_backend(None, 256, CPU, torch.float32, 64, 2)
    assert any(getattr(r, "backend", None) == "torch" and "needs CUDA" in r.why for r in caplog.records)


def test_cuda_resolves_to_an_indexed_device(fake_gpu):
    """``torch.cuda.set_device(torch.device("cuda"))`` raises; the runner must pass an index."""
    fake_gpu()
    for name in ("cuda", None):
        device = resolve_device(name)
        assert device.type == "cuda" and device.index == 0
        assert torch.cuda._utils._get_device_index(device) == 0  # what set_device computes first
    assert resolve_device("cuda:1").index == 1
    with pytest.raises(ValueError, match=r"Expected a torch\.device with a specified index"):
        torch.cuda._utils._get_device_index(torch.device("cuda"))  # the crash this avoids


def test_kv_pool_is_bounded_by_the_share_and_by_what_is_free():
    gib = 2**30
    blocks, bound = kv_pool_bytes(
        total=80 * gib, free=70 * gib, utilization=0.9, weights=2 * gib, activations=gib
    )
    assert blocks == int(72 * gib) - 3 * gib and "gpu_memory_utilization" in bound
    shared, bound = kv_pool_bytes(
        total=80 * gib, free=20 * gib, utilization=0.9, weights=2 * gib, activations=gib
    )
    assert shared == 19 * gib and "free memory" in bound  # another process holds 58 GiB


def test_profiling_warm_up_keeps_no_grad_and_stays_in_the_vocabulary(qwen3_dir, monkeypatch):
    """The warm-up as on a GPU (torch.cuda's memory functions answered by hand): max_num_seqs=1
    puts the whole 2048-token budget in one sequence, past the tiny model's 1024-token vocabulary."""
    engine = LLMEngine(
        qwen3_dir, num_kv_blocks=8, block_size=16, max_num_seqs=1, max_num_batched_tokens=2048, device="cpu"
    )
    runner = engine.runner
    assert runner.spec.vocab_size < 2048
    assert not any(p.requires_grad for p in runner.model.parameters())
    seen = []
    hook = runner.model.register_forward_hook(
        lambda *_: seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
    )
    gib = 2**30
    for name, value in {
        "memory_allocated": lambda device=None: gib,
        "max_memory_allocated": lambda device=None: 2 * gib,
        "reset_peak_memory_stats": lambda device=None: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda device=None: (40 * gib, 80 * gib),
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    blocks = runner._profile_cuda_blocks(engine.config)
    hook.remove()
    assert seen == [(False, True)]
    warm_cache = (2048 // 16) * runner.block_bytes  # one sequence of the whole budget, block 16
    activations = 2 * gib - warm_cache - gib  # the peak, less the warm-up cache and the weights
    assert blocks == (40 * gib - activations) // runner.block_bytes  # free memory is the tighter bound
