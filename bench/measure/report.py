"""Summaries of load-generator runs: hit rate vs ceiling, latency percentiles, throughput,
goodput, balance, index accuracy, router overhead; markdown tables and plots.

A run is a JSONL file: a first ``{"meta": {...}}`` line (workload, policy, rate, ceiling),
then one record per request (``RequestRecord.as_dict``).
"""

from __future__ import annotations

import collections
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from kvmesh.bench.measure.loadgen import RequestRecord
from kvmesh.bench.measure.stats import percentile


def _ms(values: Sequence[float], q: float) -> float:
    return round(percentile(values, q) * 1e3, 1)


def summarize(
    records: Sequence[RequestRecord], slo_ttft_ms: float = 1000.0, ceiling: float | None = None
) -> dict:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    latency = [r.done_s - r.sent_s for r in ok if r.done_s is not None]
    tpot = [(r.done_s - r.first_token_s) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    predicted = sum(r.predicted_cached_tokens for r in ok)
    span = max((r.done_s for r in ok), default=0.0) - min((r.sent_s for r in ok), default=0.0)
    per_replica = collections.Counter(r.replica_id for r in ok)
    uncached = collections.Counter()
    for r in ok:
        uncached[r.replica_id] += r.prompt_tokens - r.cached_tokens
    loads = list(uncached.values())
    mean_load = statistics.mean(loads) if loads else 0.0
    decision = [r.router_decision_us for r in ok if r.router_decision_us]
    within_slo = sum(1 for t in ttft if t * 1e3 <= slo_ttft_ms)
    out = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "predicted_hit_rate": round(predicted / prompt, 4) if prompt else 0.0,
        "index_accuracy": round(1 - abs(predicted - cached) / max(cached, predicted, 1), 4),
        "ttft_p50_ms": _ms(ttft, 0.5),
        "ttft_p90_ms": _ms(ttft, 0.9),
        "ttft_p99_ms": _ms(ttft, 0.99),
        "tpot_p50_ms": _ms(tpot, 0.5),
        "tpot_p90_ms": _ms(tpot, 0.9),
        "tpot_p99_ms": _ms(tpot, 0.99),
        "latency_p50_ms": _ms(latency, 0.5),
        "latency_p90_ms": _ms(latency, 0.9),
        "latency_p99_ms": _ms(latency, 0.99),
        "output_tokens_per_s": round(sum(r.completion_tokens for r in ok) / span, 1) if span > 0 else 0.0,
        "goodput_req_per_s": round(within_slo / span, 3) if span > 0 else 0.0,
        "slo_ttft_ms": slo_ttft_ms,
        "requests_per_replica": dict(sorted(per_replica.items())),
        "load_imbalance_max_over_mean": round(max(loads) / mean_load, 3) if mean_load else 0.0,
        "load_cv": round(statistics.pstdev(loads) / mean_load, 3) if mean_load else 0.0,
        "router_decision_p50_us": round(percentile(decision, 0.5)) if decision else None,
        "router_decision_p99_us": round(percentile(decision, 0.99)) if decision else None,
    }
    if ceiling is not None:
        out["hit_rate_ceiling"] = round(ceiling, 4)
    return out


