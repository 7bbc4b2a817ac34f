"""Paged attention against plain per-sequence causal attention on contiguous K/V."""

import pytest
import torch
import torch.nn.functional as F
from paged_attention_cases import naive_attention, paged_case

from kvmesh.engine.models.attention import BatchLayout, TorchPagedAttention, flash_plan

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


@pytest.mark.parametrize(
    "query_lens", [[1, 1, 1], [5, 1, 9], [7], [3, 12, 1, 1]], ids=["decode", "mixed", "prefill", "chunks"]
)
def test_torch_paged_attention_matches_naive(query_lens):
    case = paged_case(query_lens, [6, 0, 13, 2][: len(query_lens)], BLOCK, HEADS, KV_HEADS, DIM)
    backend = TorchPagedAttention(BLOCK, torch.device("cpu"))
    out = backend.forward(
        case.q, case.new_k, case.new_v, case.k_cache, case.v_cache, backend.plan(case.layout), DIM**-0.5
    )
    case.check(out, DIM**-0.5, tol=1e-5)


def test_flash_plan_arguments():
    layout = BatchLayout(
        query_lens=[3, 1], context_lens=[10, 5], block_tables=[[4, 2, 7], [1, 9]], slot_mapping=[1, 2, 3, 4]
    )
    plan = flash_plan(layout, torch.device("cpu"))
    assert plan.cu_seqlens_q.tolist() == [0, 3, 4] and plan.cu_seqlens_k.tolist() == [0, 10, 15]
    assert plan.block_tables.tolist() == [[4, 2, 7], [1, 9, 0]] and plan.block_tables.dtype == torch.int32
    assert (plan.max_q, plan.max_k, plan.decode_only) == (3, 10, False)
    assert flash_plan(BatchLayout([1, 1], [4, 5], [[0], [1, 2]], [3, 4]), torch.device("cpu")).decode_only


def test_sdpa_reference_is_what_we_think():
    # Guard for the test itself: naive() agrees with SDPA's own causal mask when q == k length.
    q, k, v = (torch.randn(6, HEADS, DIM) for _ in range(3))
    kk, vv = k[:, :KV_HEADS], v[:, :KV_HEADS]
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        kk.repeat_interleave(2, 1).transpose(0, 1),
        vv.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(naive_attention(q, kk, vv, DIM**-0.5), ref)
