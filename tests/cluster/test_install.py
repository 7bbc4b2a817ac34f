"""The plain install (no extras) runs every serving command. CI and this suite install the
``test`` extra, so here the packages that only the extras bring are made unimportable in a
subprocess; ``.ci/run`` also installs the project into a fresh venv without extras."""

import contextlib
import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, requires

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

EXTRAS = ("experiments", "test", "gpu")
SERVER_MODULES = [
    "kvmesh.router.process",
    "kvmesh.replica.process",
    "kvmesh.replica.actor",
    "kvmesh.engine.models.tiny_model",
    "kvmesh.cluster.launcher",
    "kvmesh.cluster.supervisor",
    "kvmesh.cli.status",
]


def _closure(requirements: list[Requirement], extra: str = "") -> set[str]:
    """Installed distributions these requirements pull in, transitively."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name in seen or name == "kvmesh":
            continue
        seen.add(name)
        with contextlib.suppress(PackageNotFoundError):  # not installed: nothing to walk
            todo += [Requirement(r) for r in requires(req.name) or [] if "extra ==" not in r]
    return seen


def extras_only_modules() -> list[str]:
    """Top-level import names of the distributions only the extras bring."""
    own = [Requirement(r) for r in requires("kvmesh")]
    base = _closure([r for r in own if not r.marker])
    extra = set()
    for name in EXTRAS:
        extra |= _closure([r for r in own if r.marker and r.marker.evaluate({"extra": name})], name)
    modules = {"flash_attn"}  # the gpu extra is not installed here; it must stay optional anyway
    for dist_name in extra - base:
        try:
            dist = distribution(dist_name)
        except PackageNotFoundError:
            continue
        top = dist.read_text("top_level.txt")
        names = top.split() if top else {f.parts[0].removesuffix(".py") for f in dist.files or [] if f.parts}
        modules |= {n for n in names if n.isidentifier() and not n.startswith("_")}
    return sorted(modules)


BLOCKER = """
import importlib.abc, sys
BLOCKED = set({blocked!r})
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (only an extra provides it)", name=name)
        return None
sys.meta_path.insert(0, Blocked())
"""


def run_without_extras(code: str, tmp_path) -> subprocess.CompletedProcess:
    blocked = extras_only_modules()
    return subprocess.run(
        [sys.executable, "-c", BLOCKER.format(blocked=blocked) + code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )


def test_the_extras_bring_what_serving_never_needs():
    blocked = set(extras_only_modules())
    assert {"matplotlib", "httpx", "pytest", "hypothesis"} <= blocked
    assert not blocked & {
        "torch",
        "ray",
        "grpc",
        "redis",
        "transformers",
        "fastapi",
        "pydantic",
        "huggingface_hub",
    }


@pytest.mark.slow  # a subprocess that imports torch and Ray: make test-fast leaves it out
def test_every_command_and_server_module_imports_without_extras(tmp_path):
    code = f"""
import importlib, pkgutil, json
import kvmesh.cli.commands as commands
names = [f"kvmesh.cli.commands.{{m.name}}" for m in pkgutil.iter_modules(commands.__path__)]
for name in names + {SERVER_MODULES!r}:
    importlib.import_module(name)
print(json.dumps(names))
"""
    out = run_without_extras(code, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "kvmesh.cli.commands.up" in json.loads(out.stdout)


@pytest.mark.parametrize(
    "argv, code, hint",
    [
        (["--help"], 0, None),
        (["up", "--help"], 0, None),
        (["router", "--help"], 0, None),
        (["status", "--help"], 0, None),
        (["demo"], 2, "pip install 'kvmesh[experiments]'"),
        (["report", "run.jsonl"], 2, "pip install 'kvmesh[experiments]'"),
        (["bench", "peers"], 2, "pip install 'kvmesh[experiments]'"),
    ],
    ids=["help", "up", "router", "status", "demo", "report", "bench-peers"],
)
def test_commands_without_extras_run_or_name_the_extra(argv, code, hint, tmp_path):
    out = run_without_extras(
        f"import sys\nfrom kvmesh.cli.main import main\nsys.exit(main({argv!r}))", tmp_path
    )
    assert out.returncode == code, out.stderr[-2000:]
    if hint:
        assert out.stderr.strip().count("\n") == 0 and hint in out.stderr and "Traceback" not in out.stderr
