"""``kvmesh bench peers``: guidellm's report is read right, bad flags are one-line errors, and
the kvmesh contenders run end to end (a real ``kvmesh router`` process over real replicas)
with the cached tokens counted by the replicas themselves. The peers themselves (sglang-router,
vllm-router, guidellm) are a 1.7 GB venv: `make peers`, then `kvmesh bench peers`."""

import dataclasses
import itertools
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmesh.bench import peers
from kvmesh.bench.measure.peer_loads import GuidellmLoad
from kvmesh.bench.measure.report import marked_section, write_section
from kvmesh.bench.peer_processes import (
    CONTENDERS,
    GuidellmLate,
    GuidellmNotPoisson,
    PortTaken,
    RouterProcess,
    RunAgain,
    equal_gaps_in_a_row,
    main_thread_cpu_seconds,
    run_guidellm,
    session_cpu_seconds,
    summarize_guidellm,
)
from kvmesh.cluster.embedded_redis import free_port

KVMESH = str(Path(sys.executable).with_name("kvmesh"))
SAMPLE = Path(__file__).resolve().parents[1] / "data" / "guidellm_sample.json"


def test_guidellm_report_is_summarized_from_its_real_fields():
    report = json.loads(SAMPLE.read_text())
    s = summarize_guidellm(report)
    requests = report["benchmarks"][0]["requests"]["successful"]
    assert s["requests"] == len(requests) == 20 and s["errors"] == 0
    assert s["ttft_p50_ms"] == pytest.approx(27.1, abs=0.1)
    assert s["ttft_p90_ms"] == pytest.approx(117.0, abs=0.1)
    assert s["client_hit_rate"] == pytest.approx(2048 / 3840, abs=1e-4)
    assert s["output_tokens_per_s"] > 0 and s["req_per_s"] > 0


def test_a_guidellm_run_that_ignored_its_arrival_rate_is_refused():
    """guidellm 0.8.1 sometimes sends every Poisson arrival at once and only warns: such a
    report must not become a row (a merely late dispatcher, shorter than the run, is kept)."""
    report = json.loads(SAMPLE.read_text())
    bench = report["benchmarks"][0]
    warning = {"code": "root_late", "message": "p95 root dispatch delay was 1796113117.2s", "threshold": 0.2}
    bench["warnings"] = [warning | {"observed": bench["duration"] / 2}]
    assert summarize_guidellm(report)["requests"] == 20
    bench["warnings"] = [warning | {"observed": 1796113117.2}]
    with pytest.raises(GuidellmLate, match="root dispatch delay"):
        summarize_guidellm(report)


async def test_a_router_that_lost_its_port_is_told_apart_and_its_run_repeated(tmp_path):
    """A router whose picked port was taken before it bound it raises PortTaken (any other
    exit stays an error), and the sweep runs that cell again, counting the discarded run."""
    lost = [
        sys.executable,
        "-c",
        "import sys; print('Error: Address already in use (os error 98)'); sys.exit(1)",
    ]
    broken = [sys.executable, "-c", "import sys; print('bad flag'); sys.exit(2)"]
    with pytest.raises(PortTaken):
        await RouterProcess(CONTENDERS[0], lost, free_port(), tmp_path / "lost.log").start(timeout_s=20)
    with pytest.raises(RuntimeError, match="bad flag") as error:
        await RouterProcess(CONTENDERS[0], broken, free_port(), tmp_path / "broken.log").start(timeout_s=20)
    assert not isinstance(error.value, RunAgain)

    bench = peers._Bench(peers.PeersConfig(str(tmp_path / "o.json"), tmp_path, tmp_path), *[None] * 6)
    outcomes = iter([PortTaken("taken"), GuidellmLate("burst"), {"router": "r"}])

    async def run(*_):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    bench.run = run  # fault injection: the first two runs did not measure the cell
    assert await bench.run_honest(CONTENDERS[0], "shared_prefix", 2.0, "guidellm", 0) == {
        "router": "r",
        "runs_discarded": 2,
    }
    outcomes = iter([PortTaken("taken")] * peers.RUN_TRIES)
    with pytest.raises(RuntimeError, match="did not measure it"):
        await bench.run_honest(CONTENDERS[0], "shared_prefix", 2.0, "guidellm", 0)


