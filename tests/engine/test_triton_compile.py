"""The Triton kernels compile for the GPUs kvmesh is deployed on (sm_90: H100, H200) with
Triton's own compiler, here, with no GPU: the interpreter the other kernel tests run in checks
none of what only the compiler does (``tests/support/triton_compile.py``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "triton_compile.py"


@pytest.mark.slow
def test_the_kernels_compile_for_hopper(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}  # compiled afresh
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "90"], env=env, capture_output=True, text=True, timeout=600
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(lines) >= 14 and all(line.startswith("ok ") for line in lines)
