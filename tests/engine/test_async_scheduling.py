"""Async scheduling: step N+1 is planned and launched before step N's tokens are read.

Whatever the overlap, a request's tokens, finish reason and text are what the engine gives
without it: through chunked prefill, stops that leave a launched row nobody owns, aborts
while a step is in flight, preemption, and the decode graphs reading pending tokens on the
device. On CPU the forward is synchronous, so these tests prove correctness, not speed; on a
GPU (`make gpu-check`) they run on the device with the graphs the engine captured.
"""

import itertools

import pytest
import torch

from kvmesh.engine import LLMEngine, SamplingParams
from kvmesh.engine.cuda_graphs import EagerReplay
from kvmesh.engine.launched import LaunchedStep, read_pending
from kvmesh.engine.request import PENDING_TOKEN

OPTIONS = dict(
    block_size=16, max_num_seqs=4, max_num_batched_tokens=48, dtype="float32", check_invariants=True
)
PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 19, 33, 40, 70, 12])]


def workload(qwen3_dir) -> list[SamplingParams]:
    """Greedy and seeded sampling rows; three requests stop on a token they reach early (a
    step already launched for them then computes a row nobody owns), the rest by length."""
    first = LLMEngine(qwen3_dir, num_kv_blocks=64, dtype="float32", async_scheduling=False).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    stops = [o.token_ids[k] for o, k in zip(first, [2, 5, 1, 8, 3, 0], strict=True)]
    return [
        SamplingParams(
            temperature=0 if i % 2 else 0.8,
            seed=i,
            max_tokens=n,
            ignore_eos=True,
            stop_token_ids=[stops[i]] if i % 2 else [],
        )
        for i, n in enumerate((3, 6, 9, 20, 30, 1))
    ]


def count_calls(engine: LLMEngine) -> dict:
    """Count the engine's synchronous runs and launches (a batch that could launch but fell
    back shows), and the rows each launched step samples."""
    calls = {"run": 0, "launch": 0, "rows": []}
    run, launch = engine.runner.run, engine.runner.launch

    def counted_run(requests):
        calls["run"] += 1
        return run(requests)

    def counted_launch(requests, previous):
        calls["launch"] += 1
        step = launch(requests, previous)
        calls["rows"].append(len(step.requests))
        return step

    engine.runner.run, engine.runner.launch = counted_run, counted_launch
    return calls


def outcome(outputs) -> list:
    return [(o.token_ids, o.finish_reason, o.text) for o in outputs]


@pytest.fixture(scope="module")
def params(qwen3_dir):
    return workload(qwen3_dir)


def test_async_scheduling_gives_the_synchronous_engines_outputs(qwen3_dir, params):
    sync = LLMEngine(qwen3_dir, num_kv_blocks=64, async_scheduling=False, **OPTIONS)
    expected = sync.generate(PROMPTS, params)
    engine = LLMEngine(qwen3_dir, num_kv_blocks=64, async_scheduling=True, **OPTIONS)
    calls = count_calls(engine)
    assert outcome(engine.generate(PROMPTS, params)) == outcome(expected)
    assert calls["run"] == 0  # every batch was launched ahead, none fell back
    # A request whose token in flight is its last (max_tokens) sits the next step out; one that
    # stops on a token leaves one row nobody reads.
    stopped = sum(o.finish_reason == "stop" for o in expected)
    assert (
        sum(len(o.token_ids) for o in expected)
        <= sum(calls["rows"])
        <= sum(len(o.token_ids) for o in expected) + stopped
    )
    assert engine.requests == {} and engine._in_flight is None and engine.block_manager.num_used_blocks == 0


