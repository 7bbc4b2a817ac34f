"""Layout contract (DESIGN §1): top-level folders install as kvmesh.* and nothing generic."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ["kvcache", "replica", "router", "cluster", "protos"]


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    assert config["package-dir"] == {f"kvmesh.{f}": f for f in FOLDERS}
    on_disk = {
        "kvmesh." + ".".join(init.parent.relative_to(ROOT).parts)
        for folder in FOLDERS
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert on_disk == listed


def test_installed_names_are_namespaced(tmp_path):
    code = (
        "import importlib.util, kvmesh.kvcache, kvmesh.router, kvmesh.cluster.cli;"
        "print([n for n in ('router', 'cluster', 'kvcache', 'replica', 'protos') if importlib.util.find_spec(n)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_kvcache_never_imports_torch(tmp_path):
    code = "import sys, kvmesh.kvcache; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
