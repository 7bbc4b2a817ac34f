"""``kvmesh bench pileup``: does a policy pile prompts nobody holds on one replica when the
fleet's replicas differ or their fits are noisy? (issue 49, in the simulator)

The peers bench's shared-prefix cell in rounds of 8 new prefixes, 5 s apart, arriving in bursts
as a load generator's Poisson run reaches a server, on 4 simulated CPU replicas of the demo
model whose pools hold a few prefixes each; one seed a run. Fleets: like replicas, three speeds
(1x, 1.3x, 2x), fits off by up to 30% either way, and speeds that drift. Contenders: ``prefix``;
``prefix`` without spill or share alarm (two of the protections issue 49 added); ``prefix`` as
it priced before issue 49, each replica's recompute term at its own fit, unbounded and
unsmoothed (the cause a noisy fit tipped); the simple baselines ``least_loaded`` (spread),
``round_robin`` and ``consistent_hash`` (stickiness).

Targets, ``prefix`` on every fleet and rate: in no 10 s window one replica takes more than twice
its fair share of cold prompts; no share alarm; noisy fits cost less than 0.01 of the hit rate
like fits give.
"""

from __future__ import annotations

import statistics

from kvmesh.bench.experiments.cost_model import CPU_TINY_QWEN3
from kvmesh.bench.experiments.simulator import Simulation
from kvmesh.bench.measure import workloads as wl
from kvmesh.bench.measure.common import environment, over_repeats, progress, target, write_result
from kvmesh.router.config import BalanceConfig
from kvmesh.router.policies import Policy, PrefixAware, ReplicaState, RouteRequest

FLEETS = {
    "like": {},
    "speeds": {"speeds": (1, 1.3, 2)},  # replica i runs at 1x, 1.3x, 2x, 1x the cost model's time
    "noisy": {"fit_noise": 0.3},  # what the router sees of each replica is off by up to 30%
    "drifting": {"drift": 0.5},  # speeds wander (log speed, per square root of a minute)
}
# Issue 49's protections off: a prompt's holder keeps it however deep its queue, no alarm.
UNPROTECTED = BalanceConfig(saturation_steps=1e12, share_alarm_min_per_replica=10**9)


class OwnFitPrice(PrefixAware):
    """``prefix`` with each replica's recompute term at its own fitted price (before issue 49:
    a replica whose fit reads cheap for a moment looks cheaper to recompute on)."""

    def score(self, request: RouteRequest, r: ReplicaState, fleet_prefill_s: float) -> float:
        return super().score(request, r, r.costs.prefill_token_s)


# With OwnFitPrice: fits as measured, neither clamped nor smoothed.
RAW_FITS = BalanceConfig(price_spread=20, price_half_life_s=0.001)
CONTENDERS = {
    "prefix": ("prefix", None),
    "prefix, no spill or alarm": ("prefix", UNPROTECTED),
    "prefix at own fit (before)": (OwnFitPrice, RAW_FITS),
    "least_loaded": ("least_loaded", None),
    "round_robin": ("round_robin", None),
    "consistent_hash": ("consistent_hash", None),
}
METRICS = ("cold_share_max_over_fair", "requests_max_over_mean", "hit_rate", "ttft_p90_ms", "share_alarms")
COLD_SHARE_BOUND = 2.0


def rounds_at(rate: float, seed: int, rounds: int = 4) -> list[wl.WorkloadRequest]:
    """``rounds`` rounds of 8 new prefixes x 15 requests at ``rate``, in bursts, 5 s apart."""
    return wl.new_prefix_rounds(rounds, rate, lambda k: 1000 * seed + k, wl.bursty_arrivals)


def simulate(
    requests: list[wl.WorkloadRequest],
    fleet: str = "like",
    policy: str | Policy = "prefix",
    balance: BalanceConfig | None = None,
    seed: int = 0,
) -> dict:
    """The simulator's summary of ``requests`` on 4 replicas of ``fleet``."""
    return Simulation(
        requests,
        4,
        policy,
        CPU_TINY_QWEN3,
        block_size=16,
        blocks_per_replica=160,
        seed=seed,
        balance=balance,
        **FLEETS[fleet],
    ).run()


