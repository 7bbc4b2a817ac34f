"""The documentation holds together: every relative link in README.md, docs/*.md and the
chart's README reaches a file that exists, every ``#anchor`` names a heading of its target
(GitHub's rules), README.md stays a short front door, and nothing cites a design document
outside the repository. Reads files only; starts nothing."""

import functools
import json
import re
import subprocess
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "helm" / "kvmesh" / "README.md"]
README_MAX_LINES = 250
README_OPENING = "# kvmesh\n\n```\nmake demo\nmake test\n```\n"

# Built by concatenation so that this file does not match itself.
FOREIGN_DESIGN = ("shared/" + "DESIGN", "DESIGN " + "\u00a7")

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def heading_text(raw: str) -> str:
    """A heading's text as GitHub renders it: code spans keep their content, links their
    text, emphasis markers and HTML tags go."""
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("*", "")


def slug(text: str) -> str:
    """GitHub's anchor for a heading: lowercase, drop every character that is not a letter,
    mark, digit, connector (``_``), hyphen or space, then spaces become hyphens."""
    kept = "".join(
        ch for ch in text.lower() if ch in " -" or unicodedata.category(ch)[0] in "LMN" or ch == "_"
    )
    return kept.replace(" ", "-")


@functools.cache  # a page is read once however many links point into it
def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of a markdown file (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(heading_text(match.group(2)))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path: Path):
    """(line number, target) of every link and image in a page's prose (code left out)."""
    for number, line in prose_lines(path.read_text()):
        ref = REFERENCE_LINK.match(line)
        if ref:
            yield number, ref.group(1)
            continue
        for match in INLINE_LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, match.group(1)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for number, target in links(path):
        if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            problems.append(f"{where}: no heading with this anchor in {dest.relative_to(root)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    assert page.is_file()
    assert broken_links(page) == []


def test_link_checker_catches_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## The hash contract (`kvmesh.kvcache`)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Same\n\n## Same\n\n"
        "[ok](other.md#the-hash-contract-kvmeshkvcache) [ok](#same-1) [ok](https://example.com/x.md)\n"
        "[gone](missing.md) [bad](other.md#the-hash-contract) [bad](#same-2)\n"
        "```\n[in code](nowhere.md)\n```\n`[in a span](nowhere.md)`\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md: no such file",
        "other.md#the-hash-contract: no heading with this anchor in other.md",
        "#same-2: no heading with this anchor in page.md",
    ]


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("The hash contract (`kvmesh.kvcache.hashing`)", "the-hash-contract-kvmeshkvcachehashing"),
        ("Kubernetes (`helm/kvmesh`)", "kubernetes-helmkvmesh"),
        ("Experiments: which policy wins, by how much", "experiments-which-policy-wins-by-how-much"),
        ("Where the router's CPU goes", "where-the-routers-cpu-goes"),
        ("`kvmesh_router_fleet_sync_seconds` and **W1-W5**", "kvmesh_router_fleet_sync_seconds-and-w1-w5"),
        ("The bundled Valkey's memory", "the-bundled-valkeys-memory"),
    ],
)
def test_anchors_follow_githubs_rules(heading, anchor):
    assert slug(heading_text(heading)) == anchor


def test_readme_is_a_short_front_door():
    text = README.read_text()
    assert text.startswith(README_OPENING), "README.md must still open with `make demo` and `make test`"
    lines = len(text.splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    )


def test_readme_maps_every_docs_page():
    linked = {target.partition("#")[0] for _, target in links(README)}
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in linked, f"README.md's map of docs/ lacks {page.name}"


def repository_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed.split("\0") if name]


def test_nothing_cites_a_design_outside_the_repository():
    offenders = []
    for path in repository_files():
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "docs" and path.suffix != ".md":  # results data, plots
            continue
        if not path.is_file():  # deleted in the work tree
            continue
        data = path.read_bytes()
        offenders += [f"{rel}: {needle}" for needle in FOREIGN_DESIGN if needle.encode() in data]
    assert offenders == [], "cite docs/design.md instead"


def test_the_benchmarks_page_shows_every_committed_runs_targets_as_its_json_has_them():
    from kvmesh.bench.docs_page import BEGIN, PAGE, render

    page = PAGE.read_text()
    assert BEGIN in page, "run: python -m kvmesh.bench.docs_page"
    assert page == render(page), "docs/benchmarks.md is stale: python -m kvmesh.bench.docs_page"
    for name in ("bench_router.json", "bench_peers.json", "bench_soak.json", "fidelity.json"):
        assert f"### [{name}]({name})" in page


def test_the_readme_headline_is_rendered_from_the_committed_runs(tmp_path):
    from kvmesh.bench.readme import BEGIN, README, render

    readme = README.read_text()
    assert BEGIN in readme, "the README lost its generated block's markers"
    assert readme == render(readme), "README.md is stale: python -m kvmesh.bench.readme"
    docs = tmp_path / "docs"  # a rerun's JSON changes what it renders
    docs.mkdir()
    for name in ("demo.json", "bench_engine.json", "bench_engine_cuda.json"):
        (docs / name).write_text((README.parent / "docs" / name).read_text())
    demo = json.loads((docs / "demo.json").read_text())
    demo["prefix"]["summary"]["hit_rate"] = 0.123
    (docs / "demo.json").write_text(json.dumps(demo))
    assert "0.123" in render(readme, docs) and "0.123" not in readme