def test_a_target_with_an_unknown_comparison_is_refused_not_misread():
    from kvmesh.bench.measure.common import target

    assert target("t", 0.667, ">=", 0.5)["met"] and not target("t", 0.667, "<=", 0.5)["met"]
    with pytest.raises(ValueError, match="'>'"):
        target("t", 0.667, ">", 0.5)  # it used to be checked as <=


def _with_targets(report: dict, targets: list[float]) -> dict:
    requests = report["benchmarks"][0]["requests"]["successful"]
    for request, at in zip(requests, targets, strict=True):
        request["info"] = {"timings": {"targeted_start": at}}
    return report


def test_a_guidellm_schedule_that_repeats_its_gaps_is_refused():
    """guidellm 0.8.1's Poisson profile with 10 worker processes draws each gap 10 times (its
    workers seed alike): 20 arrivals in two evenly spaced blocks is not a Poisson load. Fresh
    exponential gaps are, and a report without arrival targets is read as before."""
    rng = random.Random(3)
    poisson = list(itertools.accumulate(rng.expovariate(4.0) for _ in range(20)))
    assert equal_gaps_in_a_row(poisson) == 1
    summarize_guidellm(_with_targets(json.loads(SAMPLE.read_text()), poisson))
    blocks = list(itertools.accumulate([0.5] * 10 + [0.004] * 10))
    assert equal_gaps_in_a_row(blocks) == 10
    with pytest.raises(GuidellmNotPoisson, match="10 arrivals in a row"):
        summarize_guidellm(_with_targets(json.loads(SAMPLE.read_text()), blocks))
    assert summarize_guidellm(json.loads(SAMPLE.read_text()))["requests"] == 20


def test_guidellm_runs_with_one_worker_process(tmp_path):
    """The real subprocess call, through a stand-in guidellm that writes the sample report and
    the worker-process setting it was started with."""
    fake = tmp_path / "bin" / "guidellm"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\n"
        "import os, shutil, sys\n"
        "out = sys.argv[sys.argv.index('--output') + 1].split('path=')[1]\n"
        f"shutil.copy({str(SAMPLE)!r}, out)\n"
        "open(out + '.workers', 'w').write(os.environ.get('GUIDELLM__MAX_WORKER_PROCESSES', 'unset'))\n"
    )
    fake.chmod(0o755)
    load = GuidellmLoad(256, 4, 32, 8, rate=3.0, requests=20, max_seconds=60)
    out = tmp_path / "run" / "report.json"
    assert run_guidellm(load, tmp_path, "http://127.0.0.1:9", "m", "/models/m", out)["requests"] == 20
    assert Path(f"{out}.workers").read_text() == "1"


def test_guidellm_command_is_offline_local_and_seeded(tmp_path):
    load = GuidellmLoad(256, 4, 32, 8, rate=3.0, requests=40, max_seconds=60, seed=7)
    cmd = load.command(Path("/venv"), "http://127.0.0.1:9", "m", "/models/m", tmp_path / "o.json")
    joined = " ".join(cmd)
    assert cmd[:2] == ["/venv/bin/guidellm", "run"]
    assert "target=http://127.0.0.1:9" in joined and "tokenizer" in joined and "model=/models/m" in joined
    assert "prefix_tokens=256,prefix_count=4" in joined and "kind=poisson,rate=3.0" in joined
    assert "kind=static,value=7" in joined and "count=40" in joined


