"""Owns the model, the KV block pool and the attention backend; runs one step's forward.

The pool is one tensor ``[2, layers, blocks, block_size, kv_heads, head_dim]``; each
attention layer gets views of its K and V slices. On CUDA the number of blocks comes from
``gpu_memory_utilization`` after a warm-up forward at the full token budget; on CPU from
``num_kv_blocks`` or ``kv_cache_memory``. A second pool in host memory (``host_kv``), when
on, holds blocks that left this one.
"""

from __future__ import annotations

import gc
import logging

import numpy as np
import torch

from kvmesh.engine.config import EngineConfig, GiB, host_kv_gib
from kvmesh.engine.cuda_graphs import CaptureReport, CudaGraphReplay, DecodeGraphs, EagerReplay
from kvmesh.engine.host_kv import HostKV
from kvmesh.engine.launched import LaunchedStep, Pending, read_pending
from kvmesh.engine.models.attention import AttentionBackend, BatchLayout, flash_attn_unusable, make_backend
from kvmesh.engine.models.decoder import DecoderForCausalLM, DecoderSpec
from kvmesh.engine.models.loader import load_model, resolve_dtype
from kvmesh.engine.models.transfer import rows_of, to_device
from kvmesh.engine.request import Request
from kvmesh.engine.sampler import FailedPick, Pick, draw

log = logging.getLogger(__name__)


def resolve_device(name: str | None) -> torch.device:
    """The device to run on, with an index for CUDA (``torch.cuda.set_device`` and memory
    queries need one; "cuda" alone means the current device, which Ray sets per actor)."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def default_block_size(device: torch.device, backend: str | None, dtype: torch.dtype, head_dim: int) -> int:
    """256 where flash-attn's paged kernels will run (they need multiples of 256), else 16."""
    wants_flash = backend == "flash_attn" or (
        backend is None and flash_attn_unusable(device, dtype, head_dim) is None
    )
    return 256 if wants_flash else 16


def kv_pool_bytes(
    total: int, free: int, utilization: float, weights: int, activations: int
) -> tuple[int, str]:
    """Bytes for the KV pool on a GPU, and which bound set them.

    The engine may use ``utilization`` of the whole device for weights, activations and KV
    (vLLM's meaning of gpu_memory_utilization); and the KV pool must also fit in what is
    free now, leaving room for the activations, so a GPU shared with another process is
    not overcommitted."""
    by_share = int(total * utilization) - weights - activations
    by_free = free - activations
    if by_free < by_share:
        return by_free, f"free memory ({free / 2**30:.2f} GiB free, another process may hold the rest)"
    return by_share, f"gpu_memory_utilization={utilization} of {total / 2**30:.2f} GiB"