def test_a_batch_nobody_waits_for_lands_unmeasured(qwen3_dir, params):
    """A request that stops on a token leaves a launched row behind: one more step lands it,
    and its cost is not measured (nobody waited for it; it may have sat through an idle spell)."""
    engine = LLMEngine(qwen3_dir, num_kv_blocks=64, async_scheduling=True, **OPTIONS)
    [out] = engine.generate(PROMPTS[3:4], params[3:4])
    assert out.finish_reason == "stop" and len(out.token_ids) < params[3].max_tokens
    assert engine.requests == {} and engine.has_unfinished_requests()
    steps = engine.step_costs.steps
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert engine.step_costs.steps == steps > 0
    assert engine._in_flight is None and engine.block_manager.num_used_blocks == 0


def test_a_preempted_request_keeps_the_token_its_launched_step_samples(qwen3_dir):
    """Four requests outgrow eight blocks: the newest are preempted while their next token is
    in flight, and recomputed later, with the tokens the synchronous engine gives."""
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([30, 34, 38, 28])]
    params = [
        SamplingParams(temperature=i % 2 * 0.8, seed=i, max_tokens=40, ignore_eos=True) for i in range(4)
    ]
    options = {**OPTIONS, "num_kv_blocks": 8, "max_num_batched_tokens": 64}
    sync = LLMEngine(qwen3_dir, async_scheduling=False, **options)
    expected = outcome(sync.generate(prompts, params))
    engine = LLMEngine(qwen3_dir, async_scheduling=True, **options)
    assert outcome(engine.generate(prompts, params)) == expected
    assert sync.stats().num_preemptions and engine.stats().num_preemptions


def test_the_next_batch_is_launched_before_the_last_one_lands(qwen3_dir, monkeypatch):
    engine = LLMEngine(qwen3_dir, num_kv_blocks=32, async_scheduling=True, **OPTIONS)
    order = []
    launch, land = engine.runner.launch, LaunchedStep.land

    def launching(requests, previous):
        order.append("launch")
        return launch(requests, previous)

    def landing(step):
        order.append("land")
        return land(step)

    monkeypatch.setattr(engine.runner, "launch", launching)
    monkeypatch.setattr(LaunchedStep, "land", landing)
    rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched; its token is not read yet
    request = engine.requests[rid]
    assert request.token_ids[-1] == PENDING_TOKEN and request.pending_row == 0
    first = engine.step()  # the first decode launched, then the prefill landed
    assert [o.new_token_ids for o in first] == [[request.token_ids[-2]]]
    assert order == ["launch", "launch", "land"]


def test_an_abort_while_its_token_is_in_flight_leaves_no_pending_place(qwen3_dir):
    engine = LLMEngine(qwen3_dir, num_kv_blocks=32, async_scheduling=True, **OPTIONS)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    gone, kept = engine.add_request(PROMPTS[1], greedy), engine.add_request(PROMPTS[2], greedy)
    engine.step()
    engine.step()
    assert engine.requests[gone].pending_row is not None
    engine.abort(gone)
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs[gone].finish_reason == "abort" and PENDING_TOKEN not in outputs[gone].new_token_ids
    kept_tokens = outputs[kept].new_token_ids if kept in outputs else []
    while engine.has_unfinished_requests():
        for o in engine.step():
            kept_tokens += o.new_token_ids
    expected = LLMEngine(qwen3_dir, num_kv_blocks=32, async_scheduling=False, **OPTIONS).generate(
        [PROMPTS[2]], greedy
    )
    assert kept_tokens == expected[0].token_ids
    assert engine.requests == {} and engine.block_manager.num_used_blocks == 0


