"""The import rules between the parts (DESIGN §1), read from the source and checked at run time.

kvcache, protos <- serving <- router, replica <- cluster: kvcache imports nothing of ours;
serving imports only kvcache and protos; router never imports replica, torch or ray;
replica never imports router; nothing imports cluster. Imports inside functions count too.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ["kvcache", "protos", "serving", "router", "replica", "cluster"]
HEAVY = {"torch", "ray", "transformers", "flash_attn"}  # transformers imports torch when present

# part -> kvmesh parts it may import (itself always), and third-party roots it must not.
ALLOWED = {
    "kvcache": ({"kvcache"}, HEAVY | {"grpc"}),
    "protos": ({"protos"}, HEAVY),
    "serving": ({"kvcache", "protos", "serving"}, HEAVY),
    "router": ({"kvcache", "protos", "serving", "router"}, HEAVY),
    "replica": ({"kvcache", "protos", "serving", "replica"}, set()),
    "cluster": (set(PARTS), set()),
}


def imports_of(path: Path, package: str) -> set[str]:
    """Every module a file imports, relative imports resolved against ``package``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            else:
                found.add(node.module)
    return found


def violations(root: Path) -> list[str]:
    out = []
    for part in PARTS:
        allowed, forbidden = ALLOWED[part]
        for path in sorted((root / part).rglob("*.py")):
            package = "kvmesh." + ".".join(path.relative_to(root).with_suffix("").parts[:-1])
            for name in sorted(imports_of(path, package)):
                top = name.split(".")[0]
                if name.startswith("kvmesh."):
                    target = name.split(".")[1]
                    if target not in allowed:
                        out.append(f"{path.relative_to(root)} imports {name}")
                elif top in forbidden:
                    out.append(f"{path.relative_to(root)} imports {top}")
    return out


def test_every_part_keeps_to_its_imports():
    assert violations(ROOT) == []


def test_the_checker_sees_a_forbidden_import(tmp_path):
    """The walk must find imports anywhere in a file, lazy ones included."""
    for part in PARTS:
        (tmp_path / part).mkdir()
    (tmp_path / "router" / "sneaky.py").write_text(
        "def later():\n    from kvmesh.replica.engine import LLMEngine\n    import torch.nn\n"
    )
    (tmp_path / "kvcache" / "sub").mkdir()
    (tmp_path / "kvcache" / "sub" / "rel.py").write_text("from ...serving import errors\n")
    assert violations(tmp_path) == [
        "kvcache/sub/rel.py imports kvmesh.serving",
        "router/sneaky.py imports kvmesh.replica.engine",
        "router/sneaky.py imports torch",
    ]


@pytest.mark.parametrize(
    "modules",
    [
        ["kvmesh.kvcache", "kvmesh.kvcache.index"],
        ["kvmesh.router.process", "kvmesh.serving.openai_app"],
        ["kvmesh.cluster.cli", "kvmesh.cluster.commands.router"],
    ],
    ids=["kvcache", "router-process", "cli"],
)
def test_router_side_processes_never_load_torch_or_ray(modules, tmp_path):
    """At run time too: a router process (and the CLI that starts it) holds no torch or Ray."""
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(n for n in {sorted(HEAVY)!r} if n in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
