"""Paged attention backends over one preallocated KV block pool.

Every step is a batch of sequences; sequence *i* contributes ``query_lens[i]`` new tokens
whose keys/values are stored into its blocks, then attends to its first
``context_lens[i]`` cached tokens (its whole context, new tokens included) with a causal
mask aligned to the bottom right. Decode (one query), first prefill, prefill continuing a
cached prefix and chunked prefill are all that one shape.

- ``TorchPagedAttention``: pure torch, runs anywhere. Keys/values are gathered from the
  block pool by block table and fed to SDPA with an explicit mask. Decode rows and
  prefill rows are attended in separate padded groups so a long prefill chunk never pads
  the decode rows.
- ``FlashPagedAttention``: CUDA + flash-attn. ``flash_attn_varlen_func`` with a block
  table for any batch holding a prefill, ``flash_attn_with_kvcache`` for pure decode.
  flash-attn's paged kernels need a block size that is a multiple of 256.
- ``TritonPagedAttention``: kvmesh's own Triton kernels (``engine/kernels``): one kernel
  for every step's shape, keys read in place through the block table at any block size,
  long decode contexts split across programs; off CUDA they run in Triton's interpreter.

``choose_backend`` picks flash-attn only where its kernels can run (CUDA, the package,
fp16/bf16, compute capability 8.0+, a head size that is a multiple of 8 up to 256, a block
size that is a multiple of 256), else Triton's kernels on CUDA where Triton is installed,
else torch, and says why it picked what it picked.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvmesh.engine.models.transfer import to_device


@dataclass(frozen=True)
class BatchLayout:
    """Where each scheduled token goes; plain Python, built once per step."""

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]  # cache slot (block * block_size + offset) of every new token


log = logging.getLogger(__name__)


@functools.cache
def flash_attn_available() -> bool:
    """CUDA is present and flash-attn imports (a broken build falls back to torch, with a warning)."""
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError as exc:
        log.warning("flash-attn is not usable, attention falls back to torch: %s", exc)
        return False
    return True


@functools.cache
def triton_available() -> bool:
    """Triton is installed (CUDA builds of torch bring it; the test extra pins one for the CPU)."""
    return importlib.util.find_spec("triton") is not None


def flash_attn_unusable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why flash-attn's kernels cannot run here (None: they can, given a 256-multiple block size)."""
    if device.type != "cuda":
        return f"the device is {device.type}, flash-attn needs CUDA"
    if not flash_attn_available():
        return "the flash-attn package is not installed (the 'gpu' extra)"
    if dtype not in (torch.float16, torch.bfloat16):
        return (
            f"the weights are {str(dtype).removeprefix('torch.')}; flash-attn runs float16 and bfloat16 only"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"compute capability {major}.{minor}; flash-attn 2 needs 8.0 (Ampere) or newer"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim}; flash-attn needs a multiple of 8 up to 256 (else it pads a copy of the cache)"
    return None


def choose_backend(
    name: str | None, block_size: int, device: torch.device, dtype: torch.dtype, head_dim: int
) -> tuple[str, str]:
    """(backend name, why): flash-attn where it can run, else Triton's kernels on CUDA, else
    torch; an explicit request for a backend that cannot run is a ValueError saying why."""
    unusable = flash_attn_unusable(device, dtype, head_dim)
    if name == "flash_attn":
        if unusable:
            raise ValueError(f"attention_backend='flash_attn' cannot run here: {unusable}")
        if block_size % 256:
            raise ValueError(
                f"flash-attn paged KV needs a block size that is a multiple of 256, got {block_size}"
            )
        return "flash_attn", "asked for"
    if name == "triton":
        if not triton_available():
            raise ValueError(
                "attention_backend='triton' needs the triton package (CUDA builds of torch bring it)"
            )
        return "triton", "asked for" if device.type == "cuda" else "asked for (Triton's interpreter: slow)"
    if name == "torch":
        return "torch", "asked for"
    if not unusable and block_size % 256 == 0:
        return (
            "flash_attn",
            f"CUDA, {str(dtype).removeprefix('torch.')}, head_dim {head_dim}, block size {block_size}",
        )
    why_not_flash = unusable or (
        f"block size {block_size} is not a multiple of 256, which flash-attn's paged kernels need"
    )
    if device.type == "cuda" and triton_available():
        return "triton", f"flash-attn cannot run ({why_not_flash}); Triton's kernels take any block size"
    return "torch", why_not_flash


def padded_tables(tables: list[list[int]], dtype) -> np.ndarray:
    """Block tables as one ``[rows, longest]`` array, short rows padded with block 0 (never
    read: a row reads no further than its context). Filled in numpy: a row costs a fraction
    of what building it in torch does."""
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=dtype)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write the new tokens' keys/values into their cache slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


