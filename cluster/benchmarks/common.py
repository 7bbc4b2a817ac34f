"""What every benchmark shares: median timing, targets as ratios, environment, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
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
