"""Issue 49 in the simulator: routing that never piles cold prompts on one replica, on fleets
of other speeds and with noisy fits, through the router's own pricing and share alarm.

The load is the peers sweep's shared-prefix shape (8 prefixes of 512 tokens x 15 questions of
64, 16 tokens out) on 4 CPU-like replicas whose pools hold a few prefixes each, in rounds of
new prefixes (each round's 8 first requests are cold prompts), arriving in bursts as a load
generator's Poisson run reaches a server.
"""

from __future__ import annotations

import functools
import statistics

import pytest
from helpers import cpu_like_costs, peer_rounds

from kvmesh.cluster.experiments.cost_model import MAX_DRIFT, FleetHardware
from kvmesh.cluster.experiments.simulator import ColdShares, Simulation
from kvmesh.cluster.measure import workloads as wl
from kvmesh.router.config import BalanceConfig
from kvmesh.router.policies import Policy, PrefixAware

CPU = cpu_like_costs()
RATES = (5.0, 6.0)
SEEDS = range(20)
FLEETS = {"like": {}, "heterogeneous": {"speeds": (1, 1.3, 2)}, "noisy": {"fit_noise": 0.3}}
# What the router did before issue 49 as far as one price goes: no spill, no share alarm.
BEFORE = BalanceConfig(saturation_steps=1e12, share_alarm_min_requests=10**9)


def rounds_at(rate: float, seed: int) -> list[wl.WorkloadRequest]:
    """4 rounds of 8 new prefixes x 15 requests at ``rate`` (bursty), 5 s apart."""
    return peer_rounds(4, rate, lambda k: 1000 * seed + k, wl.bursty_arrivals)


def simulate(
    requests: list[wl.WorkloadRequest],
    fleet: str = "like",
    policy: str | Policy = "prefix",
    balance: BalanceConfig | None = None,
    seed: int = 0,
) -> dict:
    sim = Simulation(
        requests,
        4,
        policy,
        CPU,
        block_size=16,
        blocks_per_replica=160,
        seed=seed,
        balance=balance,
        **FLEETS[fleet],
    )
    return sim.run()


@functools.cache
def sweep(fleet: str, rate: float, balance: BalanceConfig | None = None) -> tuple[dict, ...]:
    """Every seed's summary on ``fleet`` at ``rate`` (shared by the tests in one process)."""
    return tuple(simulate(rounds_at(rate, seed), fleet, balance=balance, seed=seed) for seed in SEEDS)


FLEET_CASES = [pytest.param(fleet, rate, id=f"{fleet}-{rate:g}") for fleet in FLEETS for rate in RATES]


@pytest.mark.parametrize("fleet, rate", FLEET_CASES)
def test_no_replica_takes_over_twice_its_fair_share_of_cold_prompts(fleet, rate):
    """Issue 49's done-when, every seed: in no 10 s window does one replica take more than
    twice its fair share of the prompts nobody held."""
    worst = [s["cold_share_max_over_fair"] for s in sweep(fleet, rate)]
    assert max(worst) <= 2.0, worst


@pytest.mark.parametrize("rate", RATES)
def test_noisy_fits_on_like_hardware_keep_requests_even(rate):
    assert max(s["requests_max_over_mean"] for s in sweep("noisy", rate)) <= 1.6


@pytest.mark.parametrize("rate", RATES)
def test_the_cold_share_check_catches_a_pile_up(rate):
    """The check can fail: the recompute term at each replica's own price (issue 49's cause),
    fits unbounded and unsmoothed, piles cold prompts up in a quarter of the seeds at least.
    (A wide spread alone does not: smoothing and confidence keep noisy prices within a few %.)"""

    class OwnPrice(PrefixAware):
        def score(self, request, r, fleet_prefill_s):
            return super().score(request, r, r.costs.prefill_token_s)

    loose = BalanceConfig(price_spread=20, price_half_life_s=0.001)
    worst = [
        simulate(rounds_at(rate, seed), "noisy", OwnPrice(block_size=16), loose, seed)[
            "cold_share_max_over_fair"
        ]
        for seed in SEEDS
    ]
    assert sum(w > 2.0 for w in worst) >= 5, worst


@pytest.mark.parametrize("fleet, rate", FLEET_CASES)
def test_the_share_alarm_stays_off_in_normal_runs(fleet, rate):
    assert [s["share_alarms"] for s in sweep(fleet, rate)] == [0] * len(SEEDS)


