"""A plain-torch reference for the two flash-attn 2 functions kvmesh calls, for machines
without CUDA.

This is a *reference implementation of a component this machine lacks*, not a mock: it
computes what flash-attn's paged kernels are documented to compute (``flash_attn_interface``
docstrings, flash-attn 2.6+), and refuses what their C++ entry points refuse, so that the
real ``FlashPagedAttention`` (its argument building, its cache layout, its decode/prefill
split) runs and is checked on CPU. What it cannot show: kernel numerics and speed, which only
a GPU run (``tests/engine/test_cuda.py``, ``make gpu-check``) can.

Semantics implemented:
  - paged K/V caches ``[num_blocks, page_block_size, nheads_k, headdim]`` read through an int32
    ``block_table`` ``[batch, max_blocks_per_seq]``;
  - grouped-query attention: query head ``h`` reads key/value head ``h // (nheads / nheads_k)``;
  - ``causal=True`` aligned to the bottom right when a sequence has fewer queries than keys
    (query ``i`` of ``q_len`` sees keys ``0 .. k_len - q_len + i``);
  - scores and softmax in float32, the output in the query's dtype.
Checks enforced (each one a check of flash-attn's own, same wording where it has one):
fp16/bf16 only, K/V of the query's dtype, one device for every tensor, int32 contiguous
metadata, contiguous last dimensions, 4-D paged caches whose page size is a multiple of 256,
head_dim a multiple of 8 and at most 256, heads divisible by K/V heads, block ids in range.
"""

from __future__ import annotations

import torch


def _check_common(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor
) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache)):
        raise RuntimeError("Input tensor must have contiguous last dimension")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise RuntimeError(
            f"paged caches must be [num_blocks, page_block_size, nheads_k, headdim], got {tuple(k_cache.shape)}"
        )
    if k_cache.shape[1] % 256:
        raise RuntimeError("Paged KV cache block size must be divisible by 256")
    if block_table.dtype != torch.int32:
        raise RuntimeError("block_table must have dtype torch.int32")
    if block_table.stride(-1) != 1:
        raise RuntimeError("block_table must have contiguous last dimension")
    head_dim, heads, kv_heads = q.shape[-1], q.shape[-2], k_cache.shape[2]
    if head_dim > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if head_dim % 8:
        raise RuntimeError(
            "head dimension not a multiple of 8: flash-attn would pad a copy of the whole cache"
        )
    if heads % kv_heads:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def _check_device(*tensors: torch.Tensor) -> None:
    if len({t.device for t in tensors}) != 1:
        raise RuntimeError(
            f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}"
        )


def _check_int32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.int32:
        raise RuntimeError(f"{name} must have dtype int32")
    if not t.is_contiguous():
        raise RuntimeError(f"{name} must be contiguous")


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    k_len: int,
    scale: float,
) -> torch.Tensor:
    """One sequence: q [q_len, heads, dim] over its first ``k_len`` cached tokens, causal bottom-right."""
    page = k_cache.shape[1]
    used = table[: -(-k_len // page)].long()
    if bool(((used < 0) | (used >= k_cache.shape[0])).any()):
        raise RuntimeError(f"block_table holds block ids outside [0, {k_cache.shape[0]}): {used.tolist()}")
    k = k_cache[used].reshape(-1, *k_cache.shape[2:])[:k_len]
    v = v_cache[used].reshape(-1, *v_cache.shape[2:])[:k_len]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    q_len = q.shape[0]
    visible = (
        torch.arange(k_len, device=q.device)[None, :]
        <= torch.arange(k_len - q_len, k_len, device=q.device)[:, None]
    )
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_table: torch.Tensor | None = None,
    **unsupported,
) -> torch.Tensor:
    """q [total_q, heads, dim]; with ``block_table``, k/v are paged caches. Only what kvmesh uses."""
    if unsupported or dropout_p or block_table is None or not causal:
        raise NotImplementedError("the reference covers kvmesh's call: paged, causal, no dropout")
    _check_common(q, k, v, block_table)
    _check_device(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table)
    _check_int32("cu_seqlens_q", cu_seqlens_q)
    _check_int32("cu_seqlens_k", cu_seqlens_k)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cu_q) != block_table.shape[0] + 1 or len(cu_k) != len(cu_q) or cu_q[-1] != q.shape[0]:
        raise RuntimeError("cu_seqlens and block_table disagree on the batch or the query count")
    out = torch.empty_like(q)
    for b in range(len(cu_q) - 1):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if q_len > max_seqlen_q or k_len > max_seqlen_k or q_len > k_len:
            raise RuntimeError(
                f"sequence {b}: {q_len} queries, {k_len} keys, max {max_seqlen_q}/{max_seqlen_k}"
            )
        out[cu_q[b] : cu_q[b + 1]] = _attend(q[cu_q[b] : cu_q[b + 1]], k, v, block_table[b], k_len, scale)
    return out


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    **unsupported,
) -> torch.Tensor:
    """q [batch, q_len, heads, dim] over paged caches holding ``cache_seqlens`` tokens each."""
    if unsupported or block_table is None or cache_seqlens is None:
        raise NotImplementedError("the reference covers kvmesh's call: paged caches, given lengths")
    _check_common(q, k_cache, v_cache, block_table)
    _check_device(q, k_cache, v_cache, cache_seqlens, block_table)
    _check_int32("cache_seqlens", cache_seqlens)
    if q.dim() != 4 or q.shape[0] != block_table.shape[0] or cache_seqlens.shape != (q.shape[0],):
        raise RuntimeError(
            "q must be [batch, seqlen_q, heads, dim], one block_table row and length per sequence"
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    lens = cache_seqlens.tolist()
    if not causal and q.shape[1] > 1:
        raise NotImplementedError("the reference covers causal attention")
    return torch.stack(
        [_attend(q[b], k_cache, v_cache, block_table[b], lens[b], scale) for b in range(q.shape[0])]
    )
