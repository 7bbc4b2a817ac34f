"""The ``kvmesh`` console script: help, one-line usage errors, and the kvcache benchmark."""

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

KVMESH = str(Path(sys.executable).with_name("kvmesh"))


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([KVMESH, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_help_lists_commands():
    out = run("--help")
    assert out.returncode == 0
    assert "bench" in out.stdout


@pytest.mark.slow  # a kvmesh process per case
@pytest.mark.parametrize(
    "args",
    [
        ("frobnicate",),
        (),
        ("bench", "nope"),
        ("bench", "kvcache", "--repeats", "0"),
        ("bench", "kvcache", "--repeats", "x"),
        ("router", "--model", "/m", "--redis-url", "redis://r", "--deployment", "two words"),
        ("up", "--model", "/m", "--deployment", ""),
        ("router", "--model", "/m", "--redis-url", "redis://r", "--api-key", "inline-secret"),
        ("valkey-acl", "--passwords-dir", "/nonexistent", "--out", "/tmp/x.acl"),
        ("drain-replicas", "--timeout", "0"),
        ("bench", "pileup", "--rates", "5,0"),
        ("bench", "pileup", "--rates", "5,x"),
        ("bench", "serve", "--model", "/nonexistent", "--workload", "shared_prefix"),
        ("demo", "--engine", "vllm", "--vllm-python", "/nonexistent/python"),
        ("bench", "peers", "--engine", "vllm", "--vllm-python", "/nonexistent/python"),
    ],
    ids=[
        "unknown-command",
        "no-command",
        "unknown-bench",
        "zero-repeats",
        "bad-int",
        "router-bad-deployment",
        "up-empty-deployment",
        "no-inline-api-key",
        "acl-without-passwords",
        "drain-zero-timeout",
        "pileup-zero-rate",
        "pileup-bad-rate",
        "serve-not-a-model-folder",
        "demo-vllm-without-its-python",
        "peers-vllm-without-its-python",
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args):
    out = run(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(r"kvmesh( [\w-]+)*: error: ", lines[0]), out.stderr
    assert "Traceback" not in out.stderr
    if "--deployment" in args:
        assert "deployment must be 1 to 128 characters" in lines[0]


def test_up_with_vllm_where_there_is_no_vllm_is_one_line_naming_the_extra(qwen3_dir):
    out = run("up", "--model", f"{qwen3_dir},engine=vllm")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "engine=vllm needs vLLM in" in out.stderr and "kvmesh[vllm]" in out.stderr
    wrong = run("up", "--model", f"{qwen3_dir},engine=vllm", "--vllm-python", "/nonexistent/python")
    assert wrong.returncode == 2 and "/nonexistent/python" in wrong.stderr, wrong.stderr


@pytest.mark.slow  # a subprocess that imports torch and Ray: make test-fast leaves it out
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where there is no CUDA")
def test_bench_engine_cuda_without_cuda_is_a_usage_error():
    out = run("bench", "engine", "--device", "cuda")
    assert (
        out.returncode == 2
        and out.stderr.strip() == "kvmesh: error: --device cuda needs a CUDA machine (none is visible here)"
    )


def test_bench_engine_times_the_model_folder_given(tmp_path, qwen3_dir, monkeypatch):
    """--model: that folder is timed and named in the result, the bench model never built (the
    timing itself is the default run's, above)."""
    from kvmesh.bench import engine as engine_bench

    timed = []
    monkeypatch.setattr(
        engine_bench, "run_cpu", lambda repeats, quick, model_dir, vllm: timed.append(model_dir) or {}
    )
    monkeypatch.setattr(engine_bench, "_print", lambda result: None)
    out_file, cache = tmp_path / "engine.json", tmp_path / "unused"
    assert engine_bench.main(str(out_file), 1, True, "cpu", str(cache), model=str(qwen3_dir)) == 0
    result = json.loads(out_file.read_text())
    layers = json.loads((qwen3_dir / "config.json").read_text())["num_hidden_layers"]
    assert timed == [qwen3_dir] and not cache.exists()
    assert result["model"]["path"] == str(qwen3_dir) and result["model"]["num_hidden_layers"] == layers


@pytest.mark.slow  # a subprocess that imports torch and Ray: make test-fast leaves it out
def test_bench_engine_model_that_is_no_model_folder_is_a_usage_error(tmp_path):
    out = run("bench", "engine", "--model", str(tmp_path))
    assert out.returncode == 2 and out.stderr.strip() == (
        f"kvmesh: error: --model {str(tmp_path)!r} is not a model folder (no config.json)"
    )


@pytest.mark.slow  # a subprocess that imports torch and Ray: make test-fast leaves it out
def test_bench_kvcache_writes_json_with_targets(tmp_path):
    out_file = tmp_path / "bench.json"
    out = run("bench", "kvcache", "--quick", "--repeats", "1", "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    result = json.loads(out_file.read_text())
    assert result["statistic"] == "median"
    cases = {c["case"]: c for c in result["ledger"]}
    assert {"mixed_1024", "rehit_16384"} <= set(cases)
    for case in cases.values():
        assert case["kvmesh_ops_per_s"] > 0 and case["baseline_ops_per_s"] > 0
        assert 0 < case["prefix_hit_rate"] < 1
    assert cases["rehit_16384"]["prefix_hit_rate"] > 0.5  # the trace really is re-hit dominated
    assert {h["num_tokens"] for h in result["hashing"]} == {4096, 32768}
    assert all("met" in t for t in result["targets"])
    assert "rehit_16384" in out.stdout  # the printed table


@pytest.mark.slow
@pytest.mark.bench  # a benchmark command end to end: make test-bench
def test_bench_engine_quick_writes_json(tmp_path):
    out_file = tmp_path / "engine.json"
    cache = tmp_path / "models"
    out = run(
        "bench", "engine", "--quick", "--repeats", "1", "--out", str(out_file), "--cache-dir", str(cache)
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out_file.read_text())
    assert result["model"]["hidden_size"] == 512 and Path(result["model"]["path"]).parent == cache
    t, f = result["throughput"], result["ttft"]
    assert t["kvmesh_tokens_per_s"] > 0 and t["transformers_tokens_per_s"] > 0 and t["output_tokens"] > 0
    assert f["cached_ttft_ms"] > 0 and f["cold_ttft_ms"] > 0
    host = result["ttft_from_host"]  # the shared prefix came back from host memory
    assert host["restored_tokens"] >= 1024 and host["restored_ttft_ms"] > 0 and host["restore_gb_per_s"] > 0
    # the simulator's model, from the engine's own online fit: a 2k-token prefill costs what it took
    from kvmesh.bench.experiments.cost_model import CostModel

    model = CostModel(**result["cost_model"])
    # base and the per-sequence decode price may be fitted at their floor, 0, on a loaded
    # machine (seen in CI: decode_seq_s 0.0): a tiny model's fixed and per-sequence step costs
    # are inside the noise of a --quick run; the prefill price is not, and a 2k-token prefill
    # must cost what it took
    assert model.base_s >= 0 and model.prefill_token_s > 0 and model.decode_seq_s >= 0
    assert 0.2 < model.step_seconds(2000, 0, 2000) / (f["cold_ttft_ms"] / 1e3) < 5
    assert {x["target"] for x in result["targets"]} == {
        "throughput vs transformers generate",
        "TTFT cold / cached (1.75k of 2k cached)",
        "TTFT cold / restored from the host tier (1.75k of 2k)",
    }


@pytest.mark.slow  # a subprocess that imports torch and Ray: make test-fast leaves it out
def test_nothing_the_user_made_is_deleted_or_flushed_without_force(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    out = run("make-tiny-model", str(target), "--hidden", "16", "--layers", "1")
    assert out.returncode == 2 and "--force replaces it" in out.stderr and (target / "notes.txt").is_file()
    out = run("bench", "index", "--redis-url", "redis://127.0.0.1:1/0")
    assert out.returncode == 2 and "FLUSHes the database" in out.stderr
    forced = run("make-tiny-model", str(target), "--hidden", "16", "--layers", "1", "--force")
    assert (
        forced.returncode == 0 and (target / "config.json").is_file() and not (target / "notes.txt").exists()
    )


@pytest.mark.servers
def test_valkey_acl_writes_a_private_file_a_server_starts_with(tmp_path):
    from kvmesh.cluster.embedded_redis import EmbeddedRedis
    from kvmesh.kvcache.index.redis import connect

    for role in ("admin", "router", "replica"):
        (tmp_path / role).write_text(f"{role}-pw-123\n")
    out = run("valkey-acl", "--passwords-dir", str(tmp_path), "--out", str(tmp_path / "users.acl"))
    assert out.returncode == 0, out.stderr
    acl = tmp_path / "users.acl"
    assert acl.stat().st_mode & 0o777 == 0o600 and "router-pw-123" not in acl.read_text()
    with EmbeddedRedis(aclfile=str(acl)) as server:

        async def ping_as(user: str, password: str) -> bool:
            client = connect(server.url, username=user, password=password)
            try:
                return await client.ping()
            finally:
                await client.aclose()

        assert asyncio.run(ping_as("kvmesh-router", "router-pw-123"))


def test_drain_replicas_with_none_here_drains_nothing_and_says_so(tmp_path):
    out = subprocess.run(
        [KVMESH, "drain-replicas", "--timeout", "5"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert out.returncode == 0 and out.stdout.strip() == "drained 0 replica(s)", out.stderr


def test_status_asks_the_router_named_on_the_command_line_even_where_the_environment_names_the_index():
    """Every chart pod has KVMESH_REDIS_URL; `kubectl exec ... kvmesh status --address ...` must
    still ask that router (here: nobody listens, so it says which router it could not read)."""
    from kvmesh.cluster.embedded_redis import free_port

    port = free_port()
    env = {**os.environ, "KVMESH_REDIS_URL": "redis://127.0.0.1:1"}
    out = subprocess.run(
        [KVMESH, "status", "--address", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2 and f"cannot read the router at 127.0.0.1:{port}" in out.stderr, out.stderr
    indexed = subprocess.run([KVMESH, "status"], capture_output=True, text=True, timeout=60, env=env)
    assert indexed.returncode == 2 and "cannot read redis://127.0.0.1:1" in indexed.stderr, indexed.stderr
