"""The simulator's parked decoders (LazyDecodeScheduler) and the capacity behind ``--load``:
the same results as the engine's own Scheduler run every step, for a fraction of the work."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.bench.experiments.capacity import PROBE_BATCHES, draw_groups, measure_capacity, with_copies
from kvmesh.bench.experiments.cost_model import H100_LLAMA3_8B
from kvmesh.bench.experiments.lazy_scheduler import LazyDecodeScheduler
from kvmesh.bench.experiments.simulator import Simulation
from kvmesh.bench.measure import workloads as wl
from kvmesh.engine.scheduler import Scheduler
from kvmesh.kvcache import BlockManager

KVMESH = str(Path(sys.executable).with_name("kvmesh"))
SMALL = dataclasses.replace(H100_LLAMA3_8B, max_num_seqs=12, max_num_batched_tokens=96)


def busy_workload(rate: float = 300) -> list[wl.WorkloadRequest]:
    reqs = wl.poisson_arrivals(
        wl.shared_prefix(
            num_groups=6, prompts_per_group=10, system_prompt_len=200, question_len=40, output_len=70
        ),
        rate,
        seed=1,
    )
    return reqs + wl.multi_turn(num_sessions=6, turns=3, think_s=0.05, session_rate=50)


def rows(sim: Simulation) -> dict[str, list]:
    return {name: list(column) for name, column in sim.results.columns.items()}


@pytest.mark.parametrize(
    "policy, blocks, cost, routers, lag_s, heartbeat_s",
    [
        ("prefix", 40, SMALL, 2, 0.0, 0.0),  # KV so tight that requests are preempted
        ("prefix", 400, SMALL, 1, 0.01, 0.05),  # chunked prefill, a lagging index, heartbeats
        ("round_robin", 40, SMALL, 1, 0.0, 0.0),
        ("prefix", None, H100_LLAMA3_8B, 3, 0.0, 0.0),  # roomy: long quiet windows; session keys
        ("least_loaded", 60, SMALL, 2, 0.0, 0.02),
    ],
)
def test_parked_decoders_change_nothing_but_speed(policy, blocks, cost, routers, lag_s, heartbeat_s):
    """Every request's every number (arrival, first token, end, replica, cached and generated
    tokens) is the same as with the engine's Scheduler touching every request every step."""
    runs = {}
    for lazy in (True, False):
        sim = Simulation(
            busy_workload(),
            3,
            policy,
            cost,
            block_size=16,
            blocks_per_replica=blocks,
            routers=routers,
            event_lag_s=lag_s,
            heartbeat_s=heartbeat_s,
            lazy_decode=lazy,
        )
        runs[lazy] = (sim.run(), rows(sim), sim.events)
    (fast, fast_rows, fast_events), (slow, slow_rows, slow_events) = runs[True], runs[False]
    assert fast_rows.keys() == slow_rows.keys() and len(fast_rows["done_s"]) == fast["num_requests"] > 0
    for name, column in fast_rows.items():
        assert column == pytest.approx(slow_rows[name], rel=1e-9, abs=1e-12), name
    assert fast == pytest.approx(slow, rel=1e-9)
    if blocks == 40:
        assert fast["preemptions"] > 0  # the case this row is for
    assert fast_events <= slow_events


def test_a_step_touches_the_requests_at_a_boundary_not_the_batch():
    """At a heavy load the parked scheduler hands the simulator a small fraction of the request
    slots the engine's Scheduler does (what each step's cost grows with)."""
    touched = {}
    for lazy in (True, False):
        sim = Simulation(
            busy_workload(rate=600), 2, "prefix", H100_LLAMA3_8B, block_size=64, lazy_decode=lazy
        )
        counted = [0, 0]  # (steps, requests handed out)
        for replica in sim.replicas:
            schedule = replica.scheduler.schedule

            def counting(schedule=schedule, counted=counted):
                scheduled = schedule()
                counted[0] += 1
                counted[1] += len(scheduled)
                return scheduled

            replica.scheduler.schedule = counting
        sim.run()
        touched[lazy] = counted
    assert touched[False][1] / touched[False][0] > 10  # the batch the engine walks each step
    assert touched[True][1] < touched[False][1] / 5


