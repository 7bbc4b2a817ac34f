"""Paged attention over the engine's KV block pool, and the KV write by slot mapping.

One kernel serves every step's shape. Queries are packed ``[tokens, heads, dim]``; sequence
*i* owns ``query_start[i]:query_start[i + 1]`` of them and sees its first
``context_lens[i]`` keys (its cached prefix, then these new tokens), causal aligned to the
bottom right. Keys and values are read in place through the block table, token by token
(so any block size works and no gathered copy is made). A program takes ``BLOCK_Q``
queries of one sequence and every query head of one KV head (grouped-query attention: the
group shares each key tile it loads); programs find their sequence by binary search, so the
grid depends only on the step's token and sequence counts, which keeps a launch the same
under a CUDA graph. With ``segments > 1`` (flash-decoding) each program covers a slice of
the context and a second kernel merges the slices' partial softmaxes: a few decode rows
with long contexts then still fill the GPU.

A padding row (slot -1) writes no KV: a graph's padded batch never touches a live slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows (queries x heads of a group) a program computes at once: tl.dot's smallest tile on
# the GPU is 16. Prefill takes taller tiles: more queries share each key tile read.
DECODE_ROWS = 16
PREFILL_ROWS = 64
TILE = 32  # keys per inner step
MAX_SEGMENTS = 16


@triton.jit
def _find_sequence(query_start_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles include ``q_tile`` (sequence s's first tile is
    ``query_start[s] // BLOCK_Q + s``)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# fmt: off
@triton.jit
def _attend(
    q, k_cache_ptr, v_cache_ptr, table_ptr, kv_offset, stride_cb, stride_cs,
    lo, hi, sees_upto, row_ok, dims, dim_ok, scale,
    ROWS: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_KEYS: tl.constexpr, PRECISION: tl.constexpr,
):
    # fmt: on
    """The rows' online softmax over keys ``lo..hi`` of one sequence (its block table row at
    ``table_ptr``), each key read in place: (row max, row sum, unnormalized output)."""
    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_P], tl.float32)
    start = lo
    while start < hi:  # not range(): the interpreter cannot index with a runtime bound on numpy 2.4
        pos = start + tl.arange(0, TILE_KEYS)
        pos_ok = pos < hi
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        at = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_offset
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        seen = row_ok[:, None] & pos_ok[None, :] & (pos[None, :] <= sees_upto[:, None])
        s = tl.where(seen, s, float("-inf"))
        max_new = tl.maximum(row_max, tl.max(s, 1))
        max_safe = tl.where(max_new > float("-inf"), max_new, 0.0)  # rows that saw nothing yet stay 0
        p = tl.exp(s - max_safe[:, None])
        alpha = tl.exp(row_max - max_safe)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        row_max = max_new
        start += TILE_KEYS
    return row_max, row_sum, acc


# fmt: off
@triton.jit
def _attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
    part_max_ptr, part_sum_ptr, part_acc_ptr,  # flash-decoding's partial results (SEGMENTS > 1)
    scale, num_seqs, num_heads, table_stride,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, TILE_KEYS: tl.constexpr,
    SEGMENTS: tl.constexpr, PRECISION: tl.constexpr,
):
    # fmt: on
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_sequence(query_start_ptr, q_tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    local = q_tile - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    context = tl.load(context_lens_ptr + seq)
    prefix = context - q_len  # keys stored before this step's first query

    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    q_index = local * BLOCK_Q + rows // GROUP_P  # the query within its sequence
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (q_index < q_len) & (rows % GROUP_P < GROUP)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    token = q_start + q_index
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    sees_upto = prefix + q_index  # a query sees keys 0..its own position

    # The keys this tile's last query sees, split into SEGMENTS tile-aligned slices.
    keys = prefix + tl.minimum((local + 1) * BLOCK_Q, q_len)
    per_segment = ((keys + SEGMENTS - 1) // SEGMENTS + TILE_KEYS - 1) // TILE_KEYS * TILE_KEYS
    lo = segment * per_segment
    hi = tl.minimum(lo + per_segment, keys)

    row_max, row_sum, acc = _attend(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * table_stride, kv_head * stride_ch,
        stride_cb, stride_cs, lo, hi, sees_upto, row_ok, dims, dim_ok, scale,
        BLOCK_Q * GROUP_P, HEAD_DIM_P, BLOCK_SIZE, TILE_KEYS, PRECISION,
    )  # fmt: skip

    if SEGMENTS == 1:
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        part = (token * num_heads + head) * SEGMENTS + segment
        tl.store(part_max_ptr + part, row_max, mask=row_ok)
        tl.store(part_sum_ptr + part, row_sum, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_segments_kernel(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    SEGMENTS: tl.constexpr,
):
    """One (token, head): its slices' partial softmaxes rescaled to the largest max and summed."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    part = (token * num_heads + head) * SEGMENTS + tl.arange(0, SEGMENTS)
    dims = tl.arange(0, HEAD_DIM_P)
    row_max = tl.load(part_max_ptr + part)
    row_sum = tl.load(part_sum_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P + dims[None, :])
    top = tl.max(row_max, 0)
    weight = tl.exp(row_max - tl.where(top > float("-inf"), top, 0.0))  # an empty slice weighs 0
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(row_sum * weight, 0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_vt,
    WIDTH: tl.constexpr,
    WIDTH_P: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:  # a padding row
        return
    cols = tl.arange(0, WIDTH_P)
    ok = cols < WIDTH
    at = slot.to(tl.int64) * WIDTH + cols
    tl.store(k_cache_ptr + at, tl.load(k_ptr + token * stride_kt + cols, mask=ok), mask=ok)
    tl.store(v_cache_ptr + at, tl.load(v_ptr + token * stride_vt + cols, mask=ok), mask=ok)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write each new token's keys/values ``[tokens, kv_heads, dim]`` into its cache slot
    (``slots``: block * block_size + offset; -1 writes nothing)."""
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    width = k.shape[1] * k.shape[2]
    if k.shape[0]:
        _store_kv_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), width, triton.next_power_of_2(width)
        )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Each token's heads x dim in one run (a view of a fused projection usually is)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def program_shape(group: int, head_dim: int, decode_only: bool) -> tuple[int, int, int]:
    """What one attention program holds: (queries, query heads a KV head padded to a power
    of two, head size padded likewise)."""
    group_p = triton.next_power_of_2(group)
    rows = DECODE_ROWS if decode_only else PREFILL_ROWS
    return max(1, rows // group_p), group_p, max(16, triton.next_power_of_2(head_dim))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    decode_only: bool = False,
    segments: int = 1,
    tile: int = TILE,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[tokens, heads, dim]`` over the cache ``[blocks, block_size,
    kv_heads, dim]``: ``block_tables`` int32 ``[seqs, max_blocks]``, ``query_start`` int32
    ``[seqs + 1]``, ``context_lens`` int32 ``[seqs]``. ``segments`` (a power of two) splits
    each context across that many programs (flash-decoding)."""
    if q.stride(2) != 1:
        q = q.contiguous()
    tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // kv_heads
    block_q, group_p, dim_p = program_shape(group, head_dim, decode_only)
    out = torch.empty_like(q) if out is None else out
    if segments > 1:
        part_max = torch.empty(tokens, num_heads, segments, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(tokens, num_heads, segments, dim_p, dtype=torch.float32, device=q.device)
    else:
        part_max = part_sum = part_acc = out  # unused
    grid = (tokens // block_q + num_seqs, kv_heads, segments)
    _attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start,
        context_lens,
        part_max,
        part_sum,
        part_acc,
        scale,
        num_seqs,
        num_heads,
        block_tables.stride(0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=dim_p,
        TILE_KEYS=tile,
        SEGMENTS=segments,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if segments > 1:
        _merge_segments_kernel[(tokens, num_heads)](
            out,
            part_max,
            part_sum,
            part_acc,
            num_heads,
            out.stride(0),
            out.stride(1),
            head_dim,
            dim_p,
            segments,
        )
    return out


def decode_segments(num_seqs: int, kv_heads: int, max_context: int, programs_wanted: int) -> int:
    """How many slices to split each decode context into (a power of two): enough programs to
    fill the GPU (``programs_wanted``, e.g. twice its SM count), no slice under two key tiles."""
    programs = num_seqs * kv_heads
    if programs >= programs_wanted:
        return 1
    limit = min(MAX_SEGMENTS, triton.cdiv(programs_wanted, programs), max(1, max_context // (2 * TILE)))
    return 1 << (limit.bit_length() - 1)