@dataclass
class _Group:
    """Sequences attended together: queries padded to ``[rows, max_q]``."""

    token_index: torch.Tensor  # [rows * max_q] index into the step's tokens (padding -> 0)
    # The real (not padding) query positions, as indices computed on the host: a boolean mask
    # indexed on the GPU would wait for the GPU (nonzero) twice per layer.
    padded_index: torch.Tensor  # their positions in [rows * max_q]
    step_index: torch.Tensor  # their positions in the step's tokens
    block_tables: torch.Tensor  # [rows, max_blocks]
    mask: torch.Tensor  # [rows, 1, max_q, max_blocks * block_size] bool, True = attend
    rows: int
    max_q: int


@dataclass
class TorchPlan:
    slots: torch.Tensor
    groups: list[_Group]


class TorchPagedAttention:
    name = "torch"

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device

    def plan(self, layout: BatchLayout) -> TorchPlan:
        decode = [i for i, q in enumerate(layout.query_lens) if q == 1]
        prefill = [i for i, q in enumerate(layout.query_lens) if q > 1]
        starts, total = [], 0
        for q in layout.query_lens:
            starts.append(total)
            total += q
        groups = [self._group(layout, rows, starts) for rows in (decode, prefill) if rows]
        slots = to_device(layout.slot_mapping, torch.long, self.device)
        return TorchPlan(slots=slots, groups=groups)

    def _group(self, layout: BatchLayout, rows: list[int], starts: list[int]) -> _Group:
        q_lens = torch.tensor([layout.query_lens[i] for i in rows])
        ctx_lens = torch.tensor([layout.context_lens[i] for i in rows])
        max_q = int(q_lens.max())
        tables = padded_tables([layout.block_tables[i] for i in rows], np.int64)
        max_blocks = tables.shape[1]
        q_pos = torch.arange(max_q)
        valid = q_pos[None, :] < q_lens[:, None]  # [rows, max_q]
        token_index = torch.where(valid, torch.tensor([starts[i] for i in rows])[:, None] + q_pos[None, :], 0)
        token_index = token_index.reshape(-1)
        # Query j of a row sits at absolute position ctx - q + j and sees keys up to there;
        # padding rows see key 0 alone, so SDPA stays finite. The mask itself (queries x
        # keys: 4M entries for a 2k prompt) is compared out where it is used, from these.
        last_visible = torch.where(valid, (ctx_lens - q_lens)[:, None] + q_pos[None, :], 0)
        k_pos = torch.arange(max_blocks * self.block_size, device=self.device)
        mask = k_pos <= last_visible.to(self.device)[:, None, :, None]  # [rows, 1, max_q, keys]
        padded_index = valid.reshape(-1).nonzero().squeeze(1)
        return _Group(
            token_index=token_index.to(self.device),
            padded_index=padded_index.to(self.device),
            step_index=token_index[padded_index].to(self.device),
            block_tables=torch.from_numpy(tables).to(self.device),
            mask=mask,
            rows=len(rows),
            max_q=max_q,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TorchPlan,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, plan.slots)
        out = torch.empty_like(q)
        num_heads, head_dim = q.shape[1], q.shape[2]
        for g in plan.groups:
            qg = q[g.token_index].view(g.rows, g.max_q, num_heads, head_dim).transpose(1, 2)
            kg = _gather(k_cache, g.block_tables)
            vg = _gather(v_cache, g.block_tables)
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True)
            og = og.transpose(1, 2).reshape(g.rows * g.max_q, num_heads, head_dim)
            out.index_copy_(0, g.step_index, og.index_select(0, g.padded_index))
        return out


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[rows, kv_heads, max_blocks * block_size, head_dim] view of each row's blocks."""
    rows, max_blocks = block_tables.shape
    _, block_size, kv_heads, head_dim = cache.shape
    return cache[block_tables].view(rows, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)


@dataclass
class FlashPlan:
    slots: torch.Tensor
    block_tables: torch.Tensor  # int32 [batch, max_blocks]
    context_lens: torch.Tensor  # int32 [batch]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_q: int
    max_k: int
    decode_only: bool


def flash_plan(layout: BatchLayout, device: torch.device) -> FlashPlan:
    """flash-attn's varlen arguments: cumulative query/key lengths and padded block tables."""

    def i32(values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int32, device)

    cu_q, cu_k = [0], [0]
    for q, c in zip(layout.query_lens, layout.context_lens, strict=True):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + c)
    return FlashPlan(
        slots=to_device(layout.slot_mapping, torch.long, device),
        block_tables=to_device(padded_tables(layout.block_tables, np.int32), torch.int32, device),
        context_lens=i32(layout.context_lens),
        cu_seqlens_q=i32(cu_q),
        cu_seqlens_k=i32(cu_k),
        max_q=max(layout.query_lens),
        max_k=max(layout.context_lens),
        decode_only=all(q == 1 for q in layout.query_lens),
    )


