"""Decode steps replayed from CUDA graphs: one launch for the whole model, not one per kernel.

A decode step of a small model is a thousand short kernels, and launching them one by one
from Python keeps the GPU waiting. So the model's decode forward is captured once at start,
after the KV pool is allocated, for batch-size buckets up to ``max_num_seqs`` (1, 2, 4, 8,
then steps of 16: nano-vllm's), largest first, all in one memory pool. Each graph reads
static buffers (token ids, positions, slot mapping, block tables, context lengths) that a
step refills; a batch pads to its bucket with rows that write no KV slot (slot -1, one
visible key) and whose outputs nobody reads. Prefill, mixed batches, batches past the
largest bucket and the torch backend (its plan is built on the host) run eagerly.

``EagerReplay`` stands in for the capture where there is no GPU: it runs the same forward on
the same static buffers at every replay, which is what a graph replays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.engine.launched import Pending, read_pending

log = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16, up to ``max_num_seqs`` (itself always a bucket)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return [*buckets, max_num_seqs]


class CudaGraphReplay:
    """Captures with ``torch.cuda.graph``, every graph in one pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Callable[[], None]) -> Callable[[], None]:
        forward()  # a warm-up outside the capture: kernels compile, libraries set up
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        return graph.replay


class EagerReplay:
    """The stand-in without a GPU: a replay runs the captured forward again, eagerly."""

    def capture(self, forward: Callable[[], None]) -> Callable[[], None]:
        forward()
        return forward


@dataclass
class CaptureReport:
    buckets: list[int]
    seconds: float
    bytes: int  # device memory the graphs hold (0 off CUDA)


class DecodeGraphs:
    """Static buffers for ``max_num_seqs`` decode rows and one replay per bucket."""

    def __init__(
        self,
        model,
        backend,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
        replay: CudaGraphReplay | EagerReplay,
    ):
        self.model, self.backend, self.device = model, backend, device
        self.buckets = graph_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        rows = max_num_seqs
        pinned = device.type == "cuda"

        def pair(shape, dtype) -> tuple[torch.Tensor, torch.Tensor]:
            """A device buffer and its host twin (pinned on CUDA: the copy does not block)."""
            host = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
            return torch.zeros(shape, dtype=dtype, device=device), host

        self.token_ids, self._token_ids = pair(rows, torch.long)
        self.positions, self._positions = pair(rows, torch.long)
        self.slots, self._slots = pair(rows, torch.long)
        self.context_lens, self._context_lens = pair(rows, torch.int32)
        self.block_tables, self._block_tables = pair((rows, max_blocks_per_seq), torch.int32)
        self.sources, self._sources = pair(rows, torch.long)  # rows reading a pending token
        self.query_start = torch.arange(rows + 1, dtype=torch.int32, device=device)  # one query a row
        self.hidden = torch.zeros(
            rows, model.spec.hidden_size, dtype=model.lm_head.weight.dtype, device=device
        )
        self._replay = replay
        # Set once the host buffers' last copy is queued; waited on before they are refilled,
        # since with async scheduling that copy may not have run yet.
        self._copied = torch.cuda.Event() if pinned else None
        self._graphs: dict[int, Callable[[], None]] = {}
        self.replays = 0
        self._pad(0, rows)
        self._copy_in(rows, max_blocks_per_seq)  # what the capture runs on: padding, no KV written

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket that holds ``rows`` decode rows (None: past the largest)."""
        return next((b for b in self.buckets if b >= rows), None)

    def capture(self) -> CaptureReport:
        started = time.monotonic()
        free_before = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        for bucket in reversed(self.buckets):  # largest first: the smaller reuse its pool
            self._graphs[bucket] = self._replay.capture(self._forward(bucket))
        held = free_before - torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        report = CaptureReport(list(self.buckets), time.monotonic() - started, max(0, held))
        log.info(
            "decode graphs captured",
            extra={
                "buckets": len(report.buckets),
                "seconds": round(report.seconds, 2),
                "bytes": report.bytes,
            },
        )
        return report

    def _forward(self, bucket: int) -> Callable[[], None]:
        plan = self.backend.static_plan(
            self.slots[:bucket],
            self.block_tables[:bucket],
            self.query_start[: bucket + 1],
            self.context_lens[:bucket],
            self.max_model_len,
        )

        def forward() -> None:
            hidden = self.model(self.token_ids[:bucket], self.positions[:bucket], self.backend, plan)
            self.hidden[:bucket].copy_(hidden)

        return forward

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        tables: list[list[int]],
        slots: list[int],
        pending: Pending | None = None,
    ):
        """This step's hidden states, one row per decode sequence (``len(token_ids)`` rows,
        at most the largest bucket): the buffers refilled, the bucket's graph replayed.
        ``pending``: rows whose token a launched step is still sampling, read on the device."""
        rows = len(token_ids)
        bucket = self.bucket(rows)
        width = max(len(t) for t in tables)
        if self._copied is not None:
            self._copied.synchronize()
        self._token_ids.numpy()[:rows] = token_ids
        self._positions.numpy()[:rows] = positions
        self._slots.numpy()[:rows] = slots
        self._context_lens.numpy()[:rows] = np.asarray(positions) + 1
        host_tables = self._block_tables.numpy()
        for row, table in enumerate(tables):
            host_tables[row, : len(table)] = table
        self._pad(rows, bucket)
        self._copy_in(bucket, width)
        if pending is not None:
            self._sources.numpy()[:rows] = pending[0]
            self.sources[:bucket].copy_(self._sources[:bucket], non_blocking=True)
            ids = self.token_ids[:bucket]
            ids.copy_(read_pending(ids, self.sources[:bucket], pending[1]))
        if self._copied is not None:
            self._copied.record()
        self._graphs[bucket]()
        self.replays += 1
        return self.hidden[:rows]

    def _copy_in(self, rows: int, width: int) -> None:
        """The host buffers' first ``rows`` rows (tables: ``width`` blocks; a row never reads
        past its context) to the device buffers the graphs read."""
        for device_buffer, host in (
            (self.token_ids, self._token_ids),
            (self.positions, self._positions),
            (self.slots, self._slots),
            (self.context_lens, self._context_lens),
        ):
            device_buffer[:rows].copy_(host[:rows], non_blocking=True)
        self.block_tables[:rows, :width].copy_(self._block_tables[:rows, :width], non_blocking=True)

    def _pad(self, start: int, end: int) -> None:
        """Rows ``start:end`` as padding: token 0 at position 0, one visible key in block 0,
        and slot -1, so their KV goes nowhere."""
        self._token_ids.numpy()[start:end] = 0
        self._sources.numpy()[start:end] = -1
        self._positions.numpy()[start:end] = 0
        self._slots.numpy()[start:end] = -1
        self._context_lens.numpy()[start:end] = 1
        self._block_tables.numpy()[start:end] = 0
