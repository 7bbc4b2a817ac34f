"""Scheduler over the real BlockManager, stepped by hand with made-up token ids: its rules
(admission, chunked prefill, prefix reuse, preemption) checked without torch or a model."""

import subprocess
import sys

from kvmesh.engine.request import Request, Status
from kvmesh.engine.scheduler import Scheduler
from kvmesh.kvcache import BlockManager
from kvmesh.serving.sampling_params import SamplingParams

BS = 4  # tokens per KV block
SAMPLED = 9  # the token every "forward" picks


def scheduler(num_blocks: int = 16, max_num_seqs: int = 8, max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs, max_num_batched_tokens)


def request(request_id: str, tokens, max_tokens: int = 16, **params) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **params)
    return Request(request_id, list(tokens), BS, params, None, frozenset(), None)


def add(s: Scheduler, *requests: Request) -> None:
    for r in requests:
        s.add(r)


def step(s: Scheduler) -> list[tuple[str, int]]:
    """One ``LLMEngine.step`` without a model: schedule, compute the scheduled tokens, give a
    token to each request whose scheduled tokens reach its end (finishing it at max_tokens).
    Returns the batch: (request id, tokens scheduled), in batch order."""
    scheduled = s.schedule()
    batch = [(r.request_id, r.num_scheduled_tokens) for r in scheduled]
    sampled = [r for r in scheduled if r.num_computed_tokens + r.num_scheduled_tokens == len(r)]
    s.step_done(scheduled)
    for r in sampled:
        r.add_token(SAMPLED, None)
        if r.num_completion_tokens >= r.params.max_tokens:
            s.finish(r, "length")
    s.block_manager.check_invariants()
    return batch


def test_importing_the_scheduler_loads_no_torch():
    """The simulator schedules requests without torch (and this file needs none)."""
    code = "import sys, kvmesh.engine.scheduler, kvmesh.engine.request; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- admission


def test_admission_is_fifo_up_to_max_num_seqs():
    s = scheduler(max_num_seqs=2)
    a, b, c = request("a", [10, 11], max_tokens=1), request("b", [20, 21]), request("c", [30, 31])
    add(s, a, b, c)
    assert step(s) == [("a", 2), ("b", 2)]
    assert list(s.waiting) == [c]
    # a finished with its one token: its seat goes to c, after b's decode
    assert step(s) == [("b", 1), ("c", 2)]


def test_admission_stops_when_the_token_budget_is_spent():
    s = scheduler(max_num_batched_tokens=8)
    a, b, c = (request(x, range(base, base + 4)) for x, base in (("a", 10), ("b", 20), ("c", 30)))
    add(s, a, b, c)
    assert step(s) == [("a", 4), ("b", 4)]
    assert list(s.waiting) == [c]
    assert step(s) == [("a", 1), ("b", 1), ("c", 4)]


def test_a_request_without_free_blocks_waits_and_later_ones_queue_behind_it():
    s = scheduler(num_blocks=4)
    a = request("a", range(10, 18), max_tokens=2)  # 2 blocks
    b = request("b", range(20, 32))  # 3 blocks
    c = request("c", [30, 31])  # 1 block
    add(s, a, b, c)
    assert step(s) == [("a", 8)]
    # 2 blocks are free: too few for b; c would fit but does not overtake b
    assert s.block_manager.num_free_blocks == 2
    assert list(s.waiting) == [b, c]
    assert step(s) == [("a", 1)]  # a decodes its last token and frees its blocks
    assert step(s) == [("b", 12), ("c", 2)]


# ---------------------------------------------------------------- chunked prefill


def test_a_long_prompt_is_prefilled_in_chunks_and_running_requests_go_first():
    s = scheduler(max_num_batched_tokens=4)
    a, b = request("a", range(10, 20)), request("b", [20, 21, 22])
    add(s, a, b)
    assert step(s) == [("a", 4)]  # a's chunk spends the budget: b waits
    assert step(s) == [("a", 4)]
    assert (a.num_computed_tokens, a.num_completion_tokens) == (8, 0)  # no token mid-prompt
    assert step(s) == [("a", 2), ("b", 2)]  # a's last chunk, then b gets what is left
    assert (a.num_completion_tokens, b.num_completion_tokens) == (1, 0)
    assert step(s) == [("a", 1), ("b", 1)]  # a decodes first, b takes its last chunk
    assert step(s) == [("a", 1), ("b", 1)]


