"""Paged attention against plain per-sequence causal attention on contiguous K/V."""

import pytest
import torch
import torch.nn.functional as F

from kvmesh.replica.attention import BatchLayout, TorchPagedAttention, flash_plan

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def naive(q, k, v, scale):
    """Causal attention of the last len(q) positions over all of k/v (bottom-right aligned)."""
    n_q, n_k = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    visible = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    "query_lens", [[1, 1, 1], [5, 1, 9], [7], [3, 12, 1, 1]], ids=["decode", "mixed", "prefill", "chunks"]
)
def test_torch_paged_attention_matches_naive(query_lens):
    g = torch.Generator().manual_seed(0)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, non-contiguous blocks
    cached = [6, 0, 13, 2][: len(query_lens)]  # tokens already in the cache before this step
    full_k, full_v, tables, slots = [], [], [], []
    for cached_n, q_n in zip(cached, query_lens, strict=True):
        total = cached_n + q_n
        table = [perm.pop() for _ in range(-(-total // BLOCK))]
        k = torch.randn(total, KV_HEADS, DIM, generator=g)
        v = torch.randn(total, KV_HEADS, DIM, generator=g)
        for pos in range(cached_n):  # what earlier steps stored
            k_cache[table[pos // BLOCK], pos % BLOCK] = k[pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = v[pos]
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached_n, total)]
        full_k.append(k)
        full_v.append(v)
        tables.append(table)
    layout = BatchLayout(
        query_lens=query_lens,
        context_lens=[c + q for c, q in zip(cached, query_lens, strict=True)],
        block_tables=tables,
        slot_mapping=slots,
    )
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=g)
    new_k = torch.cat([k[c:] for k, c in zip(full_k, cached, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, cached, strict=True)])
    backend = TorchPagedAttention(BLOCK, torch.device("cpu"))
    out = backend.forward(q, new_k, new_v, k_cache, v_cache, backend.plan(layout), DIM**-0.5)
    start = 0
    for k, v, q_n in zip(full_k, full_v, query_lens, strict=True):
        expected = naive(q[start : start + q_n], k, v, DIM**-0.5)
        torch.testing.assert_close(out[start : start + q_n], expected, rtol=1e-5, atol=1e-5)
        start += q_n


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
    torch.testing.assert_close(naive(q, kk, vv, DIM**-0.5), ref)
