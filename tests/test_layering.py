"""The import rules between the parts (docs/design.md#layout), read from the source and checked at run time.

kvcache, protos <- serving <- router, engine <- replica <- cluster <- bench <- cli: kvcache
imports nothing of ours; serving imports only kvcache and protos; router never imports engine,
replica, torch or ray; the engine never imports replica; replica never imports router, and its
vLLM adapter sees only the engine's face (protocol, config, step-cost fit); cluster (launching, supervising) imports neither bench nor cli;
bench (measuring) never imports cli; nothing imports cli. Inside bench, the measuring kit
(``bench/measure``) imports nothing else of bench, and the experiments (``bench/experiments``)
only the kit. The engine's kernels import nothing of ours, and only they import Triton.
Imports inside functions count too.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from parts import PARTS

ROOT = Path(__file__).resolve().parent.parent
HEAVY = {"torch", "ray", "transformers", "flash_attn"}  # transformers imports torch when present
# ...except its chat-template renderer, which imports neither torch nor the tokenizer classes:
# the router renders chats with it (the run-time test below proves torch stays out).
LIGHT_EXCEPTIONS = {"serving": {"transformers.utils.chat_template_utils"}}

# part -> kvmesh parts it may import (itself always), and third-party roots it must not.
ALLOWED = {
    "kvcache": ({"kvcache"}, HEAVY | {"grpc"}),
    "protos": ({"protos"}, HEAVY),
    "serving": ({"kvcache", "protos", "serving"}, HEAVY),
    "router": ({"kvcache", "protos", "serving", "router"}, HEAVY),
    "engine": ({"kvcache", "protos", "serving", "engine"}, set()),
    "replica": ({"kvcache", "protos", "serving", "engine", "replica"}, set()),
    "cluster": ({"kvcache", "protos", "serving", "router", "engine", "replica", "cluster"}, set()),
    "bench": (set(PARTS) - {"cli"}, set()),
    "cli": (set(PARTS), set()),
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


def imports_under(root: Path, folder: str):
    """(file relative to ``root``, module it imports) for every file below ``root/folder``."""
    for path in sorted((root / folder).rglob("*.py")):
        package = "kvmesh." + ".".join(path.relative_to(root).with_suffix("").parts[:-1])
        for name in sorted(imports_of(path, package)):
            yield path.relative_to(root), name


def violations(root: Path) -> list[str]:
    out = []
    for part in PARTS:
        allowed, forbidden = ALLOWED[part]
        for path, name in imports_under(root, part):
            top = name.split(".")[0]
            if name.startswith("kvmesh."):
                if name.split(".")[1] not in allowed:
                    out.append(f"{path} imports {name}")
            elif top in forbidden and name not in LIGHT_EXCEPTIONS.get(part, ()):
                out.append(f"{path} imports {top}")
    return out


def test_every_part_keeps_to_its_imports():
    assert violations(ROOT) == []


def kernel_violations(root: Path) -> list[str]:
    """The engine's kernels (``engine/kernels``) import nothing of kvmesh, and only they
    import Triton (absent from a plain install)."""
    out = []
    for part in PARTS:
        for path, name in imports_under(root, part):
            inside = path.parts[:2] == ("engine", "kernels")
            if (inside and name.startswith("kvmesh.")) or (not inside and name.split(".")[0] == "triton"):
                out.append(f"{path} imports {name}")
    return out


def test_only_the_kernels_import_triton_and_they_import_nothing_of_ours(tmp_path):
    assert kernel_violations(ROOT) == []
    for part in PARTS:
        (tmp_path / part).mkdir()
    (tmp_path / "engine" / "kernels").mkdir()
    (tmp_path / "engine" / "kernels" / "k.py").write_text("from kvmesh.engine.llm_engine import LLMEngine\n")
    (tmp_path / "engine" / "runner.py").write_text("def f():\n    import triton.language\n")
    assert kernel_violations(tmp_path) == [
        "engine/kernels/k.py imports kvmesh.engine.llm_engine",
        "engine/runner.py imports triton.language",
    ]


# bench's folders -> the bench modules they may import (a top-level bench module is a benchmark)
BENCH_ALLOWED = {"measure": {"measure"}, "experiments": {"measure", "experiments"}}


def bench_violations(root: Path) -> list[str]:
    out = []
    for folder, allowed in BENCH_ALLOWED.items():
        for path, name in imports_under(root, f"bench/{folder}"):
            parts = name.split(".")
            if parts[:2] == ["kvmesh", "bench"] and len(parts) > 2 and parts[2] not in allowed:
                out.append(f"{path} imports {name}")
    return out


def test_measure_experiments_and_benchmarks_import_one_way():
    assert bench_violations(ROOT) == []


def test_the_bench_checker_sees_a_backward_import(tmp_path):
    (tmp_path / "bench" / "experiments").mkdir(parents=True)
    (tmp_path / "bench" / "measure").mkdir(parents=True)
    (tmp_path / "bench" / "experiments" / "late.py").write_text(
        "def f():\n    from kvmesh.bench.peers import DEFAULT_LOAD\n"
    )
    (tmp_path / "bench" / "measure" / "kit.py").write_text("from kvmesh.bench.experiments import simulator\n")
    assert bench_violations(tmp_path) == [
        "bench/measure/kit.py imports kvmesh.bench.experiments",
        "bench/experiments/late.py imports kvmesh.bench.peers",
    ]


# a folder inside a part -> the kvmesh modules it must not import, and the exceptions among them
INNER_FORBIDDEN = {
    "engine/models": (("kvmesh.engine",), ("kvmesh.engine.models", "kvmesh.engine.kernels")),
    # the vLLM adapter keeps the engine's face and imports nothing else of kvmesh's engine
    "replica/vllm": (
        ("kvmesh.engine",),
        ("kvmesh.engine.protocol", "kvmesh.engine.config", "kvmesh.engine.step_costs"),
    ),
    "kvcache/index": (("kvmesh.kvcache.block_manager",), ()),
}


def inner_violations(root: Path) -> list[str]:
    return [
        f"{path} imports {name}"
        for folder, (forbidden, allowed) in INNER_FORBIDDEN.items()
        for path, name in imports_under(root, folder)
        if name.startswith(forbidden) and not (allowed and name.startswith(allowed))
    ]


def test_the_engine_core_and_the_models_keep_to_their_side():
    assert inner_violations(ROOT) == []


def test_the_inner_checker_sees_the_adapter_reach_past_the_face(tmp_path):
    (tmp_path / "replica" / "vllm").mkdir(parents=True)
    (tmp_path / "replica" / "vllm" / "a.py").write_text(
        "from kvmesh.engine.protocol import RequestOutput\nfrom kvmesh.engine.llm_engine import EngineStats\n"
    )
    (tmp_path / "engine" / "models").mkdir(parents=True)
    (tmp_path / "engine" / "models" / "m.py").write_text(
        "from kvmesh.engine.models import layers\nfrom kvmesh.engine.scheduler import Scheduler\n"
    )
    (tmp_path / "kvcache" / "index").mkdir(parents=True)
    assert inner_violations(tmp_path) == [
        "engine/models/m.py imports kvmesh.engine.scheduler",
        "replica/vllm/a.py imports kvmesh.engine.llm_engine",
    ]


def test_every_folder_says_what_it_owns():
    """Each package folder's __init__.py opens with a docstring."""
    missing = []
    for part in PARTS:
        for init in sorted((ROOT / part).rglob("__init__.py")):
            if "/v1/" in str(init) or init.parent.name == "kvmesh":  # generated protobuf stubs
                continue
            tree = ast.parse(init.read_text())
            if not ast.get_docstring(tree):
                missing.append(str(init.relative_to(ROOT)))
    assert missing == []