class FlashPagedAttention:
    name = "flash_attn"

    def __init__(self, block_size: int, device: torch.device):
        if block_size % 256:
            raise ValueError(
                f"flash-attn paged KV needs a block size that is a multiple of 256, got {block_size}"
            )
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self.block_size = block_size
        self.device = device

    def plan(self, layout: BatchLayout) -> FlashPlan:
        return flash_plan(layout, self.device)

    def static_plan(
        self,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        max_context: int,
    ) -> FlashPlan:
        """A decode plan over a CUDA graph's buffers (flash-attn's decode entry reads only
        the tables and the context lengths)."""
        return FlashPlan(slots, block_tables, context_lens, query_start, query_start, 1, max_context, True)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: FlashPlan,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, plan.slots)
        if plan.decode_only:
            out = self._with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=plan.context_lens,
                block_table=plan.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=plan.max_q,
            max_seqlen_k=plan.max_k,
            softmax_scale=scale,
            causal=True,
            block_table=plan.block_tables,
        )


@dataclass
class TritonPlan:
    slots: torch.Tensor  # int64 [tokens]
    block_tables: torch.Tensor  # int32 [seqs, max_blocks]
    query_start: torch.Tensor  # int32 [seqs + 1]
    context_lens: torch.Tensor  # int32 [seqs]
    decode_only: bool
    segments: int  # slices each context is split into (flash-decoding; 1: none)


class TritonPagedAttention:
    name = "triton"

    def __init__(self, block_size: int, device: torch.device, kv_heads: int = 1):
        from kvmesh.engine.kernels import paged_attention

        self._kernels = paged_attention
        self.block_size = block_size
        self.device = device
        self.kv_heads = kv_heads
        # Programs that keep every SM busy: a decode batch with fewer splits its contexts.
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        self.programs_wanted = 2 * sms

    def plan(self, layout: BatchLayout) -> TritonPlan:
        tables = padded_tables(layout.block_tables, np.int32)
        query_start = np.zeros(len(layout.query_lens) + 1, dtype=np.int32)
        np.cumsum(layout.query_lens, out=query_start[1:])

        decode_only = max(layout.query_lens) == 1
        return TritonPlan(
            slots=to_device(layout.slot_mapping, torch.long, self.device),
            block_tables=to_device(tables, torch.int32, self.device),
            query_start=to_device(query_start, torch.int32, self.device),
            context_lens=to_device(layout.context_lens, torch.int32, self.device),
            decode_only=decode_only,
            segments=self._segments(len(layout.query_lens), max(layout.context_lens)) if decode_only else 1,
        )

    def static_plan(
        self,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        max_context: int,
    ) -> TritonPlan:
        """A decode plan over a CUDA graph's buffers, split for the longest context it may see."""
        rows = block_tables.shape[0]
        return TritonPlan(
            slots, block_tables, query_start, context_lens, True, self._segments(rows, max_context)
        )

    def _segments(self, rows: int, max_context: int) -> int:
        if not self.programs_wanted:
            return 1
        return self._kernels.decode_segments(rows, self.kv_heads, max_context, self.programs_wanted)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TritonPlan,
        scale: float,
    ) -> torch.Tensor:
        self._kernels.store_kv(k, v, k_cache, v_cache, plan.slots)
        return self._kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            plan.block_tables,
            plan.query_start,
            plan.context_lens,
            scale,
            decode_only=plan.decode_only,
            segments=plan.segments,
        )


AttentionBackend = TorchPagedAttention | FlashPagedAttention | TritonPagedAttention
_BACKENDS = {b.name: b for b in (TorchPagedAttention, FlashPagedAttention, TritonPagedAttention)}


def make_backend(
    name: str | None, block_size: int, device: torch.device, dtype: torch.dtype, head_dim: int, kv_heads: int
) -> AttentionBackend:
    """The backend ``choose_backend`` picks, with one log line saying which and why (a warning
    when flash-attn is installed on this GPU but left unused)."""
    chosen, why = choose_backend(name, block_size, device, dtype, head_dim)
    unused_flash = (
        chosen != "flash_attn" and name is None and device.type == "cuda" and flash_attn_available()
    )
    (log.warning if unused_flash else log.info)("attention backend", extra={"backend": chosen, "why": why})
    if chosen == "triton":
        return TritonPagedAttention(block_size, device, kv_heads)
    return _BACKENDS[chosen](block_size, device)
