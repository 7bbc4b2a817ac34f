"""The host tier's bytes: a second KV pool in host memory, and the copies between it and the
device pool that the block ledger asks for (``kvcache.block_manager.Transfer``).

The copies run in the order they were asked for, before the step that overwrites or reads
their device blocks. On CUDA the host pool is pinned and the copies go on a stream of their
own: it waits for the steps already launched (they may still write the blocks it reads) and
the next step waits for it, so only a step with copies waits for them. On the CPU the same
code copies between two tensors in RAM, so every test runs here.
"""

from __future__ import annotations

import time

import torch

from kvmesh.engine.step_costs import RestoreCostFit
from kvmesh.kvcache.block_manager import OFFLOAD, Transfer


class HostKV:
    """``num_blocks`` host blocks of the device pool's block shape, block-major (a block is one
    contiguous span, so each copies as one transfer)."""

    def __init__(self, device_pool: torch.Tensor, num_blocks: int):
        self.device_pool = device_pool  # [2, layers, blocks, block_size, kv_heads, head_dim]
        self.device = device_pool.device
        block = (device_pool.shape[0], device_pool.shape[1], *device_pool.shape[3:])
        cuda = self.device.type == "cuda"
        self.pool = torch.zeros((num_blocks, *block), dtype=device_pool.dtype, pin_memory=cuda)
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.num_blocks = num_blocks
        self.offloaded = 0  # blocks copied to the host
        self.restored = 0  # blocks copied back
        self.restore_seconds = 0.0  # the restores' copy time, measured (what a restored block costs)
        self.restore_cost = RestoreCostFit()  # the same, per block, recent restores weighing more
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []  # CUDA restores in flight

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def run(self, transfers: list[Transfer]) -> None:
        """Copy every block in order: a run of one kind goes as one gather or scatter on the
        device and one copy per block across the link."""
        if not transfers:
            return
        if self.stream is None:
            self._run_in_order(transfers)
            return
        self._harvest()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._run_in_order(transfers)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _run_in_order(self, transfers: list[Transfer]) -> None:
        start = 0
        for end in range(1, len(transfers) + 1):
            if end == len(transfers) or transfers[end].kind != transfers[start].kind:
                run = transfers[start:end]
                (self._offload if run[0].kind == OFFLOAD else self._restore)(run)
                start = end

    def _offload(self, run: list[Transfer]) -> None:
        blocks = torch.tensor([t.block for t in run], device=self.device)
        rows = self.device_pool.index_select(2, blocks).movedim(2, 0).contiguous()
        for k, t in enumerate(run):
            self.pool[t.slot].copy_(rows[k], non_blocking=True)
        self.offloaded += len(run)

    def _restore(self, run: list[Transfer]) -> None:
        cuda = self.stream is not None
        if cuda:
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        started = time.perf_counter()
        rows = torch.empty((len(run), *self.pool.shape[1:]), dtype=self.pool.dtype, device=self.device)
        for k, t in enumerate(run):
            rows[k].copy_(self.pool[t.slot], non_blocking=True)
        blocks = torch.tensor([t.block for t in run], device=self.device)
        self.device_pool.index_copy_(2, blocks, rows.movedim(0, 2))
        self.restored += len(run)
        if cuda:
            timing[1].record()
            self._timing.append((*timing, len(run)))
        else:
            self._restored(len(run), time.perf_counter() - started)

    def _restored(self, blocks: int, seconds: float) -> None:
        self.restore_seconds += seconds
        self.restore_cost.observe(blocks, seconds)

    def _harvest(self) -> None:
        """Add the finished CUDA restores' times (read when done, never waited for)."""
        while self._timing and self._timing[0][1].query():
            start, end, blocks = self._timing.pop(0)
            self._restored(blocks, start.elapsed_time(end) / 1000)
