"""Continuous batching with chunked prefill, prefix-cache reuse and preemption by recompute.

Each step has a token budget (``max_num_batched_tokens``). Running requests go first, in
admission order: a decoding request takes one token, a request still prefilling takes
the next chunk of its prompt. Then waiting requests are admitted while the budget, the
``max_num_seqs`` limit and free blocks allow; admission reuses cached prefix blocks, so
only the uncached rest of a prompt is computed. When a running request needs a block and
none is free, the most recently admitted request is preempted: its blocks are freed
(their hashes stay hittable) and it waits at the head of the queue to be recomputed,
usually from its own cached blocks.

Hooks a subclass may override (the simulator's ``LazyDecodeScheduler``,
``bench/experiments/lazy_scheduler.py``, does, to touch only the requests at a boundary):
``schedule_running`` (the running requests' share of a step), ``preempt`` and ``admit``; the
rest (``add``, ``schedule``, ``step_done``, ``finish``) is the engine's interface.
"""

from __future__ import annotations

import time
from collections import deque

from kvmesh.engine.request import PrefixFacts, Request, Status
from kvmesh.kvcache import BlockManager


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[Request]:
        """Pick this step's requests and set each one's ``num_scheduled_tokens``."""
        scheduled, budget, preempted = self.schedule_running(self.max_num_batched_tokens)
        if not preempted:  # memory is tight after a preemption: no admissions this step
            self.admit(scheduled, budget)
        return scheduled

    def schedule_running(self, budget: int) -> tuple[list[Request], int, bool]:
        """The running requests' share of the step, in admission order: (scheduled, budget
        left, whether any was preempted). A request whose token in flight is its last sits
        the step out (async scheduling): it ends when that token lands."""
        scheduled: list[Request] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.ends_when_pending_lands:
                i += 1
                continue
            preempted |= self._make_room(request)
            if request.status is not Status.RUNNING:
                break
            self.block_manager.may_append(request)
            budget -= self._take(request, budget)
            scheduled.append(request)
            i += 1
        return scheduled, budget, preempted

    def _make_room(self, request: Request) -> bool:
        """Preempt the newest running requests until ``request``'s next tokens have blocks
        (it may be preempted itself); whether any was."""
        preempted = False
        while not self.block_manager.can_append(request):
            self.preempt(self.running.pop())
            preempted = True
            if request.status is not Status.RUNNING:
                break
        return preempted

    def admit(self, scheduled: list[Request], budget: int) -> None:
        """Admit waiting requests, oldest first, while the budget, ``max_num_seqs`` and the
        free blocks allow (each reuses its cached prefix blocks)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_cached_blocks = self.block_manager.can_allocate(request)
            if request.params.prompt_logprobs is not None and num_cached_blocks >= 0:
                # its whole prompt is computed (as in vLLM): every position's logits are needed
                fits = request.num_blocks <= self.block_manager.num_free_blocks
                num_cached_blocks = 0 if fits else -1
            if num_cached_blocks < 0:
                break
            self.waiting.popleft()
            self.block_manager.allocate(request, num_cached_blocks)
            if request.cached_prompt_tokens is None:
                request.cached_prompt_tokens = request.num_cached_tokens
                request.host_cached_prompt_tokens = request.num_host_cached_tokens
                request.scheduled_time = time.monotonic()
                stored, evicted = self.block_manager.hit_facts(request)
                first = request.block_hashes[0] if request.block_hashes else None
                request.prefix_facts = PrefixFacts(first, tuple(stored), evicted, request.arrival_time)
            request.status = Status.RUNNING
            self.running.append(request)
            budget -= self._take(request, budget)
            scheduled.append(request)

    @staticmethod
    def _take(request: Request, budget: int) -> int:
        n = min(len(request) - request.num_computed_tokens, budget)
        request.num_scheduled_tokens = n
        return n

    def preempt(self, request: Request) -> None:
        """Free ``request``'s blocks (their hashes stay hittable) and put it at the head of the queue."""
        self.block_manager.deallocate(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def step_done(self, scheduled: list[Request]) -> None:
        """Record the computed tokens; full computed blocks become hittable."""
        for request in scheduled:
            request.num_computed_tokens += request.num_scheduled_tokens
            request.num_scheduled_tokens = 0
            self.block_manager.hash_blocks(request)

    def finish(self, request: Request, reason: str) -> None:
        """Remove ``request`` wherever it is and free its blocks now (a token a launched step
        is still sampling for it will never be its: the place held for it goes too)."""
        request.forget_pending()
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self.block_manager.deallocate(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
