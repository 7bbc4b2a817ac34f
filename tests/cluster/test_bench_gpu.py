"""`kvmesh bench gpu` (`make gpu-check`'s run) kept working between GPU leases: the same code
on the CPU and a tiny model, its test counter, and its roofline arithmetic."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.bench.gpu import run_tests, step_roofline
from kvmesh.engine import LLMEngine

KVMESH = str(Path(sys.executable).with_name("kvmesh"))


@pytest.mark.slow
@pytest.mark.bench  # `kvmesh bench gpu` end to end on a small load, as every bench command's smoke run
def test_the_device_run_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    argv = [KVMESH, "bench", "gpu", "--device", "cpu", "--quick", "--no-tests", "--out", str(out)]
    argv += ["--cache-dir", str(tmp_path / "models")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["limits"]["copy_bytes_per_s"] > 0 and result["limits"]["matmul_flops_per_s"] > 0
    passes = [(r["async_scheduling"], r["batch"]) for r in result["decode"]]
    assert passes == [(True, 1), (True, 4), (False, 1), (False, 4)]  # async on and off
    assert all(r["host_stages_ms"]["land_ms"] > 0 for r in result["decode"] if r["async_scheduling"])
    assert all(0 < r["share_of_limit"] < 1 and r["roofline"]["floor_ms"] > 0 for r in result["decode"])
    assert result["ttft"]["all_but_last_block"][0]["cached_tokens"] == 128 - 16
    host = result["ttft"]["2k_1792_from_host"]  # the prefix restored from the host tier, and how fast
    assert host["restored_tokens"] >= 1024 and host["restore_share_of_limit"] > 0
    assert result["limits"]["host_to_device_bytes_per_s"] > 0
    serving = result["serving"]
    assert serving["requests"] == 8 and serving["hit_rate"] >= 0.9 * serving["ideal_hit_rate"] > 0
    assert {t["target"] for t in result["targets"]} >= {"serving hit rate of its ideal"}


@pytest.mark.slow
def test_the_test_counter_reads_pytests_own_report(tmp_path):
    tests = tmp_path / "test_three.py"
    tests.write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert False\n"
        "@pytest.mark.skip(reason='no')\n"
        "def test_skips(): pass\n"
    )
    counted = run_tests(tmp_path / "out", ["test_three.py"], root=tmp_path)
    assert (counted["tests"], counted["skipped"], counted["exit_code"]) == (3, 1, 1)
    assert counted["failed"] == ["test_three::test_fails"] and "assert False" in counted["tail"]


def test_a_steps_roofline_counts_its_weights_once_and_its_kv_per_row(qwen3_dir):
    engine = LLMEngine(qwen3_dir, num_kv_blocks=16, block_size=16)
    spec = engine.runner.model.spec
    limits = {"copy_bytes_per_s": 1e9, "matmul_flops_per_s": 1e18}  # memory-bound by construction
    one, two = step_roofline(engine, 1, 100, limits), step_roofline(engine, 2, 100, limits)
    per_row_kv = 100 * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4  # fp32
    assert one["kv_bytes"] == per_row_kv and two["kv_bytes"] == 2 * per_row_kv
    assert one["weight_bytes"] == two["weight_bytes"] and one["bound"] == "memory"
    assert one["floor_ms"] == pytest.approx((one["weight_bytes"] + per_row_kv) / 1e9 * 1e3, abs=1e-3)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_step_stages_add_up_and_leave_the_engine_as_it_was(qwen3_dir, overlap):
    from kvmesh.bench.step_stages import STAGES, _timed_stages, decoding, step_stages
    from kvmesh.engine import model_runner, sampler
    from kvmesh.engine.launched import LaunchedStep

    land = LaunchedStep.land
    engine = LLMEngine(qwen3_dir, num_kv_blocks=64, block_size=16, max_num_seqs=8, async_scheduling=overlap)
    with decoding(engine, 4, 40, 4):
        steps = _timed_stages(engine, 4)
    # the outputs stage is the step less the others: a stage timed twice would turn it negative
    assert all(step[s] >= 0 for step in steps for s in STAGES)
    # every step samples, and syncs once: right after sampling, or for the step before
    assert all(step["model"] > 0 and step["sample"] > 0 and step["land"] > 0 for step in steps)
    row = step_stages(engine, 4, 40, 3)
    assert row["batch"] == 4 and all(row[f"{s}_ms"] >= 0 for s in STAGES)
    assert model_runner.draw is sampler.draw
    assert LaunchedStep.land is land and "_forward_layout" not in vars(engine.runner)
    assert "forward" not in vars(engine.runner.model) and "schedule" not in vars(engine.scheduler)
    while engine.has_unfinished_requests() or engine._in_flight:
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
