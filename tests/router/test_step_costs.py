"""A replica's own step costs, fitted online: the fit recovers known costs through noise and
outliers, follows a replica that slows down, never goes negative, and a real engine whose
every step does twice the work reports about twice the costs."""

import asyncio
import random
from dataclasses import astuple

import numpy as np
import pytest
from reference import prompts_of_lengths

from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.engine.step_costs import RestoreCostFit, StepCostFit
from kvmesh.serving.sampling_params import SamplingParams
from kvmesh.serving.step_costs import (
    MAX_RESTORE_BLOCK_S,
    MEASURED_AFTER_STEPS,
    PRIOR,
    TERMS,
    StepCosts,
    measured_restore,
    median_costs,
)

TRUE = (0.004, 2e-5, 1e-4, 2e-7)


def synthetic_steps(n: int, costs=TRUE, seed: int = 0, outliers: float = 0.0):
    rng = random.Random(seed)
    for _ in range(n):
        prefill = rng.choice([0, 0, 0, rng.randint(16, 2048)])
        decode, context = rng.randint(1, 64), rng.randint(0, 60_000)
        seconds = (costs[0] + costs[1] * prefill + costs[2] * decode + costs[3] * context) * rng.uniform(
            0.95, 1.05
        )
        if rng.random() < outliers:
            seconds *= 20  # a GC pause, a first compile
        yield prefill, decode, context, seconds


def test_the_prior_until_the_first_step_then_the_measured_costs():
    fit = StepCostFit()
    assert astuple(fit.costs()) == pytest.approx(astuple(PRIOR))
    for step in synthetic_steps(3000):
        fit.observe(*step)
    for term, true in zip(TERMS, TRUE, strict=True):
        assert getattr(fit.costs(), term) == pytest.approx(true, rel=0.1), term


def test_outliers_move_the_fit_little():
    fit = StepCostFit()
    for step in synthetic_steps(3000, outliers=0.02):
        fit.observe(*step)
    assert fit.predict(512, 16, 20_000) == pytest.approx(
        TRUE[0] + TRUE[1] * 512 + TRUE[2] * 16 + TRUE[3] * 20_000, rel=0.15
    )
    clean = StepCostFit()
    for step in synthetic_steps(3000):
        clean.observe(*step)
    assert fit.typical_step_s() == pytest.approx(clean.typical_step_s(), rel=0.1)


def test_a_replica_that_slows_down_is_followed_within_a_few_half_lives():
    fit = StepCostFit(half_life_steps=200)
    for step in synthetic_steps(1000):
        fit.observe(*step)
    before = fit.predict(512, 16, 20_000)
    for step in synthetic_steps(1500, costs=tuple(2 * c for c in TRUE), seed=1):
        fit.observe(*step)
    assert fit.predict(512, 16, 20_000) / before == pytest.approx(2.0, rel=0.1)


def test_costs_are_never_negative_and_empty_steps_say_nothing():
    fit = StepCostFit()
    for i in range(200):  # steps whose time falls as the batch grows: a negative slope, clipped
        fit.observe(0, 1 + i % 50, 0, 0.01 - 0.0001 * (i % 50))
    assert all(value >= 0 for value in astuple(fit.costs()))
    steps = fit.steps
    fit.observe(0, 0, 0, 1.0)
    fit.observe(10, 0, 10, float("nan"))
    assert fit.steps == steps


def test_a_term_held_at_zero_leaves_the_others_fitted_without_it():
    # steps whose straight-line fit has a negative base: base is held at 0 and the slope is
    # the best through the origin, not the (steeper) slope of the negative-base line
    fit = StepCostFit(half_life_steps=float("inf"))
    prefills = [128, 512, 1024, 2000] * 50
    for prefill in prefills:
        fit.observe(prefill, 0, prefill, 1e-4 * prefill - 0.01)
    costs = fit.costs()
    assert costs.base_s == 0
    x = np.array(prefills, dtype=float)
    y = 1e-4 * x - 0.01
    through_origin = float(x @ y / (x @ x))  # context rides along (the same column): split between them
    assert costs.prefill_token_s + costs.context_token_s == pytest.approx(through_origin, rel=0.01)


