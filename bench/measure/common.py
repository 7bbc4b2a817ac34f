"""What every benchmark shares: median timing, targets as ratios, summaries over repeats,
environment, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def target(name: str, value: float, op: str, bound: float, detail: str | None = None) -> dict:
    """A performance target, checked against a value measured in the same run."""
    if op not in (">=", "<="):
        raise ValueError(f"a target's bound is '>=' or '<=', not {op!r}")
    met = value >= bound if op == ">=" else value <= bound
    result = {"target": name, "value": value, "bound": f"{op} {bound}", "met": met}
    if detail is not None:
        result["detail"] = detail
    return result


def environment(**extra: str) -> dict:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        **extra,
    }


def progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def write_result(out: str, result: dict) -> None:
    """Write the JSON result and print the targets, met or missed."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print()
    for t in result.get("targets", []):
        print(f"{'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']} (target {t['bound']})")
    print(f"\nwrote {out}")


def over_repeats(rows: Sequence[dict], by: Sequence[str], metrics: Sequence[str]) -> list[dict]:
    """One row per distinct value of the ``by`` fields: how many runs it had and each
    metric's median, min and max over them (a metric no run has is left out)."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault(tuple(r[k] for k in by), []).append(r)
    summary = []
    for key, runs in sorted(cells.items()):
        row = dict(zip(by, key, strict=True)) | {"runs": len(runs)}
        for metric in metrics:
            values = [r[metric] for r in runs if r.get(metric) is not None]
            if values:
                row[f"{metric}_median"] = round(statistics.median(values), 4)
                row[f"{metric}_min"], row[f"{metric}_max"] = min(values), max(values)
        summary.append(row)
    return summary
