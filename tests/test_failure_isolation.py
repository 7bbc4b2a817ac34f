"""One request's failure stays its own: a request whose sampling, stop rule or forward fails
ends alone with finish reason "error" while the requests beside it produce the tokens they
would have; an engine whose steps keep failing (a device that stays unusable) is broken,
says so in its health, and refuses new work; a step loop that stops turning is stalled."""

import asyncio
import time

import pytest
import torch
from reference import prompts_of_lengths

from kvmesh.engine import LLMEngine, SamplingParams
from kvmesh.engine import sampler as sampler_module
from kvmesh.engine.async_engine import AsyncLLMEngine
from kvmesh.engine.llm_engine import BROKEN_AFTER_FAILED_STEPS
from kvmesh.engine.protocol import EngineDeadError
from kvmesh.serving.errors import RequestFailed

PROMPTS = prompts_of_lengths([40, 23, 57], salt=21)
# The ordinary requests: greedy, seeded sampling with penalties (so it passes through the
# same adjust stage as the faulty one), and greedy with a stop token id.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[3], min_tokens=2),
]
MARKER_BIAS = {11: 0.25}  # what the fault hook looks for: the one request it makes fail


@pytest.fixture
def engine(qwen3_dir):
    return LLMEngine(qwen3_dir, num_kv_blocks=256, block_size=16, max_num_seqs=8)


def faulty(**extra) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logit_bias=dict(MARKER_BIAS), **extra
    )


def ordinary_tokens(engine) -> list[list[int]]:
    return [out.token_ids for out in engine.generate(PROMPTS, PARAMS)]


def test_a_request_whose_sampling_raises_fails_alone(engine, monkeypatch):
    expected = ordinary_tokens(engine)
    real_adjust = sampler_module.row_adjustments

    def adjust_or_raise(request, *args):
        if request.params.logit_bias == MARKER_BIAS:
            raise RuntimeError("injected sampling fault")
        return real_adjust(request, *args)

    monkeypatch.setattr(sampler_module, "row_adjustments", adjust_or_raise)
    outs = engine.generate([PROMPTS[0], *PROMPTS], [faulty(), *PARAMS])
    assert outs[0].finish_reason == "error" and outs[0].token_ids == []
    assert [o.token_ids for o in outs[1:]] == expected  # the others: the same tokens as without it
    assert all(o.finish_reason == "length" for o in outs[1:])
    assert engine.stats().num_failed_requests == 1 and engine.broken is None
    assert engine.stats().kv.num_used_blocks == 0  # the failed request's blocks were freed


def test_min_tokens_that_rules_out_every_token_fails_that_request_alone(engine):
    """Every vocabulary id a stop id with min_tokens: no token can be sampled. Unchecked, that
    is a NaN multinomial (a device-side assert on CUDA) that fails the whole batch."""
    expected = ordinary_tokens(engine)
    every_id = list(range(engine.vocab_size))
    bad = SamplingParams(temperature=1.0, max_tokens=4, min_tokens=2, stop_token_ids=every_id)
    outs = engine.generate([PROMPTS[1], *PROMPTS], [bad, *PARAMS])
    assert outs[0].finish_reason == "error"
    assert [o.token_ids for o in outs[1:]] == expected


def test_a_forward_that_fails_with_one_request_is_retried_without_it(engine, monkeypatch):
    expected = ordinary_tokens(engine)
    poison = engine.vocab_size - 1  # a valid token id only the faulty prompt holds
    real_forward = engine.runner._forward_layout

    def forward(chunks, *args):
        if any(poison in chunk for chunk in chunks):
            raise RuntimeError("injected forward fault")
        return real_forward(chunks, *args)

    monkeypatch.setattr(engine.runner, "_forward_layout", forward)
    outs = engine.generate([[5, 6, poison, 7], *PROMPTS], [PARAMS[0], *PARAMS])
    assert outs[0].finish_reason == "error"
    assert [o.token_ids for o in outs[1:]] == expected
    assert engine.broken is None and engine.failed_steps == 0
    # nothing the failed request computed became hittable: the same prompt computes afresh
    monkeypatch.setattr(engine.runner, "_forward_layout", real_forward)
    [again] = engine.generate([[5, 6, poison, 7]], PARAMS[0])
    assert again.finish_reason == "length" and again.num_cached_tokens == 0