def test_parking_needs_a_budget_that_outlasts_the_batch():
    bm = BlockManager(64, 16)
    with pytest.raises(ValueError, match="max_num_seqs < max_num_batched_tokens"):
        LazyDecodeScheduler(bm, 64, 64, lambda request, n: [3] * n)
    tight = dataclasses.replace(SMALL, max_num_seqs=96)  # so the simulator runs every step
    sim = Simulation(busy_workload(), 2, "prefix", tight, block_size=16)
    assert all(type(r.scheduler) is Scheduler for r in sim.replicas)
    assert sim.run()["num_requests"] == len(busy_workload())


def test_the_probe_takes_whole_groups_and_copies_them_with_new_content():
    workload = wl.shared_prefix(num_groups=40, prompts_per_group=5)
    sample = with_copies(draw_groups(workload, 0.25), at_least=300)
    originals = [r for r in sample if "~" not in r.group]
    groups = {r.group for r in originals}
    assert 3 <= len(groups) <= 20 and all(r.arrival_s == 0 for r in sample)
    assert len(originals) == 5 * len(groups)  # whole groups
    assert len(sample) >= 300 and len(sample) % len(originals) == 0
    copy = [r for r in sample if r.group.endswith("~1")]
    first = {r.group: r.tokens()[:2048] for r in originals}
    for r in copy:  # the same shape, shared within the copy, with other tokens
        original = r.group.removesuffix("~1")
        assert r.prompt_len == 2176 and r.tokens()[:2048] != first[original]
        assert r.tokens()[:2048] == next(c for c in copy if c.group == r.group).tokens()[:2048]


@pytest.mark.slow
def test_capacity_separates_a_stable_load_from_an_overload():
    """At 0.7 of the measured capacity the queue stays short to the end of the run; at 1.4
    it grows all the way: the last tenth of the requests wait far longer than the first."""
    workload = wl.shared_prefix(num_groups=8, prompts_per_group=250)
    capacity = measure_capacity(workload, len(workload), 4, "prefix", H100_LLAMA3_8B, block_size=256)
    assert capacity.probe_requests >= PROBE_BATCHES * H100_LLAMA3_8B.max_num_seqs * 4
    waits = {}
    for load in (0.7, 1.4):
        reqs = wl.poisson_arrivals(workload, load * capacity.per_replica_rps * 4, seed=2)
        sim = Simulation(reqs, 4, "prefix", H100_LLAMA3_8B)
        sim.run()
        ttft = [f - a for f, a in zip(sim.results["first_token_s"], sim.results["arrival_s"], strict=True)]
        tenth = len(ttft) // 10
        waits[load] = (sum(ttft[:tenth]) / tenth, sum(ttft[-tenth:]) / tenth)
    assert waits[0.7][1] < 3 * waits[0.7][0]
    assert waits[1.4][1] > 10 * waits[1.4][0]


@pytest.mark.slow
def test_simulate_cli_load(tmp_path):
    out = tmp_path / "sim.json"
    run = subprocess.run(
        [
            KVMESH,
            "simulate",
            "--workload",
            "shared_prefix",
            "--num-groups",
            "8",
            "--prompts-per-group",
            "40",
            "--replicas",
            "2",
            "--load",
            "0.5",
            "-q",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    config = json.loads(out.read_text())["config"]
    capacity = config["capacity"]
    assert config["load"] == 0.5 and capacity["probe_replicas"] == 2 and capacity["per_replica_rps"] > 0
    assert config["rate"] == pytest.approx(0.5 * capacity["per_replica_rps"] * 2)
    for bad in (["--load", "0.5", "--rate", "3"], ["--load", "0"], ["--load", "0.5", "--trace", "t.jsonl"]):
        run = subprocess.run(
            [KVMESH, "simulate", "--workload", "shared_prefix", "-q", "--out", str(out), *bad],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and "--load" in run.stderr