@pytest.mark.slow  # a kvmesh process per case
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--routers", "nginx lol"], "--routers: pick from"),
        (["--rates", "0,6"], "must be positive"),
        (["--rates", "fast"], "--rates: comma-separated numbers"),
        (["--workloads", "shared_prefix,tpcc"], "--workloads:"),
        (["--peers-venv", "/nonexistent"], "run `make peers` first"),
    ],
)
def test_bad_flags_are_one_line_errors(args, needle):
    done = subprocess.run([KVMESH, "bench", "peers", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_router_sessions_cpu_time_is_read_from_the_kernel():
    """A process that burns ~0.3 s of CPU in a child of its own session: all of it is counted
    (the child's while it runs, then in its parent once reaped), and an idle one adds nothing."""
    burn = "import time; t = time.process_time(); [0 for _ in iter(lambda: time.process_time() - t < 0.3, False)]"
    script = (
        f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {burn!r}]); print('reaped', flush=True); "
        "time.sleep(30)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "reaped"
        spent = session_cpu_seconds(proc.pid)
        assert 0.3 <= spent < 3
        time.sleep(0.3)  # asleep now: nothing more is counted
        assert session_cpu_seconds(proc.pid) - spent < 0.1
    finally:
        proc.kill()
        proc.wait()


def test_a_main_threads_cpu_is_told_apart_from_its_other_threads():
    """A process whose second thread burns ~0.3 s: the session counts it, the main thread
    (a server's event loop) does not."""
    script = (
        "import threading, time\n"
        "def burn():\n"
        "    t = time.thread_time()\n"
        "    while time.thread_time() - t < 0.3:\n"
        "        pass\n"
        "w = threading.Thread(target=burn); w.start(); w.join(); print('done', flush=True); time.sleep(30)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "done"
        assert session_cpu_seconds(proc.pid) >= 0.3
        assert main_thread_cpu_seconds(proc.pid) < 0.2  # its start-up only
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow  # a subprocess that imports torch and Ray: make test-fast leaves it out
def test_resuming_over_another_sweeps_runs_is_a_one_line_error(tmp_path):
    out = tmp_path / "sweep.json"
    out.with_suffix("").mkdir()
    foreign = {"router": "kvmesh prefix", "workload": "mooncake", "rate": 9.0, "generator": "kvmesh_loadgen"}
    (out.with_suffix("") / "rows.jsonl").write_text(json.dumps(foreign | {"repeat": 0}) + "\n")
    args = ["--out", str(out), "--resume", "--no-guidellm", "--routers", "kvmesh prefix", "--rates", "2"]
    done = subprocess.run([KVMESH, "bench", "peers", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert (
        "holds 1 runs this sweep does not have" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    )


WORKLOADS = ("shared_prefix", "mooncake")  # multi_turn runs the same code with another workload


@pytest.mark.bench  # a benchmark command end to end: make test-bench
def test_kvmesh_contenders_sweep_end_to_end(ray_cluster, qwen3_dir, tmp_path):
    """A real `kvmesh router` process per run (resumed: one kept for two runs) over 2 replicas,
    two repeats of two workloads at one rate, kvmesh's HTTP load generator: every run's hit
    rate comes from the replicas' counters and agrees with what the clients were told; the
    summary has medians and min/max.
    One contender: the others run the same code, each adding six runs (the comparison between
    contenders is ``cell_targets``', tested below on a summary)."""
    load = GuidellmLoad(128, 2, 16, 4, rate=20.0, requests=12, max_seconds=60)
    ours = tuple(c for c in CONTENDERS if c.name == "kvmesh prefix")
    out = tmp_path / "peers.json"
    config = peers.PeersConfig(
        out=str(out),
        venv=tmp_path,
        cache_dir=tmp_path,
        replicas=2,
        num_kv_blocks=64,
        load=load,
        rates=(20.0,),
        repeats=2,
        overhead_pairs=5,
        contenders=ours,
        guidellm=False,
        model_dir=qwen3_dir,
        docs=tmp_path / "docs" / "e.md",
        workloads=WORKLOADS,
    )
    assert peers.main(config) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == 1 * 2 * 2  # routers x workloads x repeats
    kept = out.with_suffix("") / "rows.jsonl"  # written as each run lands
    assert [json.loads(line) for line in kept.read_text().splitlines()] == rows
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 12, r
        assert sum(r["requests_per_replica"].values()) == 12  # counted by the replicas
        assert r["hit_rate"] == pytest.approx(r["client_hit_rate"], abs=1e-3)
        assert r["routed_p50_ms"] > 0 and "added_p90_ms" in r
        assert 0 < r["router_cpu_ms_per_request"] < 1000  # a Python router spends some, read from /proc
        # the replicas' processes ran each request's model steps: more CPU than routing it
        assert r["replicas_cpu_ms_per_request"] > r["router_cpu_ms_per_request"], r
        assert r["system_cpu_ms_per_request"] == pytest.approx(
            r["router_cpu_ms_per_request"] + r["replicas_cpu_ms_per_request"]
        )
        # the router's own account of the run: a decision for each request, none of the probe's
        branches = {k: v for k, v in r["router_account"].items() if k.startswith("branch ")}
        assert sum(branches.values()) == 12, r["router_account"]
        assert set(r["replica_prefill_us_per_token"]) == set(r["requests_per_replica"])
    assert len({r["router_pid"] for r in rows}) == len(rows)  # a new router process a run
    for repeat in (0, 1):  # each repeat runs every cell once
        assert sorted((r["router"], r["workload"]) for r in rows if r["repeat"] == repeat) == sorted(
            (c.name, w) for c in ours for w in WORKLOADS
        )
    summary = {(s["router"], s["workload"]): s for s in result["summary"]}
    assert len(summary) == 2 and all(s["runs"] == 2 and s["rate"] == 20.0 for s in summary.values())
    for s in summary.values():
        assert s["hit_rate_min"] <= s["hit_rate_median"] <= s["hit_rate_max"]
    assert summary[("kvmesh prefix", "shared_prefix")]["hit_rate_median"] > 0.5  # shared 6 ways: reused
    assert 0 < summary[("kvmesh prefix", "mooncake")]["hit_rate_median"] < 1  # the trace's own sharing
    assert result["targets"] == []  # nobody to compare kvmesh prefix with
    assert result["runs_discarded"] == 0 and all(r["runs_discarded"] == 0 for r in rows)
    router_logs = list(out.with_suffix("").glob("kvmesh-*.log"))  # what each router process printed
    assert router_logs and all("event loop uvloop" in log.read_text() for log in router_logs)
    # cut short after 2 runs: a resumed sweep keeps them as they were and runs the other 2, here
    # with one router process kept through both (one contender: the same plan either way)
    kept.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    resumed = dataclasses.replace(config, resume=True, one_router=True)
    plan = peers.sweep_plan(resumed, rows[:2])
    assert [[(c.name, *cell, repeat) for c, *cell in cells] for repeat, cells in plan] == [
        [peers._run_key(r) for r in rows[2:]]
    ]
    assert peers.main(resumed) == 0
    again = json.loads(out.read_text())["rows"]
    assert again[:2] == rows[:2] and len(again) == 4
    assert sorted(map(peers._run_key, again)) == sorted(map(peers._run_key, rows))
    assert again[2]["router_pid"] == again[3]["router_pid"] != again[1]["router_pid"]
    for r in again[2:]:  # the kept router's account, still per run
        assert sum(v for k, v in r["router_account"].items() if k.startswith("branch ")) == 12, r
    assert "Routers: one router process per contender" in out.with_suffix(".md").read_text()
    assert "| kvmesh prefix | 20 |" in out.with_suffix(".md").read_text()
    assert out.with_name("peers_mooncake_kvmesh_loadgen.png").stat().st_size > 0
    docs = (tmp_path / "docs" / "e.md").read_text()
    assert docs.count("<!-- bench peers -->") == 1 and "| kvmesh prefix | 20 |" in docs
    assert (tmp_path / "docs" / "img" / "peers_shared_prefix.png").stat().st_size > 0


def test_docs_section_is_replaced_in_place_not_duplicated(tmp_path):
    """`kvmesh bench peers` owns one marked block of docs/experiments.md; `kvmesh experiments`
    regenerates the rest and carries that block over (marked_section)."""
    path = tmp_path / "e.md"
    path.write_text("# title\n\nbody\n")
    write_section(path, "bench peers", "first")
    write_section(path, "bench peers", "second")
    text = path.read_text()
    assert text.startswith("# title\n\nbody") and "second" in text and "first" not in text
    assert text.count("<!-- bench peers -->") == 1
    assert marked_section(text, "bench peers") == "<!-- bench peers -->\nsecond\n<!-- /bench peers -->"


def test_cell_targets_compare_kvmesh_prefix_with_the_best_and_the_fastest_other_router():
    """Per cell: prefix's hit rate against the best other's, its p90 TTFT against the fastest
    other's (peers and kvmesh's own policies alike), and the cells where it wins both."""

    def row(router: str, workload: str, hit: float, p90: float) -> dict:
        return {
            "router": router,
            "workload": workload,
            "rate": 4.0,
            "generator": "kvmesh_loadgen",
            "hit_rate_median": hit,
            "ttft_p90_ms_median": p90,
        }

    summary = [
        row("kvmesh prefix", "shared_prefix", 0.80, 100.0),
        row("sglang-router", "shared_prefix", 0.70, 90.0),  # faster, fewer hits
        row("kvmesh round_robin", "shared_prefix", 0.50, 120.0),
        row("kvmesh prefix", "mooncake", 0.60, 80.0),
        row("vllm-router", "mooncake", 0.55, 95.0),  # prefix wins both here
    ]
    generators = {"shared_prefix": "kvmesh_loadgen", "mooncake": "kvmesh_loadgen"}
    targets = {t["target"]: t for t in peers.cell_targets(summary, generators)}
    hits = targets["hit rate median, shared_prefix at 4/s (kvmesh_loadgen): kvmesh prefix - sglang-router"]
    assert hits["value"] == pytest.approx(0.10) and hits["met"]
    slow = targets["TTFT p90 median, shared_prefix at 4/s (kvmesh_loadgen): kvmesh prefix / sglang-router"]
    assert slow["value"] == pytest.approx(100 / 90, rel=1e-3) and not slow["met"]  # over 1.05x
    wins = targets["cells (of 2) where kvmesh prefix is strictly better on both"]
    assert wins["value"] == 1


def _plan_order(one_router: bool) -> list[tuple]:
    config = peers.PeersConfig("o.json", Path("."), Path("."), repeats=2, one_router=one_router)
    return [(repeat, c.name, *cell) for repeat, cells in peers.sweep_plan(config, []) for c, *cell in cells]


def test_one_router_runs_each_contenders_runs_back_to_back():
    """A kept router goes from one of its runs into its next: each repeat runs one contender's
    runs, shuffled, then the next's. The same runs as the default order, which stays as it was
    (interleaved) so a resumed sweep goes on in the order it began."""
    grouped, interleaved = _plan_order(True), _plan_order(False)
    assert sorted(grouped) == sorted(interleaved)
    for repeat in (0, 1):
        routers = [name for r, name, *_ in grouped if r == repeat]
        assert len(set(routers)) == len(peers.SWEEP_CONTENDERS) == 4
        assert sum(a != b for a, b in itertools.pairwise(routers)) == 3  # one block per contender
        shuffled = [(name, *cell) for r, name, *cell in interleaved if r == repeat]
        for name in set(routers):  # within a contender, the shuffle's order
            assert [cell for r, n, *cell in grouped if r == repeat and n == name] == [
                cell for n, *cell in shuffled if n == name
            ]
    first = [name for r, name, *_ in interleaved if r == 0]
    assert sum(a != b for a, b in itertools.pairwise(first)) > 3


_FAKE_ROUTER = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers()\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


async def test_one_router_keeps_a_contenders_process_through_its_runs(tmp_path, capsys):
    """With ``one_router`` two runs of a contender get the same process, another contender its
    own, one that exited is started again (and said so), and all are stopped at the end;
    without it every run gets a new process, stopped after it."""

    def bench(one_router: bool) -> peers._Bench:
        config = peers.PeersConfig(str(tmp_path / "o.json"), tmp_path, tmp_path, one_router=one_router)
        b = peers._Bench(config, *[None] * 6)

        def new_router(contender, stem):
            port = free_port()
            command = [sys.executable, "-c", _FAKE_ROUTER, str(port)]
            return RouterProcess(contender, command, port, tmp_path / f"{stem}.log")

        b.new_router = new_router
        return b

    kept = bench(True)
    ours, theirs = CONTENDERS[0], CONTENDERS[3]
    async with kept.router(ours, "a") as first:
        pass
    async with kept.router(ours, "b") as second, kept.router(theirs, "c") as other:
        assert second is first and first.proc.poll() is None
        assert other.proc.pid != first.proc.pid
    first.stop()  # it died between runs
    async with kept.router(ours, "d") as again:
        assert again.proc.pid != first.proc.pid and again.proc.poll() is None
    assert f"{ours.name}'s router exited" in capsys.readouterr().err
    kept.stop_routers()
    assert again.proc.poll() is not None and other.proc.poll() is not None

    fresh = bench(False)
    async with fresh.router(ours, "e") as one:
        pass
    async with fresh.router(ours, "f") as two:
        assert two.proc.pid != one.proc.pid and one.proc.poll() is not None
    assert two.proc.poll() is not None and not fresh.kept


def test_lopsided_runs_are_counted_per_kvmesh_cell(tmp_path):
    """The worst runs a median hides: per kvmesh cell, runs whose requests max/mean is above
    1.6, in the tables beside the router mode; the summary keeps the worst run's spread too."""

    def run(router: str, rate: float, spread: float, repeat: int) -> dict:
        cell = {"router": router, "workload": "shared_prefix", "rate": rate, "generator": "guidellm"}
        measured = {"hit_rate": 0.5, "ttft_p90_ms": 100.0, "requests_max_over_mean": spread}
        return cell | measured | {"repeat": repeat, "errors": 0}

    rows = [
        run("kvmesh prefix", 5.0, 1.2, 0),
        run("kvmesh prefix", 5.0, 1.61, 1),
        run("kvmesh prefix", 5.0, 1.6, 2),  # at the bound: not above it
        run("kvmesh prefix", 6.0, 1.1, 0),
        run("sglang cache_aware", 5.0, 2.0, 0),  # a peer's cells get no line
    ]
    summary = peers.summarize_rows(rows)
    assert summary[0]["requests_max_over_mean_max"] == 1.61
    assert peers.lopsided_runs(rows, summary) == [
        "- kvmesh prefix at 5/s: runs with requests max/mean above 1.6: 1 of 3",
        "- kvmesh prefix at 6/s: runs with requests max/mean above 1.6: 0 of 1",
    ]
    result = {
        "config": {"workloads": ["shared_prefix"], "one_router": True},
        "rows": rows,
        "summary": summary,
    }
    text = peers.write_tables(result, str(tmp_path / "peers.json"))
    assert text.startswith("Routers: one router process per contender through all its runs")
    assert "| kvmesh prefix | 5 |" in text and "above 1.6: 1 of 3" in text


def test_guidellm_only_runs_the_shared_prefix_cell_through_guidellm_alone():
    both = peers.PeersConfig("o.json", Path("."), Path("."))
    alone = dataclasses.replace(both, guidellm_only=True)
    assert both.generators("shared_prefix") == ("guidellm", "kvmesh_loadgen")
    assert alone.generators("shared_prefix") == ("guidellm",)
    assert alone.generators("mooncake") == ("kvmesh_loadgen",)