def test_prefill_chunks_make_their_full_blocks_hittable_as_they_are_computed():
    s = scheduler(max_num_batched_tokens=6)
    a = request("a", range(10, 20))
    add(s, a)
    step(s)  # tokens 0..5: block 0 full
    assert s.block_manager.cached_hashes() == {a.block_hashes[0]}
    step(s)  # tokens 6..9: block 1 full, block 2 partial
    assert s.block_manager.cached_hashes() == set(a.block_hashes[:2])


# ---------------------------------------------------------------- prefix-cache reuse

PREFIX = list(range(100, 108))  # two full blocks


def test_a_shared_prefix_is_reused_and_only_the_rest_computed():
    s = scheduler()
    a = request("a", PREFIX + [200, 201])
    add(s, a)
    assert step(s) == [("a", 10)]
    b = request("b", PREFIX + [300, 301, 302])
    add(s, b)
    assert step(s) == [("a", 1), ("b", 3)]
    assert b.cached_prompt_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert s.block_manager.ref_count(a.block_table[0]) == 2


def test_an_identical_cached_prompt_still_computes_its_last_block():
    s = scheduler()
    add(s, request("a", PREFIX))
    step(s)
    b = request("b", PREFIX)
    add(s, b)
    assert step(s) == [("a", 1), ("b", 4)]  # the last block is never looked up
    assert b.cached_prompt_tokens == 4


def test_a_prompt_logprobs_request_computes_its_whole_prompt():
    s = scheduler()
    add(s, request("a", PREFIX + [200, 201]))
    step(s)
    b = request("b", PREFIX + [300, 301, 302], prompt_logprobs=1)
    add(s, b)
    assert step(s) == [("a", 1), ("b", 11)]
    assert b.cached_prompt_tokens == 0


# ---------------------------------------------------------------- preemption


def preempting() -> tuple[Scheduler, Request, Request, Request, Request]:
    """a, b, c fill all 4 blocks; in the second step a's decode needs a fifth, so c (the
    newest) is preempted; d arrived between the two steps."""
    s = scheduler(num_blocks=4)
    a = request("a", range(10, 14))  # 1 block; its first token needs a second
    b = request("b", [20, 21, 22])  # 1 block, room for its first token
    c = request("c", range(30, 35))  # 2 blocks, room for its first token
    add(s, a, b, c)
    assert step(s) == [("a", 4), ("b", 3), ("c", 5)]
    assert s.block_manager.num_free_blocks == 0
    d = request("d", range(40, 44))
    add(s, d)
    return s, a, b, c, d


def test_the_newest_request_is_preempted_and_waits_at_the_head():
    s, a, b, c, d = preempting()
    c_hash = c.block_hashes[0]
    assert step(s) == [("a", 1), ("b", 1)]
    assert s.running == [a, b]
    assert list(s.waiting) == [c, d]
    assert (c.status, c.block_table, c.num_computed_tokens) == (Status.WAITING, [], 0)
    assert (s.num_preemptions, c.num_preemptions) == (1, 1)
    assert c_hash in s.block_manager.cached_hashes()  # freed, still hittable


def test_a_preempted_request_is_recomputed_from_its_own_cached_blocks():
    s, _, b, c, d = preempting()
    first_block = c.block_table[0]
    step(s)  # c preempted
    s.finish(b, "stop")  # room for c again
    assert step(s) == [("a", 1), ("c", 2)]  # c: its 5th prompt token and its sampled one
    assert c.block_table[0] == first_block
    assert c.num_cached_tokens == 4
    assert c.cached_prompt_tokens == 0  # what its first admission found
    assert list(s.waiting) == [d]


def test_requests_preempted_in_one_step_wait_in_admission_order():
    s = scheduler(num_blocks=3)
    a, b = request("a", range(10, 14)), request("b", range(20, 24))  # each needs a block to decode
    c = request("c", [30, 31, 32])
    add(s, a, b, c)
    step(s)
    d = request("d", [40])
    add(s, d)
    # a's block comes from preempting c; b then needs one too and, now the newest, preempts itself
    assert step(s) == [("a", 1)]
    assert s.running == [a]
    assert list(s.waiting) == [b, c, d]
    assert s.num_preemptions == 2


# ---------------------------------------------------------------- finish


def test_finish_frees_a_running_request_and_drops_a_waiting_one():
    s = scheduler(max_num_seqs=1)
    a, b = request("a", [10, 11]), request("b", [20, 21])
    add(s, a, b)
    step(s)
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert (s.running, list(s.waiting)) == ([], [])
    assert s.block_manager.num_free_blocks == 16
    assert (a.status, a.finish_reason, b.status) == (Status.FINISHED, "abort", Status.FINISHED)
    assert s.schedule() == []
