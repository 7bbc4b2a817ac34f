"""Layout contract (docs/design.md#layout): top-level folders install as kvmesh.* and nothing generic;
what ships beside the code (the index's Lua library) ships; the image copies every folder."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from parts import PARTS

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    assert config["package-dir"] == {f"kvmesh.{f}": f for f in PARTS}
    on_disk = {
        "kvmesh." + ".".join(init.parent.relative_to(ROOT).parts)
        for folder in PARTS
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert on_disk == listed


def test_every_top_level_python_folder_is_a_package():
    """A new top-level folder of code must be added to PARTS (and so to pyproject)."""
    with_code = {
        p.parent.name
        for p in ROOT.glob("*/__init__.py")
        if not p.parent.name.startswith(".") and p.parent.name not in ("tests",)
    }
    assert with_code == set(PARTS)


def test_package_data_is_next_to_the_code_that_reads_it():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-data"]["kvmesh.kvcache.index"] == ["*.lua"]
    code = "from importlib import resources; print(resources.files('kvmesh.kvcache.index').joinpath('redis.lua').is_file())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_the_image_copies_every_package_folder():
    text = (ROOT / "helm" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \1$", text, flags=re.M))
    assert copied == set(PARTS)


def test_installed_names_are_namespaced(tmp_path):
    code = (
        "import importlib.util, kvmesh.kvcache, kvmesh.router, kvmesh.cli.main;"
        "print([n for n in ('router', 'cluster', 'kvcache', 'engine', 'replica', 'protos', 'serving') if importlib.util.find_spec(n)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