def one_run(fleet: str, contender: str, rate: float, seed: int, rounds: int) -> dict:
    policy, balance = CONTENDERS[contender]
    if not isinstance(policy, str):
        policy = policy(block_size=16)
    summary = simulate(rounds_at(rate, seed, rounds), fleet, policy, balance, seed)
    return {
        "fleet": fleet,
        "contender": contender,
        "rate": rate,
        "seed": seed,
        "cold_share_max_over_fair": summary["cold_share_max_over_fair"],
        "requests_max_over_mean": summary["requests_max_over_mean"],
        "hit_rate": summary["hit_rate"],
        "ttft_p90_ms": round(summary["ttft_p90"] * 1e3, 2),
        "share_alarms": summary["share_alarms"],
    }


def main(out: str, seeds: int, rates: tuple[float, ...], rounds: int = 4) -> int:
    rows = []
    for fleet in FLEETS:
        for rate in rates:
            for contender in CONTENDERS:
                cell = [one_run(fleet, contender, rate, seed, rounds) for seed in range(seeds)]
                rows += cell
                worst = max(r["cold_share_max_over_fair"] for r in cell)
                progress(f"{fleet}, {rate:g}/s, {contender}: worst cold share {worst:.2f}x fair")
    summary = over_repeats(rows, ("fleet", "rate", "contender"), METRICS)
    for s in summary:
        cell = [
            r
            for r in rows
            if (r["fleet"], r["rate"], r["contender"]) == (s["fleet"], s["rate"], s["contender"])
        ]
        s["hit_rate_mean"] = round(statistics.mean(r["hit_rate"] for r in cell), 4)
        s["runs_over_bound"] = sum(r["cold_share_max_over_fair"] > COLD_SHARE_BOUND for r in cell)
        s["share_alarms_total"] = sum(r["share_alarms"] for r in cell)
    result = {
        "benchmark": "pileup",
        "config": {
            "replicas": 4,
            "cost_model": CPU_TINY_QWEN3.name,
            "workload": f"{rounds} rounds of 8 new prefixes x 15 questions, bursty arrivals",
            "fleets": {
                name: {k: list(v) if isinstance(v, tuple) else v for k, v in f.items()}
                for name, f in FLEETS.items()
            },
            "rates": list(rates),
            "seeds": seeds,
        },
        "summary": summary,
        "rows": rows,
        "targets": targets(summary, rates),
        "environment": environment(),
    }
    print(
        f"\n{'fleet':<10}{'rate':>5}  {'contender':<28}{'cold max':>9}{'>2x':>5}{'req max':>8}{'hit':>8}{'p90 ms':>8}{'alarms':>7}"
    )
    for s in summary:
        print(
            f"{s['fleet']:<10}{s['rate']:>5g}  {s['contender']:<28}{s['cold_share_max_over_fair_max']:>9.2f}"
            f"{s['runs_over_bound']:>5}{s['requests_max_over_mean_max']:>8.2f}{s['hit_rate_mean']:>8.4f}"
            f"{s['ttft_p90_ms_median']:>8.1f}{s['share_alarms_total']:>7}"
        )
    write_result(out, result)
    return 0


def targets(summary: list[dict], rates: tuple[float, ...]) -> list[dict]:
    cell = {(s["fleet"], s["rate"], s["contender"]): s for s in summary}
    out = []
    for fleet in FLEETS:
        for rate in rates:
            s = cell[fleet, rate, "prefix"]
            out.append(
                target(
                    f"{fleet} at {rate:g}/s: worst cold share / fair share, prefix",
                    s["cold_share_max_over_fair_max"],
                    "<=",
                    COLD_SHARE_BOUND,
                    f"least_loaded: {cell[fleet, rate, 'least_loaded']['cold_share_max_over_fair_max']:.2f}",
                )
            )
    alarms = sum(cell[fleet, rate, "prefix"]["share_alarms_total"] for fleet in FLEETS for rate in rates)
    out.append(target("share alarms, prefix, every fleet and rate", alarms, "<=", 0))
    for rate in rates:
        like, noisy = cell["like", rate, "prefix"], cell["noisy", rate, "prefix"]
        out.append(
            target(
                f"at {rate:g}/s: hit rate lost to noisy fits, prefix",
                round(like["hit_rate_mean"] - noisy["hit_rate_mean"], 4),
                "<=",
                0.01,
            )
        )
    return out
