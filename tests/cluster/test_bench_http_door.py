"""``kvmesh bench http-door`` as users run it: both protocols measured in one run, each kind's
ratio a target."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

KVMESH = str(Path(sys.executable).with_name("kvmesh"))


@pytest.mark.servers
@pytest.mark.slow
def test_bench_http_door_measures_both_protocols_and_writes_targets(tmp_path):
    out = tmp_path / "door.json"
    run = subprocess.run(
        [KVMESH, "bench", "http-door", "--requests", "50", "--rounds", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["kinds"]) == {"GET", "POST 1 KiB"}
    for row in result["kinds"].values():
        assert row["plain"] > 0 and row["door"] > 0 and len(row["rounds_us"]["door"]) == 2
    assert [t["target"].split(":")[0] for t in result["targets"]] == ["GET", "POST 1 KiB"]
    bad = subprocess.run([KVMESH, "bench", "http-door", "--rounds", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