def test_logprobs_and_penalties_are_launched_ahead_with_the_synchronous_outputs(qwen3_dir):
    """Log-probabilities are read back with the tokens, and penalties count the token still
    in flight on the device: such batches launch ahead and give what the synchronous engine
    gives (a strong repetition penalty changes greedy tokens every step, so a pending token
    left out of it shows)."""
    base = dict(max_tokens=12, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, logprobs=2, **base),
        SamplingParams(temperature=0, repetition_penalty=3.0, **base),
        SamplingParams(
            temperature=0.8, seed=5, frequency_penalty=1.5, presence_penalty=0.5, logprobs=0, **base
        ),
        SamplingParams(temperature=0, min_tokens=10, logit_bias={7: 3.0}, **{**base, "ignore_eos": False}),
        SamplingParams(temperature=0, presence_penalty=2.0, repetition_penalty=0.5, **base),
    ]
    sync = LLMEngine(qwen3_dir, num_kv_blocks=64, async_scheduling=False, **OPTIONS)
    expected = sync.generate(PROMPTS[:5], params)
    engine = LLMEngine(qwen3_dir, num_kv_blocks=64, async_scheduling=True, **OPTIONS)
    calls = count_calls(engine)
    got = engine.generate(PROMPTS[:5], params)
    assert outcome(got) == outcome(expected)
    for ours, theirs in zip(got, expected, strict=True):  # a batch's other rows move the last ulp
        assert [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in ours.logprobs or []] == [
            (lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in theirs.logprobs or []
        ]
        assert [lp.logprob for lp in ours.logprobs or []] == pytest.approx(
            [lp.logprob for lp in theirs.logprobs or []], abs=1e-5
        )
    assert [lp.token_id for lp in got[0].logprobs] == got[0].token_ids and len(got[0].logprobs[0].top) == 2
    assert calls["run"] == 0
    plain = sync.generate(PROMPTS[1:2], SamplingParams(temperature=0, **base))[0]
    assert plain.token_ids != got[1].token_ids  # the penalty changed the tokens


def test_a_prompt_with_prompt_logprobs_runs_synchronously(qwen3_dir):
    """Prompt log-probabilities are recorded from each prefill chunk on the host: that
    batch is not launched ahead; the decode steps after it are."""
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    sync = LLMEngine(qwen3_dir, num_kv_blocks=32, async_scheduling=False, **OPTIONS)
    expected = sync.generate(PROMPTS[1:3], params)
    engine = LLMEngine(qwen3_dir, num_kv_blocks=32, async_scheduling=True, **OPTIONS)
    calls = count_calls(engine)
    got = engine.generate(PROMPTS[1:3], params)
    assert outcome(got) == outcome(expected) and got[0].prompt_logprobs == expected[0].prompt_logprobs
    assert calls["run"] > 0 and calls["launch"] > 0


def test_a_row_left_without_a_token_fails_alone_when_its_step_lands(qwen3_dir):
    """min_tokens over every vocabulary id leaves a launched row nothing to draw: the step
    draws on without a host sync, and that request fails alone when the step lands."""
    engine = LLMEngine(qwen3_dir, num_kv_blocks=32, async_scheduling=True, **OPTIONS)
    every_id = list(range(engine.vocab_size))
    bad = SamplingParams(temperature=1.0, max_tokens=4, min_tokens=2, stop_token_ids=every_id)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    calls = count_calls(engine)
    outs = engine.generate(PROMPTS[:2], [bad, greedy])
    assert outs[0].finish_reason == "error" and outs[0].token_ids == []
    expected = LLMEngine(qwen3_dir, num_kv_blocks=32, async_scheduling=False, **OPTIONS).generate(
        PROMPTS[1:2], greedy
    )
    assert outs[1].token_ids == expected[0].token_ids and calls["run"] == 0


def test_a_failed_launch_runs_the_batch_after_the_last_one_lands(qwen3_dir, params):
    engine = LLMEngine(qwen3_dir, num_kv_blocks=64, async_scheduling=True, **OPTIONS)
    launch, failures = engine.runner.launch, iter([True, False, True])

    def flaky(requests, previous):
        if next(failures, False):
            raise RuntimeError("launch failed")
        return launch(requests, previous)

    engine.runner.launch = flaky
    expected = outcome(
        LLMEngine(qwen3_dir, num_kv_blocks=64, async_scheduling=False, **OPTIONS).generate(PROMPTS, params)
    )
    assert outcome(engine.generate(PROMPTS, params)) == expected


def test_async_scheduling_is_on_where_a_device_runs_ahead(qwen3_dir):
    engine = LLMEngine(qwen3_dir, num_kv_blocks=16, **OPTIONS)
    assert engine.async_scheduling is (engine.runner.device.type == "cuda")


def test_a_pending_token_is_read_from_the_launched_steps_tokens():
    ids = torch.tensor([5, PENDING_TOKEN, 7, PENDING_TOKEN])
    tokens = torch.tensor([40, 41, 42])
    assert read_pending(ids, torch.tensor([-1, 2, -1, 0]), tokens).tolist() == [5, 42, 7, 40]


@pytest.mark.slow
def test_decode_graphs_read_pending_tokens_on_the_device(qwen3_dir, params):
    """Decode batches replay the graphs (on CPU through ``EagerReplay``, Triton's kernels in
    its interpreter), each row's token taken from the launched step's tokens."""
    options = {**OPTIONS, "attention_backend": "triton", "num_kv_blocks": 64}
    # Four rows (stopped early and by length, greedy and seeded): each decode step is a replay
    # in Triton's interpreter, so the workload's longest rows would only repeat the same steps.
    prompts, params = PROMPTS[:4], params[:4]
    expected = outcome(LLMEngine(qwen3_dir, async_scheduling=False, **options).generate(prompts, params))
    engine = LLMEngine(qwen3_dir, async_scheduling=True, **options)
    if engine.runner.graphs is None:
        engine.runner.capture_decode_graphs(EagerReplay())
    calls = count_calls(engine)
    assert outcome(engine.generate(prompts, params)) == expected
    assert engine.runner.graphs.replays > 0 and calls["run"] == 0


def test_a_landing_that_fails_on_the_device_breaks_the_engine_once(qwen3_dir, monkeypatch):
    """A device error surfaces when a launched step lands: the engine is broken, its requests
    fail as the engine's fault, and the failed landing is not tried again."""
    import asyncio

    from kvmesh.engine import AsyncLLMEngine
    from kvmesh.engine.protocol import EngineDeadError

    engine = LLMEngine(qwen3_dir, num_kv_blocks=32, async_scheduling=True, **OPTIONS)
    landings = []

    def fails(step):
        landings.append(step)
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(LaunchedStep, "land", fails)

    async def main():
        runner = AsyncLLMEngine(engine)
        try:
            async for _ in runner.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4), "r"):
                pass
        except EngineDeadError as exc:
            return str(exc), runner.health()
        finally:
            runner.shutdown()

    error, health = asyncio.run(main())
    assert "illegal memory access" in error and health.startswith("engine broken")
    assert len(landings) == 1 and engine._in_flight is None and engine.requests == {}


def test_after_a_failed_landing_the_engine_recomputes_what_it_lost(qwen3_dir, monkeypatch):
    """An engine stepped directly, past a landing that failed: the requests whose tokens were
    lost are recomputed from the tokens they had, and end with the synchronous engine's."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = LLMEngine(qwen3_dir, num_kv_blocks=32, async_scheduling=False, **OPTIONS).generate(
        PROMPTS[:2], greedy
    )
    engine = LLMEngine(qwen3_dir, num_kv_blocks=32, async_scheduling=True, **OPTIONS)
    land, landings = LaunchedStep.land, itertools.count()

    def third_fails(step):
        if next(landings) == 2:
            raise RuntimeError("lost")
        return land(step)

    monkeypatch.setattr(LaunchedStep, "land", third_fails)
    ids = [engine.add_request(p, greedy) for p in PROMPTS[:2]]
    tokens = {rid: [] for rid in ids}
    with pytest.raises(RuntimeError, match="lost"):
        while True:
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
    assert all(PENDING_TOKEN not in r.token_ids for r in engine.requests.values())
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[rid] for rid in ids] == [o.token_ids for o in expected]
    assert engine.block_manager.num_used_blocks == 0
