"""Rules of style the package keeps (docs/development.md): no function over 80 lines, and no
docstring quoting a measured figure (they go stale with every rerun: numbers live in the
benchmarks' JSON and docs/benchmarks.md)."""

import ast
import re
from pathlib import Path

from parts import PARTS

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80
# a number with a unit of time, rate or bandwidth: a measurement, not a setting
MEASURED = re.compile(r"\b\d[\d,.]*\s?(ms|us|µs|tok/s|tokens/s|req/s|[KMGT]B/s)(?![\w/])")


def package_trees(root: Path):
    for part in PARTS:
        for path in sorted((root / part).rglob("*.py")):
            if "_pb2" not in path.name:
                yield path.relative_to(root), ast.parse(path.read_text())


def long_functions(root: Path) -> list[str]:
    return [
        f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, tree in package_trees(root)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def measured_docstrings(root: Path) -> list[str]:
    found = []
    for path, tree in package_trees(root):
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                for match in MEASURED.finditer(ast.get_docstring(node) or ""):
                    found.append(f"{path}:{getattr(node, 'lineno', 1)} {match.group(0)!r}")
    return found


def test_no_function_is_over_80_lines():
    assert long_functions(ROOT) == []


def test_no_docstring_quotes_a_measured_figure():
    assert measured_docstrings(ROOT) == []


def test_the_checks_see_what_they_look_for(tmp_path):
    (tmp_path / "serving").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    (tmp_path / "serving" / "long.py").write_text(
        f'def long():\n    """It took 0.3 ms here, at 1,454 tok/s."""\n{body}\n\n\ndef short():\n    """A 2 s TTL."""\n'
    )
    for part in PARTS[1:]:
        (tmp_path / part).mkdir(exist_ok=True)
    assert long_functions(tmp_path) == ["serving/long.py:1 long (82 lines)"]
    assert measured_docstrings(tmp_path) == ["serving/long.py:1 '0.3 ms'", "serving/long.py:1 '1,454 tok/s'"]


# The glossary's retired words (docs/design.md#glossary): none may come back into the package.
RETIRED = re.compile(
    r"IndexHealth|index[ _]health|RequestFailedError|index[ _-]truth|index's truth|kvmesh\.router\.models"
    r"|fleet[ _-]load"
)


def retired_words(root: Path) -> list[str]:
    return [
        f"{path.relative_to(root)}:{number}: {match.group(0)}"
        for part in PARTS
        for path in sorted((root / part).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        for match in RETIRED.finditer(line)
    ]


def test_no_retired_word_is_back():
    assert retired_words(ROOT) == []


def test_the_glossary_names_what_was_retired():
    design = (ROOT / "docs" / "design.md").read_text()
    assert "## Glossary" in design
    for word in (
        "index truth",
        "IndexHealthConfig",
        "ReplicaIndexHealth",
        "RequestFailedError",
        "two `LocalCluster` classes",
    ):
        assert word in design


def folder_shares(root: Path) -> dict[str, float]:
    """Each part's share of the package's lines (generated protobuf modules aside)."""
    lines = {
        part: sum(
            len(path.read_text().splitlines())
            for path in (root / part).rglob("*.py")
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
        )
        for part in PARTS
    }
    total = sum(lines.values())
    return {part: n / total for part, n in lines.items()}


def test_no_folder_holds_more_than_30_percent_of_the_package():
    shares = folder_shares(ROOT)
    assert max(shares.values()) <= 0.30, shares
    assert len(shares) == len(PARTS) and min(shares.values()) > 0
