"""Smoke runs of the router benchmarks as users run them (real Ray replicas, real router
processes): every number the docs quote is in their JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.servers,
    pytest.mark.slow,
    pytest.mark.bench,
]  # benchmarks' smoke runs: make test-bench

KVMESH = str(Path(sys.executable).with_name("kvmesh"))


def test_bench_routers_quick(tmp_path):
    out, png = tmp_path / "routers.json", tmp_path / "routers.png"
    run = subprocess.run(
        [
            KVMESH,
            "bench",
            "routers",
            "--quick",
            "--routers",
            "1,2",
            "--repeats",
            "1",
            "--replicas",
            "2",
            "--out",
            str(out),
            "--png",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert sorted((r["routers"], r["shared_load"]) for r in rows) == [
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    ]
    for r in rows:
        assert {"hit_rate", "ttft_p90", "prefill_max_over_mean"} <= set(r) and r["errors"] == 0
        assert 0 < r["hit_rate"] <= 1 and sum(r["requests_per_replica"]) == 16
        if r["shared_load"] and r["routers"] > 1:  # a lone router shares nothing per request
            window = r["race_window"]
            assert window["batches"] > 0 and 0 < window["mean_ms"] < 100, window
        else:
            assert r["race_window"] is None
    assert png.is_file() and result["targets"]


def test_bench_router_quick(tmp_path):
    out = tmp_path / "router.json"
    run = subprocess.run(
        [KVMESH, "bench", "router", "--quick", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    latency, decision = result["added_latency"], result["decision"]
    for api, paths in (("grpc", ("router", "passthrough")), ("http", ("router",))):
        for path in paths:
            assert latency[api][path]["p50_ms"] > latency[api]["direct"]["p50_ms"] * 0.5
            assert "added_p90_ms" in latency[api][path]
    assert decision["token_ids"]["p99_ms"] > 0 and decision["token_ids_beside_text"]["p99_ms"] > 0
    assert decision["tokenize_only"]["p50_ms"] > 0 and decision["tokenize_shared_prefix"]["p50_ms"] > 0
    cpu = latency["router_cpu"]  # the router process's own CPU, split by the stages that spent it
    assert set(cpu) == {"grpc_short", "grpc_4k", "http_short", "http_4k"}
    for case, rows in cpu.items():
        answers = [k for k in rows if k.startswith("per_request_")]
        assert answers == ["per_request_1_token", "per_request_9_tokens"]  # a quick run's answers
        for row in (rows[k] for k in answers):
            assert row["cpu_ms_per_request"] > 0
            assert sum(row["by_stage_ms"].values()) == pytest.approx(row["cpu_ms_per_request"], rel=0.01)
        stages = rows["per_request_1_token"]["by_stage_ms"]
        assert stages.get("relay", 0) > 0, (case, stages)
        if case.endswith("4k"):  # a 4k-token text is tokenized and hashed by the router
            assert stages.get("tokenize", 0) + stages["threads"] > 0 and stages.get("hash", 0) > 0, (
                case,
                stages,
            )
    assert len(result["targets"]) == 4 and all("met" in t for t in result["targets"])
