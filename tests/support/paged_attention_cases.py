"""Paged-attention test cases: scattered KV blocks filled as earlier steps would have, and
plain causal attention over contiguous K/V as the reference every backend must match."""

from dataclasses import dataclass

import torch

from kvmesh.engine.models.attention import BatchLayout


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last len(q) positions over all of k/v (bottom-right aligned),
    grouped-query heads expanded, in float32."""
    n_q, n_k = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(groups, dim=1), v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    visible = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@dataclass
class PagedCase:
    layout: BatchLayout
    q: torch.Tensor  # this step's queries [sum(query_lens), heads, dim]
    new_k: torch.Tensor  # this step's keys/values, to be stored by the backend
    new_v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block, kv_heads, dim], earlier tokens already stored
    v_cache: torch.Tensor
    full_k: list[torch.Tensor]  # every sequence's whole K/V, for the reference
    full_v: list[torch.Tensor]

    def check(self, out: torch.Tensor, scale: float, tol: float) -> None:
        start = 0
        for k, v, q_n in zip(self.full_k, self.full_v, self.layout.query_lens, strict=True):
            expected = naive_attention(self.q[start : start + q_n], k, v, scale)
            torch.testing.assert_close(out[start : start + q_n].float(), expected, rtol=tol, atol=tol)
            start += q_n


def paged_case(
    query_lens: list[int],
    cached: list[int],
    block: int,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype = torch.float32,
    num_blocks: int = 64,
    seed: int = 0,
) -> PagedCase:
    """Sequence i has ``cached[i]`` tokens in the cache and ``query_lens[i]`` new ones."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(num_blocks, block, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, non-contiguous blocks
    full_k, full_v, tables, slots = [], [], [], []
    for cached_n, q_n in zip(cached, query_lens, strict=True):
        total = cached_n + q_n
        table = [perm.pop() for _ in range(-(-total // block))]
        k = torch.randn(total, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(total, kv_heads, dim, generator=g).to(dtype)
        for pos in range(cached_n):  # what earlier steps stored
            k_cache[table[pos // block], pos % block] = k[pos]
            v_cache[table[pos // block], pos % block] = v[pos]
        slots += [table[p // block] * block + p % block for p in range(cached_n, total)]
        full_k.append(k)
        full_v.append(v)
        tables.append(table)
    layout = BatchLayout(
        query_lens=query_lens,
        context_lens=[c + q for c, q in zip(cached, query_lens, strict=True)],
        block_tables=tables,
        slot_mapping=slots,
    )
    q = torch.randn(sum(query_lens), heads, dim, generator=g).to(dtype)
    new_k = torch.cat([k[c:] for k, c in zip(full_k, cached, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, cached, strict=True)])
    return PagedCase(layout, q, new_k, new_v, k_cache, v_cache, full_k, full_v)