@pytest.mark.parametrize("device_error", [False, True], ids=["steps-keep-failing", "device-error"])
def test_an_engine_whose_steps_keep_failing_is_broken_and_refuses_work(qwen3_dir, monkeypatch, device_error):
    engine = LLMEngine(qwen3_dir, num_kv_blocks=64, block_size=16)
    error = torch.AcceleratorError("CUDA error: device-side assert triggered") if device_error else None

    def always_fails(*args):
        raise error or RuntimeError("injected device fault")

    async def main():
        runner = AsyncLLMEngine(engine)
        monkeypatch.setattr(engine.runner, "_forward_layout", always_fails)
        assert runner.health() is None
        outcomes = []
        for i in range(BROKEN_AFTER_FAILED_STEPS + 1):
            try:
                async for _ in runner.generate(PROMPTS[0], PARAMS[0], f"r{i}"):
                    pass
                outcomes.append("ok")
            except EngineDeadError as exc:
                outcomes.append(str(exc))
        runner.shutdown()
        return outcomes, runner.health()

    outcomes, health = asyncio.run(main())
    steps = 1 if device_error else BROKEN_AFTER_FAILED_STEPS
    assert all(o.startswith("engine step failed") for o in outcomes[:steps])
    assert all(o.startswith("engine broken") for o in outcomes[steps:])  # refused at once
    assert engine.broken and health.startswith("engine broken")
    assert ("device error" in engine.broken) == device_error


def test_a_request_failure_reaches_the_async_caller_as_its_own(engine, monkeypatch):
    real_adjust = sampler_module.row_adjustments
    monkeypatch.setattr(
        sampler_module,
        "row_adjustments",
        lambda r, *args: (
            (_ for _ in ()).throw(RuntimeError("boom"))
            if r.params.logit_bias == MARKER_BIAS
            else real_adjust(r, *args)
        ),
    )

    async def main():
        runner = AsyncLLMEngine(engine)

        async def run(prompt, params, rid):
            try:
                return [out async for out in runner.generate(prompt, params, rid)][-1].finish_reason
            except RequestFailed as exc:
                return f"failed: {exc}"

        results = await asyncio.gather(
            run(PROMPTS[0], faulty(), "bad"),
            *(run(p, s, f"ok{i}") for i, (p, s) in enumerate(zip(PROMPTS, PARAMS, strict=True))),
        )
        health = runner.health()
        runner.shutdown()
        return results, health

    results, health = asyncio.run(main())
    assert results[0] == "failed: sampling failed: boom"
    assert results[1:] == ["length"] * 3 and health is None


@pytest.mark.slow  # waits out a stall timeout
def test_a_stalled_step_loop_is_unhealthy_until_it_turns_again(engine):
    async def main():
        runner = AsyncLLMEngine(engine, stall_s=0.3)
        step = engine.step

        def slow_step():
            time.sleep(1.0)
            return step()

        engine.step = slow_step
        stream = runner.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        first = asyncio.create_task(anext(stream))
        await asyncio.sleep(0.6)
        during = runner.health()
        await first
        engine.step = step
        async for _ in stream:
            pass
        await asyncio.sleep(0.05)
        after = runner.health()
        idle_later = (await asyncio.sleep(0.4), runner.health())[1]  # idle for longer than stall_s: fine
        runner.shutdown()
        return during, after, idle_later

    during, after, idle_later = asyncio.run(main())
    assert during and "stalled" in during
    assert after is None and idle_later is None