def test_the_share_alarm_turns_on_for_a_pile_up():
    """One shared prefix hashed to one replica takes every request: the alarm turns on (round
    robin, the same load spread evenly: never)."""
    one = wl.poisson_arrivals(
        wl.shared_prefix(
            num_groups=1, prompts_per_group=60, system_prompt_len=512, question_len=64, output_len=16
        ),
        5.0,
        seed=1,
    )
    piled, even = simulate(one, policy="consistent_hash"), simulate(one, policy="round_robin")
    assert piled["requests_max_over_mean"] == 4.0 and piled["share_alarms"] >= 1
    assert even["share_alarms"] == 0


@pytest.mark.parametrize("rate", RATES)
def test_like_hardware_keeps_its_hit_rate(rate):
    """Priced alike, the protections change nothing where nothing piles up: every seed's hit
    rate is the one without spill or share alarm; noisy fits cost less than 0.01 of it."""
    now, before = sweep("like", rate), sweep("like", rate, BEFORE)
    assert [s["hit_rate"] for s in now] == [s["hit_rate"] for s in before]
    like = statistics.mean(s["hit_rate"] for s in now)
    assert abs(statistics.mean(s["hit_rate"] for s in sweep("noisy", rate)) - like) < 0.01


def test_a_fleet_of_other_speeds_runs_and_is_priced_by_speed():
    """A replica twice as slow takes twice as long, and the router's prices come to order the
    replicas by speed (like speeds alike); one cost model keeps the load order."""
    one = [wl.WorkloadRequest(((1, 256),), 8)]
    took = {}
    for speeds in (None, (2,)):
        alone = Simulation(one, 1, "prefix", CPU, block_size=16, speeds=speeds)
        alone.run()
        took[speeds] = alone.results["done_s"][0]
    assert took[2,] == pytest.approx(2 * took[None])
    prices = priced_after_a_run((1, 1.3, 2))
    assert prices[0] == pytest.approx(prices[3], rel=0.01) and prices[3] < prices[1] < prices[2]
    plain = Simulation(one, 2, "prefix", CPU, block_size=16)
    assert plain.hardware is None and plain.routers[0].order is not None


@pytest.mark.parametrize("speeds", [(1, 1.3, 2), (1,)])
def test_like_hardware_is_priced_exactly_alike(speeds):
    """What the policy's exact order needs (price spread 1): any difference, however small,
    decides every tie between idle replicas."""
    prices = priced_after_a_run(speeds, fit_noise=0.3)
    assert prices[0] == prices[3]


def priced_after_a_run(speeds: tuple[float, ...], fit_noise: float = 0.0) -> list[float]:
    """What the router prices a prompt token at on each of 4 replicas after 4 rounds."""
    sim = Simulation(
        rounds_at(5.0, 0),
        4,
        "prefix",
        CPU,
        block_size=16,
        blocks_per_replica=160,
        speeds=speeds,
        fit_noise=fit_noise,
    )
    sim.run()
    assert sim.routers[0].order is None  # priced per replica: every decision ranks every replica
    return [p.prefill_token_s for p in sim.priced]


def test_fleet_hardware_noise_and_drift_stay_in_bounds():
    hardware = FleetHardware(CPU, 5, speeds=(1, 2), fit_noise=0.3, drift=5.0, seed=1)
    assert hardware.speeds == [1, 2, 1, 2, 1] and hardware.hardware(1) == "2x"
    seen = set()
    for t in range(1, 200):
        hardware.tick(t * 10.0)
        for r, own in enumerate(hardware.speeds):
            speed = hardware.true[r].base_s / CPU.base_s
            assert own / MAX_DRIFT - 1e-9 <= speed <= own * MAX_DRIFT + 1e-9
            noise = hardware.fits[r].prefill_token_s / hardware.true[r].prefill_token_s
            assert 0.7 - 1e-9 <= noise <= 1.3 + 1e-9
            seen.add(round(speed, 1))
    assert len(seen) > 10  # it wanders
    steady = FleetHardware(CPU, 2, speeds=(1.5,))
    steady.tick(60.0)
    assert steady.fits == steady.true and steady.true[0].base_s == pytest.approx(1.5 * CPU.base_s)
    for bad in ({"speeds": (0,)}, {"fit_noise": 1.0}, {"drift": -1.0}):
        with pytest.raises(ValueError):
            FleetHardware(CPU, 2, **bad)


def test_cold_shares_judge_windows_of_enough_cold_prompts():
    cold = ColdShares(4, window_s=10.0)
    for k in range(7):  # 7 on one replica: too few to judge
        cold.add(0, k * 0.1)
    assert cold.worst() == 0.0
    for r in (0, 1, 2, 3, 0, 1, 2, 3, 0):  # window 1: 9, three on replica 0
        cold.add(r, 10.5)
    assert cold.worst() == pytest.approx(3 / (9 / 4))
    for _ in range(8):  # a later, even window keeps the worst
        for r in range(4):
            cold.add(r, 25.0)
    assert cold.worst() == pytest.approx(3 / (9 / 4))