def write_run(path: Path, meta: dict, records: Sequence[RequestRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for r in records:
            f.write(json.dumps(r.as_dict()) + "\n")


def read_run(path: Path) -> tuple[dict, list[RequestRecord]]:
    lines = path.read_text().splitlines()
    if not lines or "meta" not in json.loads(lines[0]):
        raise ValueError(f"{path}: not a kvmesh run (no meta line)")
    return json.loads(lines[0])["meta"], [
        RequestRecord(**json.loads(line)) for line in lines[1:] if line.strip()
    ]


_COLUMNS = [
    ("hit rate", "hit_rate", "{:.3f}"),
    ("ceiling", "hit_rate_ceiling", "{:.3f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.0f} ms"),
    ("TTFT p90", "ttft_p90_ms", "{:.0f} ms"),
    ("TTFT p99", "ttft_p99_ms", "{:.0f} ms"),
    ("TPOT p50", "tpot_p50_ms", "{:.1f} ms"),
    ("tok/s", "output_tokens_per_s", "{:.0f}"),
    ("goodput", "goodput_req_per_s", "{:.2f}/s"),
    ("max/mean load", "load_imbalance_max_over_mean", "{:.2f}"),
    ("index acc.", "index_accuracy", "{:.3f}"),
    ("decision p99", "router_decision_p99_us", "{} us"),
    ("errors", "errors", "{}"),
]


PEERS_SECTION = "bench peers"  # its block in docs/experiments.md, written by `kvmesh bench peers`


def marked_section(text: str, name: str) -> str:
    """The ``<!-- name -->`` ... ``<!-- /name -->`` block of ``text`` (markers included), or ""."""
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    if start not in text or end not in text:
        return ""
    return text[text.index(start) : text.index(end) + len(end)]


def write_section(path: Path, name: str, body: str) -> None:
    """Replace (or append) one marked block of a generated document; writers of the rest
    keep it (see ``marked_section``)."""
    old = path.read_text() if path.exists() else ""
    block = f"<!-- {name} -->\n{body.rstrip()}\n<!-- /{name} -->"
    current = marked_section(old, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(old.replace(current, block) if current else old.rstrip() + "\n\n" + block + "\n")


def markdown_table(
    rows: Sequence[tuple[str, dict]], columns: Sequence[tuple[str, str, str]] = _COLUMNS, first: str = "run"
) -> str:
    """``columns``: (heading, summary key, format) triples; ``first``: the row names' heading."""
    head = f"| {first} | " + " | ".join(c for c, _, _ in columns) + " |"
    sep = "|---|" + "---:|" * len(columns)
    body = [
        f"| {name} | "
        + " | ".join(fmt.format(s[key]) if s.get(key) is not None else "-" for _, key, fmt in columns)
        + " |"
        for name, s in rows
    ]
    return "\n".join([head, sep, *body])


def plot_policies(path: Path, rows: Sequence[tuple[str, dict]], title: str) -> None:
    """Bars per run: hit rate and TTFT p50/p90."""
    plt = pyplot()
    names = [n for n, _ in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    axes[0].bar(names, [s["hit_rate"] for _, s in rows], color="#2a7")
    axes[0].set_title("prefix cache hit rate")
    x = range(len(names))
    axes[1].bar([i - 0.2 for i in x], [s["ttft_p50_ms"] for _, s in rows], 0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [s["ttft_p90_ms"] for _, s in rows], 0.4, label="p90")
    axes[1].set_xticks(list(x), names)
    axes[1].set_title("TTFT (ms)")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_replica_load(
    path: Path, records: Sequence[RequestRecord], title: str, bucket_s: float = 1.0
) -> None:
    """Uncached prefill tokens sent to each replica over time."""
    plt = pyplot()
    series: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in records:
        if r.error is None:
            series[r.replica_id][int(r.sent_s // bucket_s)] += r.prompt_tokens - r.cached_tokens
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for replica, counts in sorted(series.items()):
        xs = sorted(counts)
        ax.plot([x * bucket_s for x in xs], [counts[x] for x in xs], label=replica)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("uncached prefill tokens")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(path: Path, sweep: dict[str, list[tuple[float, float]]], ylabel: str, title: str) -> None:
    """One line per policy: (rate, value) points."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for policy, points in sorted(sweep.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=policy)
    ax.set_xlabel("requests / s")
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def report(paths: Sequence[Path], out_dir: Path, slo_ttft_ms: float) -> str:
    """``kvmesh report``: a markdown table over runs, plus plots next to it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, sweep = [], collections.defaultdict(list)
    for path in paths:
        meta, records = read_run(path)
        summary = summarize(records, slo_ttft_ms, meta.get("hit_rate_ceiling"))
        name = f"{meta.get('workload', path.stem)} / {meta.get('policy') or 'default'}"
        if meta.get("rate"):
            name += f" @ {meta['rate']}/s"
            sweep[meta.get("policy") or "default"].append((meta["rate"], summary["ttft_p90_ms"]))
        rows.append((name, summary))
        plot_replica_load(out_dir / f"{path.stem}-load.png", records, name)
    plot_policies(out_dir / "policies.png", rows, "runs")
    if any(len(points) > 1 for points in sweep.values()):
        plot_sweep(out_dir / "sweep.png", sweep, "TTFT p90 (ms)", "QPS sweep")
    table = markdown_table(rows)
    (out_dir / "report.md").write_text(table + "\n")
    return table