def _serve(engine: LLMEngine, salt: int) -> None:
    for prompt in prompts_of_lengths([64, 96, 128, 48], salt=salt):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    while engine.requests:
        engine.step()


class SteppingClock:
    """A clock that advances ``step_s`` between a step's two readings: a device whose every
    step takes exactly that long, whatever this machine's load."""

    def __init__(self, step_s: float):
        self.now, self.step_s, self.reading = 0.0, step_s, 0

    def __call__(self) -> float:
        self.reading += 1
        if self.reading % 2 == 0:
            self.now += self.step_s
        return self.now


def test_an_engine_whose_steps_take_twice_as_long_reports_twice_the_cost(qwen3_dir):
    fast = LLMEngine(qwen3_dir, num_kv_blocks=128, block_size=16, max_num_seqs=8)
    slow = LLMEngine(qwen3_dir, num_kv_blocks=128, block_size=16, max_num_seqs=8)
    fast.clock, slow.clock = SteppingClock(0.005), SteppingClock(0.010)
    for engine in (fast, slow):
        _serve(engine, salt=0)
        assert engine.stats().step_costs != PRIOR  # measured, not the prior
    assert fast.step_costs.typical_step_s() == pytest.approx(0.005, rel=0.05)
    assert slow.step_costs.typical_step_s() / fast.step_costs.typical_step_s() == pytest.approx(2.0, rel=0.05)


@pytest.mark.servers
@pytest.mark.asyncio
async def test_a_replica_publishes_its_costs_in_heartbeats_status_and_metrics(qwen3_dir, valkey_server):
    import grpc
    import httpx

    from kvmesh.cli import status
    from kvmesh.engine.config import EngineConfig
    from kvmesh.protos import pb, pb_grpc
    from kvmesh.replica.config import ReplicaConfig
    from kvmesh.replica.process import ReplicaServer
    from kvmesh.serving.metrics import read_samples

    replica = ReplicaServer(
        ReplicaConfig(
            str(qwen3_dir),
            "costs-0",
            valkey_server.url,
            deployment="costs",
            heartbeat_s=0.2,
            engine=EngineConfig(num_kv_blocks=64),
        )
    )
    await replica.start()
    try:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=list(range(5, 60))), sampling=pb.SamplingParams(max_tokens=8)
        )
        async with grpc.aio.insecure_channel(replica.address) as channel:
            [r async for r in pb_grpc.ReplicaStub(channel).Generate(request, timeout=60)]
        measured = replica.engine.stats().step_costs
        assert measured != PRIOR
        await asyncio.sleep(0.6)  # a heartbeat or two
        (model,) = [m for m in await status.from_index(valkey_server.url) if m["deployment"] == "costs"]
        (row,) = model["replicas"]
        assert row["step_costs"]["base_s"] == pytest.approx(measured.base_s, rel=0.2)
        assert "step cost" in status.render([model])
        async with httpx.AsyncClient() as http:
            samples = read_samples((await http.get(f"{replica.http_address}/metrics")).text)
        (base,) = [
            v
            for (name, labels), v in samples.items()
            if name == "kvmesh_replica_step_cost_seconds" and ("term", "base") in labels
        ]
        assert base == pytest.approx(replica.engine.stats().step_costs.base_s, rel=0.5)
    finally:
        await replica.stop(grace=0.2)


def test_the_median_of_peers_and_the_prior_when_nobody_measured():
    a, b, c = StepCosts(1, 2, 3, 4), StepCosts(3, 1, 5, 0), StepCosts(2, 9, 4, 1)
    assert median_costs([a, b, c]) == StepCosts(2, 2, 4, 1)
    assert median_costs([]) == PRIOR