class ModelRunner:
    def __init__(
        self, model_dir: str, config: EngineConfig, hf_config, spec: DecoderSpec, max_model_len: int
    ):
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        self.block_size = config.block_size or default_block_size(
            self.device, config.attention_backend, self.dtype, spec.head_dim
        )
        self.spec = spec
        self.max_model_len, self.max_num_seqs = max_model_len, config.max_num_seqs
        self.graphs: DecodeGraphs | None = None  # decode replays, once captured
        self.graph_capture: CaptureReport | None = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            gc.collect()  # an engine dropped in this process but held in a reference cycle frees its memory first
        self.model: DecoderForCausalLM = load_model(model_dir, spec, self.dtype, self.device)
        self.backend: AttentionBackend = make_backend(
            config.attention_backend,
            self.block_size,
            self.device,
            self.dtype,
            spec.head_dim,
            spec.num_kv_heads,
        )
        self.num_blocks = self._pool_size(config)
        # What requests without a seed of their own draw from (``sampler._race``).
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.kv_cache = torch.zeros(
            2,
            spec.num_layers,
            self.num_blocks,
            self.block_size,
            spec.num_kv_heads,
            spec.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.v_cache = self.kv_cache[1, i]
        host_blocks, self.host_kv_why = self._host_size(config)
        self.host_kv = HostKV(self.kv_cache, host_blocks) if host_blocks else None
        if self.device.type == "cuda" and not config.enforce_eager:
            if hasattr(self.backend, "static_plan"):
                self.capture_decode_graphs(CudaGraphReplay(self.device))
            else:
                log.info("decode runs eagerly: CUDA graphs need the Triton or flash-attn backend")
        log.info(
            "model runner ready",
            extra={
                "device": str(self.device),
                "dtype": str(self.dtype),
                "blocks": self.num_blocks,
                "block_size": self.block_size,
                "attention": self.backend.name,
                "host_blocks": host_blocks,
                "host_kv": self.host_kv_why,
            },
        )

    @torch.inference_mode()
    def capture_decode_graphs(self, replay: CudaGraphReplay | EagerReplay) -> CaptureReport:
        """Decode steps of up to ``max_num_seqs`` rows replay captured graphs from now on."""
        graphs = DecodeGraphs(
            self.model,
            self.backend,
            self.max_num_seqs,
            min(self.num_blocks, -(-self.max_model_len // self.block_size)),
            self.max_model_len,
            self.device,
            replay,
        )
        self.graph_capture = graphs.capture()
        self.graphs = graphs
        return self.graph_capture

    @property
    def block_bytes(self) -> int:
        s = self.spec
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * self.kv_dtype_size

    @property
    def kv_dtype_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def _pool_size(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if self.device.type == "cuda":
            return self._profile_cuda_blocks(config)
        blocks = config.kv_cache_memory // self.block_bytes
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory={config.kv_cache_memory} holds no block of {self.block_bytes} bytes"
            )
        return blocks

    def _host_size(self, config: EngineConfig) -> tuple[int, str]:
        """Host-tier blocks and why that many: the flag's GiB, else on CUDA a share of the
        node's available memory split between its GPUs (off on the CPU, where both tiers
        would be the same RAM)."""
        gib, why = host_kv_gib(config.host_kv_gib, self.device.type, torch.cuda.device_count())
        if not gib:
            return 0, why
        blocks = int(gib * GiB) // self.block_bytes
        return blocks, f"{blocks * self.block_bytes / GiB:.2f} GiB, {why}" if blocks else "off"

    def _profile_cuda_blocks(self, config: EngineConfig) -> int:
        """Blocks that fit after a warm-up forward at the full token budget: its peak memory
        is what the activations need next to the weights; the rest of the memory share, and
        of what is free, goes to the KV pool."""
        tokens = config.max_num_batched_tokens
        seqs = min(config.max_num_seqs, max(1, tokens // 512))
        lens = [tokens // seqs] * seqs
        warm_blocks = sum(-(-n // self.block_size) for n in lens)
        weights = torch.cuda.memory_allocated(self.device)
        warm_cache = torch.zeros(
            2,
            self.spec.num_layers,
            warm_blocks,
            self.block_size,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = warm_cache[0, i], warm_cache[1, i]
        torch.cuda.reset_peak_memory_stats(self.device)
        tables, next_block = [], 0
        for n in lens:
            count = -(-n // self.block_size)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        ids = [[t % self.spec.vocab_size for t in range(n)] for n in lens]  # any valid ids will do
        with torch.inference_mode():  # as in serving: no autograd state kept alive
            self._forward_layout(ids, [0] * seqs, tables, rows=[[n - 1] for n in lens])
        torch.cuda.synchronize(self.device)
        cache_bytes = warm_cache.numel() * warm_cache.element_size()
        activations = max(0, torch.cuda.max_memory_allocated(self.device) - cache_bytes - weights)
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)
        del warm_cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        kv_bytes, bound = kv_pool_bytes(total, free, config.gpu_memory_utilization, weights, activations)
        blocks = kv_bytes // self.block_bytes
        if blocks < 1:
            raise ValueError(
                f"no room for the KV cache: bounded by {bound}; weights take {weights / 2**30:.2f} GiB "
                f"and activations {activations / 2**30:.2f} GiB at max_num_batched_tokens={tokens}"
            )
        log.info(
            "KV pool sized by profiling",
            extra={
                "blocks": blocks,
                "bound": bound,
                "weights_gib": round(weights / 2**30, 2),
                "activations_gib": round(activations / 2**30, 2),
            },
        )
        return blocks

    @torch.inference_mode()
    def run(self, requests: list[Request]) -> list[Pick | FailedPick | None]:
        """Compute this step's tokens and wait for them: for each request that reached its
        end, the sampled token (and its log-probability, if asked), or its own failure.
        Prompt log-probabilities, where asked, are recorded on the request as its prefill
        chunks go by (the one thing ``launch`` cannot do)."""
        step = _StepRows(requests)
        logits = self._forward_layout(step.chunks, step.starts, [r.block_table for r in requests], step.rows)
        failed: dict[int, FailedPick] = {}
        sample_rows, offset = [], 0
        for i, (r, start, chunk_rows, n) in enumerate(
            zip(requests, step.starts, step.rows, step.need, strict=True)
        ):
            if r.wants_prompt_logprobs:
                try:
                    r.record_prompt_logprobs(
                        logits[offset : offset + len(chunk_rows)].log_softmax(dim=-1), start
                    )
                except Exception as exc:  # this request's own stage: the batch goes on
                    failed[i] = FailedPick(f"prompt logprobs failed: {exc}")
            offset += len(chunk_rows)
            if n and i not in failed:
                sample_rows.append(offset - 1)
        sampling = [i for i, n in enumerate(step.need) if n and i not in failed]
        sampled = [requests[i] for i in sampling]
        picked = LaunchedStep(sampled, draw(rows_of(logits, sample_rows), sampled, self.generator)).land()
        picks = dict(zip(sampling, picked, strict=True))
        return [failed.get(i) or picks.get(i) for i in range(len(requests))]

    @torch.inference_mode()
    def launch(self, requests: list[Request], previous: LaunchedStep | None) -> LaunchedStep:
        """Queue this step's forward and draws on the device and return without waiting for
        them (async scheduling). A request whose last token is still pending in ``previous``
        reads it there, on the device (as input and for its penalties). None may still want
        prompt log-probabilities."""
        step = _StepRows(requests)
        pending = None
        if previous is not None and any(r.pending_row is not None for r in requests):
            sources = [  # per token: a pending token is a decode row's one token
                s
                for r, c in zip(requests, step.chunks, strict=True)
                for s in ([-1] * len(c) if r.pending_row is None else [r.pending_row])
            ]
            pending = (sources, previous.tokens)
        logits = self._forward_layout(
            step.chunks, step.starts, [r.block_table for r in requests], step.rows, pending
        )
        sampling = [r for r, n in zip(requests, step.need, strict=True) if n]
        return LaunchedStep(
            sampling, draw(logits, sampling, self.generator, previous.tokens if previous else None)
        )

    def _forward_layout(
        self,
        chunks: list[list[int]],
        starts: list[int],
        tables: list[list[int]],
        rows: list[list[int]],
        pending: Pending | None = None,
    ) -> torch.Tensor:
        """Run the model over this step's chunks; logits of the ``rows`` positions of each
        chunk, in order. ``pending``: decode rows whose token a launched step is still
        sampling, read from its tokens on the device."""
        bs = self.block_size
        decode = all(len(c) == 1 for c in chunks)
        every_row_sampled = decode and all(r == [0] for r in rows)  # a plain decode step
        if decode:  # one token a sequence: plain lists beat numpy at these sizes
            token_ids, positions = [c[0] for c in chunks], starts
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, starts, strict=True)]
        else:
            per_seq = [np.arange(s, s + len(c)) for s, c in zip(starts, chunks, strict=True)]
            token_ids = [t for c in chunks for t in c]
            positions = np.concatenate(per_seq).tolist()
            slots = np.concatenate(
                [np.asarray(t)[p // bs] * bs + p % bs for t, p in zip(tables, per_seq, strict=True)]
            ).tolist()
        if every_row_sampled and self.graphs is not None and len(chunks) <= self.max_num_seqs:
            return self.model.compute_logits(self.graphs.run(token_ids, positions, tables, slots, pending))
        layout = BatchLayout(
            query_lens=[len(c) for c in chunks],
            context_lens=[s + len(c) for s, c in zip(starts, chunks, strict=True)],
            block_tables=tables,
            slot_mapping=slots,
        )
        input_ids = self._ids(token_ids)
        if pending is not None:
            sources, tokens = pending
            input_ids = read_pending(input_ids, self._ids(sources), tokens)
        hidden = self.model(input_ids, self._ids(positions), self.backend, self.backend.plan(layout))
        if every_row_sampled:
            return self.model.compute_logits(hidden)
        first = np.cumsum([0] + [len(c) for c in chunks[:-1]])
        picked = [int(f) + j for f, chunk_rows in zip(first, rows, strict=True) for j in chunk_rows]
        return self.model.compute_logits(rows_of(hidden, picked))

    def _ids(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.long, self.device)


class _StepRows:
    """What each request computes in a step: its chunk of tokens, where the chunk starts,
    whether it reaches the request's end (then a token is sampled), and which of the chunk's
    positions need logits (the last to sample from; every prompt position of a request that
    asked for prompt log-probabilities)."""

    def __init__(self, requests: list[Request]):
        self.chunks = [
            r.token_ids[r.num_computed_tokens : r.num_computed_tokens + r.num_scheduled_tokens]
            for r in requests
        ]
        self.starts = [r.num_computed_tokens for r in requests]
        self.need = [r.num_computed_tokens + r.num_scheduled_tokens == len(r) for r in requests]
        self.rows = [
            list(range(len(c))) if r.wants_prompt_logprobs else ([len(c) - 1] if n else [])
            for r, c, n in zip(requests, self.chunks, self.need, strict=True)
        ]
