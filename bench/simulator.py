"""``kvmesh bench simulator``: what one simulated event costs as the fleet fills up.

The same workload at a light, a medium and a heavy load (fractions of the capacity the probe
measures, ``bench/experiments/capacity.py``), simulated two ways: with the engine's own
Scheduler touching every request every step (the reference) and with the steady decoders
parked (``LazyDecodeScheduler``, the default). Both must give the same results; the targets
are the parked one's speed-up at the heavy load and how little its cost per request grows from
the light load to the heavy one (more requests in flight), while the reference's grows.
"""

from __future__ import annotations

import time

from kvmesh.bench.experiments.capacity import measure_capacity
from kvmesh.bench.experiments.cost_model import H100_LLAMA3_8B
from kvmesh.bench.experiments.simulator import Simulation
from kvmesh.bench.measure import workloads as wl
from kvmesh.bench.measure.common import environment, over_repeats, progress, target, write_result

LOADS = (0.2, 0.5, 0.8)


def one_run(requests: list[wl.WorkloadRequest], replicas: int, lazy: bool) -> dict:
    sim = Simulation(requests, replicas, "prefix", H100_LLAMA3_8B, lazy_decode=lazy)
    start = time.perf_counter()
    summary = sim.run()
    wall = time.perf_counter() - start
    c = sim.results
    in_flight = sum(d - a for d, a in zip(c["done_s"], c["arrival_s"], strict=True)) / summary["simulated_s"]
    return {
        "mode": "parked" if lazy else "every_step",
        "wall_s": round(wall, 3),
        "events": sim.events,
        "usec_per_event": round(wall / sim.events * 1e6, 2),
        "usec_per_request": round(wall / len(c) * 1e6, 1),
        "in_flight_per_replica": round(in_flight / replicas, 1),
        "hit_rate": summary["hit_rate"],
        "ttft_p50": summary["ttft_p50"],
        "ttft_p99": summary["ttft_p99"],
    }


def main(out: str, quick: bool, repeats: int = 3) -> int:
    replicas, groups, per_group = (8, 8, 300) if quick else (32, 32, 600)
    make = lambda: wl.iter_shared_prefix(num_groups=groups, prompts_per_group=per_group)  # noqa: E731
    capacity = measure_capacity(
        make(), groups * per_group, replicas, "prefix", H100_LLAMA3_8B, block_size=256
    )
    progress(f"capacity {capacity.per_replica_rps:.2f} requests/s a replica")
    rows = []
    for repeat in range(1 if quick else repeats):
        for load in LOADS:
            rate = load * capacity.per_replica_rps * replicas
            requests = wl.poisson_arrivals(list(make()), rate, seed=repeat)
            for lazy in (True, False):
                row = {"load": load, "repeat": repeat} | one_run(requests, replicas, lazy)
                progress(f"load {load} {row['mode']}: {row['usec_per_event']} us/event, {row['wall_s']} s")
                rows.append(row)
    metrics = ("wall_s", "usec_per_event", "usec_per_request", "in_flight_per_replica")
    summary = over_repeats(rows, ("load", "mode"), metrics)
    cell = {(s["load"], s["mode"]): s for s in summary}
    heavy, light = max(LOADS), min(LOADS)
    speedup = cell[heavy, "every_step"]["wall_s_median"] / cell[heavy, "parked"]["wall_s_median"]

    def growth(mode: str) -> float:
        return cell[heavy, mode]["usec_per_request_median"] / cell[light, mode]["usec_per_request_median"]

    same = all(
        (a["hit_rate"], a["ttft_p50"], a["ttft_p99"]) == (b["hit_rate"], b["ttft_p50"], b["ttft_p99"])
        for a, b in zip(rows[::2], rows[1::2], strict=True)
    )
    result = {
        "benchmark": "simulator",
        "config": {
            "replicas": replicas,
            "workload": f"shared_prefix {groups} x {per_group}",
            "cost_model": H100_LLAMA3_8B.name,
            "loads": LOADS,
            "repeats": 1 if quick else repeats,
            "capacity_rps_per_replica": round(capacity.per_replica_rps, 3),
        },
        "summary": summary,
        "rows": rows,
        "targets": [
            target("every-step wall / parked wall at the heavy load", round(speedup, 2), ">=", 2.0),
            target(
                "parked us/request, heavy load / light load",
                round(growth("parked"), 2),
                "<=",
                1.5,
                f"every step: {growth('every_step'):.2f}",
            ),
            target("runs giving the same hit rate and TTFT both ways", float(same), ">=", 1.0),
        ],
        "environment": environment(),
    }
    print(f"\n{'load':>5}{'mode':>12}{'in flight':>11}{'us/event':>10}{'us/request':>12}{'wall':>8}")
    for s in summary:
        print(
            f"{s['load']:>5}{s['mode']:>12}{s['in_flight_per_replica_median']:>11.1f}"
            f"{s['usec_per_event_median']:>10.1f}{s['usec_per_request_median']:>12.1f}{s['wall_s_median']:>7.1f}s"
        )
    write_result(out, result)
    return 0