def published(costs: StepCosts) -> StepCosts:
    """What a router reads back of ``costs`` sent in a heartbeat (4 significant digits)."""
    return StepCosts.from_fields(lambda name, default: float(costs.as_fields().get(name, default)))


@pytest.mark.asyncio
async def test_the_router_prices_like_hardware_alike_and_other_hardware_by_its_own_fit():
    """A replica just started reports the prior pulled toward a few warm-up steps: the router
    prices it like the replicas that have measured (else a fleet of slow CPUs would send all
    work to the newcomer whose prior says H100); one on the same hardware whose fit differs
    (noise, or 9x off) at their median too; one on other hardware at its own fit."""
    from kvmesh.kvcache.index.memory import MemoryPrefixIndex
    from kvmesh.router.policies import DEFAULT_STEP_TOKENS
    from kvmesh.router.registry import ReplicaRegistry

    index = MemoryPrefixIndex()
    slow = StepCosts(0.05, 4e-4, 1e-3, 1e-6)
    fast = StepCosts(*(c / 9 for c in astuple(slow)))
    for rid, costs, steps, budget, hardware in (
        ("old-0", slow, 500, 512, "cpu"),
        ("old-1", slow, 900, -5, "cpu"),  # a record is never trusted to be sane
        ("new", PRIOR, MEASURED_AFTER_STEPS - 1, 4096, "cpu"),
        ("near", StepCosts(*(1.1 * c for c in astuple(slow))), 700, 2048, "cpu"),  # noise
        ("odd", fast, 10**6, 2048, "cpu"),  # 9x off, on the same hardware: a bad fit
        ("gpu", fast, 10**6, 2048, "NVIDIA H100"),
    ):
        fields = {
            **costs.as_fields(),
            "cost_steps": steps,
            "max_num_batched_tokens": budget,
            "hardware": hardware,
        }
        await index.register(rid, f"127.0.0.1:{len(rid)}", 10.0, fields)
    registry = ReplicaRegistry(index)
    try:
        await registry.refresh()
        states = {s.replica_id: s for s in registry.states({})}
        like = {states[r].costs for r in ("old-0", "old-1", "new", "near", "odd")}
        assert like == {published(slow)}
        assert [states[r].step_tokens for r in ("old-0", "old-1", "new")] == [512, DEFAULT_STEP_TOKENS, 4096]
        gpu = states["gpu"].costs.prefill_token_s / published(slow).prefill_token_s
        assert gpu == pytest.approx(1 / 9, rel=0.01)
    finally:
        await registry.stop()


def test_a_restores_cost_per_block_follows_the_recent_restores():
    fit = RestoreCostFit(half_life=4)
    assert fit.block_seconds() is None
    fit.observe(10, 0.010)  # 1 ms a block
    assert fit.block_seconds() == pytest.approx(0.001)
    for _ in range(40):  # the link slows to 5 ms a block: the fit follows within a few dozen
        fit.observe(2, 0.010)
    assert fit.block_seconds() == pytest.approx(0.005, rel=0.01) and fit.blocks == 90
    fit.observe(0, 1.0)
    fit.observe(3, float("nan"))
    assert fit.block_seconds() == pytest.approx(0.005, rel=0.01)  # nothing measured: nothing moves


def test_a_record_prices_restores_once_measured_and_bounded():
    def record(**fields):
        return lambda name, default: float(fields.get(name, default))

    assert measured_restore(record(cost_restore_block_s=0.002, cost_restore_blocks=8)) is None  # too few
    assert measured_restore(record(cost_restore_block_s=0.002, cost_restore_blocks=64)) == 0.002
    assert measured_restore(record(cost_restore_block_s=1e9, cost_restore_blocks=64)) == MAX_RESTORE_BLOCK_S
    assert measured_restore(record(cost_restore_blocks=64)) is None
