"""The engine's Scheduler with its steady decoders advanced in bulk: the simulator's replica.

In a real step every running request is touched, yet most of them only decode one more token,
and nothing the ledger, the index or the routers see changes until one of them fills a block,
needs a new one, or finishes. This scheduler parks such a request: it notes the step it was
parked before and the step of its next boundary (a heap ordered by step, then admission) and
leaves its tokens and counters as they were. A step then touches the requests at a boundary,
the one still prefilling and the admissions, so what it costs does not grow with how many
decode; a parked request is brought up to date when its boundary comes or it is preempted.

The choices are the engine's Scheduler's, in the same order (tests run both and compare):
  - each running decoder takes one token of the budget, so the budget outlasts the running
    list (``max_num_seqs < max_num_batched_tokens``, checked);
  - only the last request admitted can still be prefilling (each admission takes the rest of
    the budget when its prompt does not fit), so it is the one that takes the rest (checked);
  - a parked request needs no block before its boundary, so only a request at a boundary can
    run out of blocks, and the preemption pops the newest running request as the engine does.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from kvmesh.engine.request import Request, Status
from kvmesh.engine.scheduler import Scheduler
from kvmesh.kvcache import BlockManager


class LazyDecodeScheduler(Scheduler):
    """``Scheduler`` whose steps touch only the requests at a boundary; ``next_tokens(request,
    n)`` says which ``n`` tokens a request samples next (a parked one's skipped tokens)."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        next_tokens: Callable[[Request, int], Sequence[int]],
    ):
        if max_num_seqs >= max_num_batched_tokens:
            raise ValueError("parking decoders needs max_num_seqs < max_num_batched_tokens")
        super().__init__(block_manager, max_num_seqs, max_num_batched_tokens)
        self.next_tokens = next_tokens
        self.step = 0  # the step being planned (steps done so far)
        self._admissions = itertools.count()
        self._admitted: dict[int, int] = {}  # id(running request) -> its admission number
        self._parkings = itertools.count()
        # id(request) -> (parked before this step, its tokens then, parking number)
        self._parked: dict[int, tuple[int, int, int]] = {}
        # (boundary step, admission number, parking number, request); stale once it is not parked
        self._due: list[tuple[int, int, int, Request]] = []
        self._parked_context = 0  # sum over parked requests of (tokens when parked - step parked)
        self._touched: list[Request] = []  # the requests the last step scheduled

    # ------------------------------------------------------------------ what a step costs

    @property
    def parked(self) -> int:
        """Requests decoding this step without being touched."""
        return len(self._parked)

    def parked_context(self, steps_ahead: int = 0) -> int:
        """The context tokens the parked requests attend to ``steps_ahead`` steps from now."""
        return self._parked_context + len(self._parked) * (self.step + steps_ahead)

    def quiet_steps(self) -> int:
        """Steps from this one that touch no request when nothing arrives (a pure-decode
        window): until the next boundary. 0 when this step touches one."""
        self._drop_stale()
        return self._due[0][0] - self.step if self._due and not self._touched else 0

    # ------------------------------------------------------------------ the engine's API

    def schedule(self) -> list[Request]:
        self._park_touched()
        self._touched = super().schedule()
        return self._touched

    def step_done(self, scheduled: list[Request]) -> None:
        super().step_done(scheduled)
        self.step += 1

    def skip(self, steps: int) -> None:
        """``steps`` quiet steps ran (see ``quiet_steps``)."""
        self.step += steps

    def finish(self, request: Request, reason: str) -> None:
        self._catch_up(request)
        super().finish(request, reason)
        self._admitted.pop(id(request), None)

    def schedule_running(self, budget: int) -> tuple[list[Request], int, bool]:
        scheduled: list[Request] = []
        preempted = False
        for request in self._pop_due():  # in admission order, as the engine walks them
            if request.status is not Status.RUNNING:
                continue  # preempted for one before it
            self._catch_up(request)
            preempted |= self._make_room(request)
            if request.status is not Status.RUNNING:
                break  # so is every request after it
            self.block_manager.may_append(request)
            request.num_scheduled_tokens = 1
            scheduled.append(request)
        budget -= len(self.running)  # one token for each running request, parked ones included
        last = self.running[-1] if self.running else None
        if last is not None and id(last) not in self._parked and last not in scheduled:
            if _decoding(last):
                raise AssertionError("a running decoder is neither parked nor at its boundary")
            budget += 1 - self._take(last, budget + 1)  # still prefilling: the rest of the budget
            scheduled.append(last)
        return scheduled, budget, preempted

    def preempt(self, request: Request) -> None:
        self._catch_up(request)
        self._admitted.pop(id(request), None)
        super().preempt(request)

    def admit(self, scheduled: list[Request], budget: int) -> None:
        before = len(self.running)
        super().admit(scheduled, budget)
        for request in self.running[before:]:
            self._admitted[id(request)] = next(self._admissions)

    # ------------------------------------------------------------------ parking

    def _park_touched(self) -> None:
        """Park last step's requests that now decode, due at their next boundary: the step
        that fills a block (it becomes hittable), needs a new one, or samples the last token."""
        bs = self.block_manager.block_size
        for request in self._touched:
            if request.status is not Status.RUNNING or not _decoding(request):
                continue
            tokens = len(request)  # this step computes token tokens-1 and samples one more
            fills = -tokens % bs
            grows = len(request.block_table) * bs - tokens + 1
            ends = request.params.max_tokens - request.num_completion_tokens - 1
            due = self.step + max(0, min(fills, grows, ends))
            parking = next(self._parkings)
            self._parked[id(request)] = (self.step, tokens, parking)
            self._parked_context += tokens - self.step
            heapq.heappush(self._due, (due, self._admitted[id(request)], parking, request))
        self._touched = []

    def _pop_due(self) -> list[Request]:
        due = []
        while self._due and self._due[0][0] <= self.step:
            entry = heapq.heappop(self._due)
            if self._live(entry):
                due.append(entry[3])
        return due

    def _drop_stale(self) -> None:
        while self._due and not self._live(self._due[0]):
            heapq.heappop(self._due)

    def _live(self, entry: tuple[int, int, int, Request]) -> bool:
        parked = self._parked.get(id(entry[3]))
        return parked is not None and parked[2] == entry[2]

    def _catch_up(self, request: Request) -> None:
        """Bring a parked request to where the engine would have it before this step."""
        parked = self._parked.pop(id(request), None)
        if parked is None:
            return
        since, tokens, _ = parked
        self._parked_context -= tokens - since
        skipped = self.step - since
        if skipped:
            request.token_ids.extend(self.next_tokens(request, skipped))
            request.num_computed_tokens += skipped


def _decoding(request: Request) -> bool:
    """Its next step computes its last token and samples the next: a decoder (one that has
    sampled before, so parking it skips no first token)."""
    return request.num_computed_tokens == len(request) - 1 and request.num_completion_tokens > 0
