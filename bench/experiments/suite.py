"""``kvmesh experiments``: the whole experiment suite, regenerating ``docs/experiments.md``.

W1 Mooncake trace (1x, 2x) on 8/16/32 replicas; W2 shared prefix (SGLang defaults) on 8;
W3 cache pressure over a QPS sweep; W4 no-sharing control; W5 Zipf hot spot. Every policy,
in the simulator (H100-class cost model); then a scaled-down real cluster (CPU replicas,
tiny model) on a shared-prefix workload. Targets are checked against the same run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bench.experiments.cost_model import H100_LLAMA3_8B, LLAMA3_8B_KV_BYTES_PER_TOKEN, CostModel
from kvmesh.bench.experiments.fidelity import SECTION as FIDELITY_SECTION
from kvmesh.bench.experiments.sim_many_routers import SECTION as ROUTERS_SECTION
from kvmesh.bench.experiments.simulator import Simulation
from kvmesh.bench.measure import workloads as wl
from kvmesh.bench.measure.common import over_repeats, target
from kvmesh.bench.measure.report import PEERS_SECTION, marked_section, plot_sweep
from kvmesh.router.policies import POLICIES, PrefixAware

ALL_POLICIES = list(POLICIES)  # every policy the router has, in its registration order
BLOCK = 256


@dataclass
class Scale:
    """Full size, or --quick (a smoke run of the same suite)."""

    quick: bool

    def n(self, full: int, quick: int) -> int:
        return quick if self.quick else full


def _simulate(requests, replicas: int, cost: CostModel, policies=ALL_POLICIES, log=print) -> dict:
    out = {"hit_rate_ceiling": round(wl.infinite_cache_hit_rate(requests, BLOCK), 4), "policies": {}}
    for policy in policies:
        start = time.monotonic()
        out["policies"][policy] = Simulation(requests, replicas, policy, cost, block_size=BLOCK).run()
        log(
            f"    {policy:<16} {time.monotonic() - start:5.1f}s  hit {out['policies'][policy]['hit_rate']:.3f}"
        )
    return out


# W1 1x on 8 replicas with a host tier 3x each replica's device pool, copies over a 25 GB/s link
# (a PCIe Gen4 x16 link's practical rate), against free copies and against no host tier.
HOST_TIER_FACTOR = 3
HOST_LINK_BYTES_PER_S = 25e9


def host_tiers(requests: list, cost: CostModel, log=print) -> dict:
    """The prefix policy on W1 1x/8 with and without host tiers, restores priced and free."""
    device_blocks = cost.kv_tokens_per_replica // BLOCK
    priced = dataclasses.replace(cost, restore_token_s=LLAMA3_8B_KV_BYTES_PER_TOKEN / HOST_LINK_BYTES_PER_S)
    cells = {
        "device only": (cost, 0),
        f"host {HOST_TIER_FACTOR}x, {HOST_LINK_BYTES_PER_S / 1e9:g} GB/s": (
            priced,
            HOST_TIER_FACTOR * device_blocks,
        ),
        f"host {HOST_TIER_FACTOR}x, free copies": (
            dataclasses.replace(cost, restore_token_s=0.0),
            HOST_TIER_FACTOR * device_blocks,
        ),
    }
    out = {"device_blocks": device_blocks, "cells": {}}
    for name, (model, host_blocks) in cells.items():
        log(f"W1 1x/8 prefix, {name}")
        run = Simulation(
            requests, 8, "prefix", model, block_size=BLOCK, host_blocks_per_replica=host_blocks
        ).run()
        out["cells"][name] = {
            "host_blocks_per_replica": host_blocks,
            "restore_token_s": model.restore_token_s,
            **run,
        }
    return out


RECOMPUTE_WEIGHTS = (0.0, 1.0, 3.0, 15.0, 31.0)  # the prefix policy's one weight, swept


def pricing_sweep(cells: dict[str, tuple[list, int]], cost: CostModel, log=print) -> dict:
    """The prefix policy at each recompute weight on a few cells: the evidence for the default."""
    out: dict = {}
    for cell, (requests, replicas) in cells.items():
        log(f"pricing: {cell}")
        for weight in RECOMPUTE_WEIGHTS:
            policy = PrefixAware(block_size=BLOCK, recompute_weight=weight)
            s = Simulation(requests, replicas, policy, cost, block_size=BLOCK).run()
            out.setdefault(cell, {})[f"{weight:g}"] = {k: s[k] for k in ("hit_rate", "ttft_p50", "ttft_p90")}
    return out


def run_simulations(scale: Scale, cost: CostModel = H100_LLAMA3_8B, log=print) -> dict:
    results: dict = {"cost_model": cost.as_dict()}
    trace = wl.mooncake(limit=scale.n(10**9, 600))
    results["W1"] = {}
    pricing_cells = {}
    for speedup in (1, 2):
        requests = wl.mooncake(limit=len(trace), speedup=speedup)
        for replicas in (8, 16, 32) if not scale.quick else (8,):
            log(f"W1 mooncake {speedup}x on {replicas} replicas")
            results["W1"][f"{speedup}x/{replicas}"] = _simulate(requests, replicas, cost, log=log)
        pricing_cells[f"W1 {speedup}x/8"] = (requests, 8)

    w2_rate = 200.0
    log(f"W2 shared prefix (64x16, 2048+128, out 256) on 8 replicas at {w2_rate}/s")
    w2 = wl.shared_prefix(num_groups=scale.n(64, 16), prompts_per_group=16)
    pricing_cells["W2"] = (wl.poisson_arrivals(w2, w2_rate, seed=2), 8)
    results["W2"] = {"rate": w2_rate, **_simulate(pricing_cells["W2"][0], 8, cost, log=log)}

    results["W3"] = {}
    w3 = wl.shared_prefix(
        num_groups=scale.n(150, 40),
        prompts_per_group=5,
        system_prompt_len=6000,
        question_len=1200,
        output_len=256,
    )
    for rate in (5.0, 10.0, 20.0, 40.0) if not scale.quick else (10.0, 40.0):
        log(f"W3 cache pressure (150x5, 6000+1200) on 8 replicas at {rate}/s")
        pricing_cells[f"W3@{rate:g}"] = (wl.poisson_arrivals(w3, rate, seed=3), 8)
        results["W3"][str(rate)] = _simulate(pricing_cells[f"W3@{rate:g}"][0], 8, cost, log=log)

    w4_rate = 60.0
    log(f"W4 no sharing on 8 replicas at {w4_rate}/s")
    w4 = wl.no_sharing(num_requests=scale.n(1024, 256))
    results["W4"] = {"rate": w4_rate, **_simulate(wl.poisson_arrivals(w4, w4_rate, seed=4), 8, cost, log=log)}

    w5_rate = 200.0
    log(f"W5 Zipf(1.1) group popularity on 8 replicas at {w5_rate}/s")
    w5 = wl.shared_prefix(num_groups=scale.n(64, 16), prompts_per_group=16, zipf=1.1)
    pricing_cells["W5"] = (wl.poisson_arrivals(w5, w5_rate, seed=5), 8)
    results["W5"] = {"rate": w5_rate, **_simulate(pricing_cells["W5"][0], 8, cost, log=log)}
    results["tiers"] = host_tiers(wl.mooncake(limit=len(trace)), cost, log)
    keep = ("W1 2x/8", "W2", "W3@40", "W5")
    results["pricing"] = pricing_sweep({k: v for k, v in pricing_cells.items() if k in keep}, cost, log)
    return results


REAL_POLICIES = ("prefix", "round_robin", "least_loaded", "consistent_hash")
# One repeat each; the prefix policy was tuned on other seeds (6, 7). Ten, not three: one
# run's p90 over 96 requests on 2 shared cores moves by 2x between seeds (prefix over
# consistent_hash per seed: 0.4 to 1.7), so three seeds' medians ranked the two by noise.
REAL_SEEDS = tuple(range(11, 21))
_REAL_METRICS = (
    "hit_rate",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "output_tokens_per_s",
    "load_imbalance_max_over_mean",
)


async def run_real_cluster(scale: Scale, cache_dir: Path, log=print, model: Path | None = None) -> dict:
    """The same comparison on real replicas (CPU, tiny model; the demo's unless ``model``):
    does the ordering hold? One run per (policy, seed), in a shuffled order per seed; each
    policy's row is the median over seeds (``runs`` keeps every run)."""
    from kvmesh.bench.measure.demo_model import demo_model
    from kvmesh.bench.measure.loadgen import run_load
    from kvmesh.bench.measure.report import summarize
    from kvmesh.cluster.config import ClusterConfig
    from kvmesh.cluster.launcher import LocalCluster

    model = model or demo_model(cache_dir)
    config = ClusterConfig.for_model(
        str(model), 4, engine={"num_kv_blocks": 512}, router={"port": 0, "http_port": -1}
    )
    runs, ceilings = [], []
    async with LocalCluster(config) as cluster:
        for seed in REAL_SEEDS[: scale.n(len(REAL_SEEDS), 1)]:
            requests = wl.shared_prefix(
                num_groups=scale.n(12, 4),
                prompts_per_group=8,
                system_prompt_len=512,
                question_len=32,
                output_len=16,
                seed=seed,
            )
            requests = wl.poisson_arrivals(requests, 20.0, seed=seed)
            ceilings.append(wl.infinite_cache_hit_rate(requests, 16))
            for policy in random.Random(seed).sample(REAL_POLICIES, len(REAL_POLICIES)):
                await cluster.reset_prefix_caches()
                records = await run_load(
                    cluster.router_address, requests, policy=policy, concurrency=16, use_arrival_times=True
                )
                runs.append({"policy": policy, "seed": seed, **summarize(records)})
                log(f"    real {policy:<16} seed {seed} hit {runs[-1]['hit_rate']:.3f}")
    medians = over_repeats(runs, ("policy",), _REAL_METRICS)
    return {
        "hit_rate_ceiling": round(statistics.median(ceilings), 4),
        "seeds": sorted({r["seed"] for r in runs}),
        "policies": {m["policy"]: {k: m[f"{k}_median"] for k in _REAL_METRICS} for m in medians},
        "runs": runs,
    }


# ---------------------------------------------------------------------- targets and document


def rounded_target(name: str, value: float, op: str, bound: float, detail: str) -> dict:
    """A target whose value is rounded for the document."""
    return {**target(name, value, op, bound, detail), "value": round(value, 3)}


def targets(results: dict) -> list[dict]:
    out = []
    for w in ("W2", *(f"W3@{r}" for r in results["W3"])):
        data = results["W2"] if w == "W2" else results["W3"][w.split("@")[1]]
        p, rr = data["policies"]["prefix"], data["policies"]["round_robin"]
        out.append(
            rounded_target(
                f"{w}: round_robin p90 TTFT / prefix p90 TTFT",
                rr["ttft_p90"] / max(p["ttft_p90"], 1e-9),
                ">=",
                5,
                f"{p['ttft_p90']:.3f}s vs {rr['ttft_p90']:.3f}s",
            )
        )
        out.append(
            rounded_target(
                f"{w}: prefix hit rate / round_robin hit rate",
                p["hit_rate"] / max(rr["hit_rate"], 1e-9),
                ">=",
                3,
                f"{p['hit_rate']:.3f} vs {rr['hit_rate']:.3f}",
            )
        )
    w4 = results["W4"]["policies"]
    p, ll = w4["prefix"], w4["least_loaded"]
    out.append(
        rounded_target(
            "W4: prefix p90 TTFT / least_loaded p90 TTFT",
            p["ttft_p90"] / max(ll["ttft_p90"], 1e-9),
            "<=",
            1.05,
            f"{p['ttft_p90']:.3f}s vs {ll['ttft_p90']:.3f}s",
        )
    )
    out.append(
        rounded_target(
            "W4: least_loaded tok/s / prefix tok/s",
            ll["throughput_tok_s"] / max(p["throughput_tok_s"], 1e-9),
            "<=",
            1.05,
            f"{p['throughput_tok_s']:.0f} vs {ll['throughput_tok_s']:.0f}",
        )
    )
    out.append(
        rounded_target(
            "W5: prefix max/mean load",
            results["W5"]["policies"]["prefix"]["load_imbalance_max_over_mean"],
            "<=",
            1.5,
            "uncached prefill tokens per replica",
        )
    )
    for key, data in results["W1"].items():
        pol = data["policies"]
        best_other = max(v["hit_rate"] for k, v in pol.items() if k != "prefix")
        out.append(
            rounded_target(
                f"W1 {key}: prefix max/mean load",
                pol["prefix"]["load_imbalance_max_over_mean"],
                "<=",
                1.5,
                "",
            )
        )
        out.append(
            rounded_target(
                f"W1 {key}: prefix hit rate - best other",
                pol["prefix"]["hit_rate"] - best_other,
                ">=",
                0.0,
                f"{pol['prefix']['hit_rate']:.3f} vs {best_other:.3f}",
            )
        )
    if results.get("tiers"):
        out += tier_targets(results["tiers"]["cells"])
    if results.get("real"):
        out += real_targets(results["real"])
    return out


def tier_targets(cells: dict) -> list[dict]:
    none, priced, free = cells.values()
    return [
        rounded_target(
            "W1 1x/8 host tier 3x, 25 GB/s: prefix hit rate",
            priced["hit_rate"],
            ">=",
            0.58,
            f"device only {none['hit_rate']:.3f}",
        ),
        rounded_target(
            "W1 1x/8 host tier 3x, 25 GB/s: prefix TTFT p90 (s)",
            priced["ttft_p90"],
            "<=",
            0.85,
            f"device only {none['ttft_p90']:.3f}s, free copies {free['ttft_p90']:.3f}s",
        ),
        rounded_target(
            "W1 1x/8 host tier 3x: hit rate, free copies - 25 GB/s",
            free["hit_rate"] - priced["hit_rate"],
            "<=",
            0.03,
            f"{free['hit_rate']:.3f} vs {priced['hit_rate']:.3f}",
        ),
    ]


def real_targets(real: dict) -> list[dict]:
    """``prefix`` against every other policy on the real cluster, consistent_hash included
    (medians over seeds): hit rate >= the best other's - 0.01, p90 TTFT <= 1.05 x the fastest's."""
    checks = []
    pol = real["policies"]
    others = [k for k in pol if k != "prefix"]
    best = max(others, key=lambda k: pol[k]["hit_rate"])
    fastest = min(others, key=lambda k: pol[k]["ttft_p90_ms"])
    order = " > ".join(sorted(pol, key=lambda k: -pol[k]["hit_rate"]))
    checks.append(
        rounded_target(
            f"real cluster: prefix hit rate - best other ({best})",
            pol["prefix"]["hit_rate"] - pol[best]["hit_rate"],
            ">=",
            -0.01,
            order,
        )
    )
    checks.append(
        rounded_target(
            f"real cluster: prefix p90 TTFT / fastest other ({fastest})",
            pol["prefix"]["ttft_p90_ms"] / pol[fastest]["ttft_p90_ms"],
            "<=",
            1.05,
            f"{pol['prefix']['ttft_p90_ms']} vs {pol[fastest]['ttft_p90_ms']} ms",
        )
    )
    return checks


def per_seed_ratios(runs: list[dict], other: str, metric: str = "ttft_p90_ms") -> list[float]:
    """``prefix``'s ``metric`` over ``other``'s, one ratio per seed both ran (paired: a seed's
    burstiness hits both alike)."""
    by_seed: dict[int, dict[str, float]] = {}
    for run in runs:
        by_seed.setdefault(run["seed"], {})[run["policy"]] = run[metric]
    return [v["prefix"] / v[other] for v in by_seed.values() if "prefix" in v and v.get(other)]


def _spread(values: list[float]) -> str:
    if not values:
        return "no seed ran both"
    return f"median {statistics.median(values):.2f}x, {min(values):.2f}-{max(values):.2f}x over {len(values)} seeds"


def notes(results: dict) -> list[str]:
    """What the numbers mean, computed from this run (so it stays true when regenerated)."""
    w2 = results["W2"]["policies"]
    rr_bound = (16 - 8) / 16 * 2048 / 2176
    ch_w1 = max(
        d["policies"]["consistent_hash"]["load_imbalance_max_over_mean"] for d in results["W1"].values()
    )
    prefix_w1 = max(d["policies"]["prefix"]["load_imbalance_max_over_mean"] for d in results["W1"].values())
    margins = {
        key: d["policies"]["prefix"]["hit_rate"] - d["policies"]["consistent_hash"]["hit_rate"]
        for key, d in results["W1"].items()
    }
    ch_ahead = [key for key, m in margins.items() if m <= 0]
    where = (
        f"ties or edges out `prefix` on hit rate in W1 {', '.join(ch_ahead)}"
        if ch_ahead
        else f"trails `prefix` on hit rate in every W1 cell only by {min(margins.values()):.3f}-{max(margins.values()):.3f}"
    )
    return [
        "## Reading the results",
        "",
        f"- **W2 hit rate ratio.** With 16 prompts per group on 8 replicas, round-robin sends each group to "
        f"every replica about twice, so it reuses roughly (16-8)/16 of the system prompts: about "
        f"{rr_bound:.2f} (it gets {w2['round_robin']['hit_rate']:.3f}) against {results['W2']['hit_rate_ceiling']:.2f} "
        "for any policy. A 3x ratio is out of reach on W2 by construction; it is met on W3 (5 prompts per group, "
        "cache pressure), where round-robin's hit rate collapses.",
        "- **W3 TTFT at low rates.** Below ~30 requests/s nothing queues under any policy, so TTFT is the prefill "
        "time of one request and the ratio is ~1; the 5x target is met once round-robin's recomputed prefixes "
        "saturate the replicas (40 requests/s).",
        f"- **consistent_hash** is the strongest competitor on hit rate: it never moves a prefix, so it {where}, "
        f"but it ignores load: max/mean load up to {ch_w1:.2f} on W1 (prefix: {prefix_w1:.2f}) and longer TTFT "
        "tails under load (W1, W2).",
        "- **W5 max/mean** is mostly where the first prefills of the ~60 rarely requested groups land (2k+ "
        "tokens each), not the hot group: one seed's value moves by up to 0.25 with the sample alone (seeds 0-5 "
        "gave 1.31-1.65 under one policy). The docs' 1.436 became 1.71 when the workload's sampler changed "
        "(Python's `random.choices` to numpy's generator: another sample for seed 0), not through the policy; "
        "compare policies on one sample, not across such changes.",
        "",
    ]


def pricing_section(pricing: dict) -> list[str]:
    """The recompute-weight sweep: hit rate and p90 TTFT of ``prefix`` per weight and cell."""
    weights = [f"{w:g}" for w in RECOMPUTE_WEIGHTS]
    lines = [
        "## Pricing: the recompute weight",
        "",
        "`prefix` scores a replica by its predicted TTFT plus `recompute_weight` x the time its uncached",
        "prefill takes there (router/policies.py). Hit rate / p90 TTFT (s) per weight; 0 is TTFT alone,",
        "15 the default.",
        "",
        "| cell | " + " | ".join(f"w={w}" for w in weights) + " |",
        "|---|" + "---:|" * len(weights),
    ]
    for cell, runs in pricing.items():
        lines.append(
            f"| {cell} | "
            + " | ".join(f"{runs[w]['hit_rate']:.3f} / {runs[w]['ttft_p90']:.3f}" for w in weights)
            + " |"
        )
    return [*lines, ""]


def _table(
    data: dict,
    columns=(
        "hit_rate",
        "ttft_p50",
        "ttft_p90",
        "ttft_p99",
        "throughput_tok_s",
        "load_imbalance_max_over_mean",
    ),
) -> str:
    head = "| policy | " + " | ".join(columns) + " |"
    rows = [head, "|---|" + "---:|" * len(columns)]
    for policy, s in data["policies"].items():
        rows.append(f"| {policy} | " + " | ".join(_fmt(s.get(c)) for c in columns) + " |")
    return "\n".join(rows)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return (
        f"{value:.3f}"
        if isinstance(value, float) and value < 100
        else f"{value:,.0f}"
        if isinstance(value, float)
        else str(value)
    )


def workload_sections(results: dict) -> list[str]:
    """W2 to W5: one table each (W3 one per rate, and its plot)."""
    lines: list[str] = []
    lines += [
        f"## W2: shared prefix, SGLang defaults, 8 replicas, {results['W2']['rate']}/s (ceiling {results['W2']['hit_rate_ceiling']})",
        "",
        _table(results["W2"]),
        "",
    ]
    lines += [
        "## W3: cache pressure (150 groups x 5, 6000 + 1200 tokens), 8 replicas",
        "",
        "![W3](img/w3_ttft_p90.png)",
        "",
    ]
    for rate, data in results["W3"].items():
        lines += [f"### {rate} requests/s (ceiling {data['hit_rate_ceiling']})", "", _table(data), ""]
    lines += [f"## W4: no sharing (control), {results['W4']['rate']}/s", "", _table(results["W4"]), ""]
    lines += [
        f"## W5: Zipf(1.1) hot spot, {results['W5']['rate']}/s (ceiling {results['W5']['hit_rate_ceiling']})",
        "",
        _table(results["W5"]),
        "",
    ]
    return lines


def real_cluster_section(real: dict) -> list[str]:
    """The scaled-down real cluster: medians over seeds, and how far one seed moves a ratio."""
    cols = (
        "hit_rate",
        "ttft_p50_ms",
        "ttft_p90_ms",
        "output_tokens_per_s",
        "load_imbalance_max_over_mean",
    )
    return [
        "## Real cluster, scaled down (4 CPU replicas, tiny model, 512-token shared prefixes, 20 req/s)",
        "",
        f"Medians over seeds {', '.join(map(str, real['seeds']))} (one run each, shuffled order; "
        f"the prefix policy was tuned on other seeds). Ceiling hit rate {real['hit_rate_ceiling']}.",
        "",
        _table(real, cols),
        "",
        *(
            f"Per seed, prefix's p90 TTFT over {other}'s: {_spread(per_seed_ratios(real['runs'], other))}."
            for other in sorted(real["policies"])
            if other != "prefix"
        ),
        "How far one seed moves the ratio is the noise any single run of this section carries.",
        "",
    ]


def tiers_section(tiers: dict) -> list[str]:
    rows = [
        f"| {name} | {c['host_blocks_per_replica']} | {c['hit_rate']:.3f} | {c['host_hit_rate']:.3f} "
        f"| {c['ttft_p50']:.3f} | {c['ttft_p90']:.3f} | {c['ttft_p99']:.3f} |"
        for name, c in tiers["cells"].items()
    ]
    return [
        "## Host tiers: W1 1x on 8 replicas, `prefix`",
        "",
        f"Each replica's device pool holds {tiers['device_blocks']} blocks; a host tier {HOST_TIER_FACTOR}x that,",
        "blocks leaving the pool copied there and back (each copy at the link's rate, before the",
        "step that needs it), the router pricing a host hit by that restore time (`kvmesh simulate",
        "--host-blocks-per-replica N --restore-token-s S`).",
        "",
        "| cell | host blocks | hit rate | of it from host | TTFT p50 (s) | p90 (s) | p99 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def write_docs(results: dict, out_dir: Path, elapsed_s: float) -> Path:
    img = out_dir / "img"
    img.mkdir(parents=True, exist_ok=True)
    sweep_ttft = {
        p: [(float(r), d["policies"][p]["ttft_p90"]) for r, d in results["W3"].items()] for p in ALL_POLICIES
    }
    plot_sweep(img / "w3_ttft_p90.png", sweep_ttft, "TTFT p90 (s)", "W3 cache pressure: TTFT p90 vs load")
    checks = targets(results)
    cost = results["cost_model"]
    lines = [
        "# Experiments: which routing policy wins, and by how much",
        "",
        "Regenerated by `kvmesh experiments --out-dir docs` (this file, `docs/experiments.json`, `docs/img/`).",
        f"Simulated with the real BlockManager, scheduler and policy classes and the `{cost['name']}` cost",
        f"model ({cost['source']}); block size {BLOCK}. Wall time of this run: {elapsed_s:.0f} s on 2 cores.",
        "",
        "## Targets (checked against this run)",
        "",
        "| target | value | bound | met | detail |",
        "|---|---:|---|---|---|",
        *(
            f"| {c['target']} | {c['value']} | {c['bound']} | {'yes' if c['met'] else '**no**'} | {c['detail']} |"
            for c in checks
        ),
        "",
        *notes(results),
        "## W1: Mooncake synthetic trace",
        "",
    ]
    for key, data in results["W1"].items():
        lines += [
            f"### {key.replace('/', ' speed-up, ')} replicas (ceiling hit rate {data['hit_rate_ceiling']})",
            "",
            _table(data),
            "",
        ]
    if results.get("tiers"):
        lines += tiers_section(results["tiers"])
    lines += workload_sections(results)
    if results.get("pricing"):
        lines += pricing_section(results["pricing"])
    if results.get("real"):
        lines += real_cluster_section(results["real"])
    path = out_dir / "experiments.md"
    old = path.read_text() if path.exists() else ""
    kept = [
        marked_section(old, name) for name in (ROUTERS_SECTION, PEERS_SECTION, FIDELITY_SECTION)
    ]  # their own commands'
    path.write_text("\n".join(lines) + "\n" + "".join(f"\n{block}\n" for block in kept if block))
    (out_dir / "experiments.json").write_text(
        json.dumps({"results": results, "targets": checks}, indent=2) + "\n"
    )
    return path


def main(out_dir: str, quick: bool, real: bool, cache_dir: str) -> int:
    started = time.monotonic()
    scale = Scale(quick)
    results = run_simulations(scale)
    if real:
        results["real"] = asyncio.run(run_real_cluster(scale, Path(cache_dir)))
    path = write_docs(results, Path(out_dir), time.monotonic() - started)
    for c in targets(results):
        print(
            f"{'met   ' if c['met'] else 'MISSED'} {c['target']}: {c['value']} ({c['bound']}) {c['detail']}"
        )
    print(f"\nwrote {path}")
    return 0