def test_the_checker_sees_a_forbidden_import(tmp_path):
    """The walk must find imports anywhere in a file, lazy ones included."""
    for part in PARTS:
        (tmp_path / part).mkdir()
    (tmp_path / "router" / "sneaky.py").write_text(
        "def later():\n    from kvmesh.engine.llm_engine import LLMEngine\n    import torch.nn\n"
    )
    (tmp_path / "kvcache" / "sub").mkdir()
    (tmp_path / "kvcache" / "sub" / "rel.py").write_text("from ...serving import errors\n")
    assert violations(tmp_path) == [
        "kvcache/sub/rel.py imports kvmesh.serving",
        "router/sneaky.py imports kvmesh.engine.llm_engine",
        "router/sneaky.py imports torch",
    ]


@pytest.mark.parametrize(
    ("modules", "renders_chat"),
    [
        (["kvmesh.kvcache", "kvmesh.kvcache.index.redis"], False),
        (["kvmesh.router.process", "kvmesh.serving.openai.app"], True),
        (["kvmesh.cli.main", "kvmesh.cli.commands.router"], True),
    ],
    ids=["kvcache", "router-process", "cli"],
)
def test_router_side_processes_never_load_torch_or_ray(modules, renders_chat, tmp_path, qwen3_dir):
    """At run time too: a router process (and the CLI that starts it) holds no torch or Ray,
    even after rendering a chat template with transformers' renderer; kvcache not even that."""
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
    heavy = HEAVY
    if renders_chat:
        heavy = HEAVY - {"transformers"}
        code += (
            "from kvmesh.serving.tokenizer import PromptTokenizer\n"
            f"ids = PromptTokenizer({str(qwen3_dir)!r}).render_chat([{{'role': 'user', 'content': 'hi'}}])\n"
            "assert ids, ids\n"
        )
    code += f"print(sorted(n for n in {sorted(heavy)!r} if n in sys.modules))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
