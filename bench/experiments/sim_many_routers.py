"""``kvmesh experiments --routers-grid``: many routers in the simulator.

Routers {1, 4, 16, 64} x replicas {64, 256} x {Mooncake synthetic trace, shared prefix} x
{shared load, each router on its own counts}, 20k requests each, with the index a set lag
(``EVENT_LAG_S``) behind the replicas and heartbeats every second (what a deployed kvmesh sees: KV events batched per
step and published through Redis; replicas' default heartbeat). The offered load grows 4x with the fleet (the trace
sped up, the shared-prefix rate raised); calibrated on short runs to ~65% busy at 64
replicas, the full 20k-request runs end up heavier there (queues build over the run).
Runs go to a process pool, one per core.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bench.experiments.cost_model import H100_LLAMA3_8B
from kvmesh.bench.experiments.simulator import Simulation
from kvmesh.bench.measure import workloads as wl
from kvmesh.bench.measure.report import pyplot, write_section

SECTION = "simulated routers"  # its block in docs/experiments.md
EVENT_LAG_S = 0.020
HEARTBEAT_S = 1.0
BLOCK = 256


@dataclass(frozen=True)
class GridCell:
    workload: str  # "mooncake" | "shared_prefix"
    replicas: int
    routers: int
    shared_load: bool
    requests: int

    def stream(self):
        per_64 = self.replicas / 64  # the fleet's size in units of the calibrated one
        if self.workload == "mooncake":  # 48x: queues build at 64 replicas (p50 TTFT ~1 s at 64x)
            copies = -(-self.requests // 3993)
            return wl.iter_mooncake(speedup=48 * per_64, copies=copies, limit=self.requests)
        groups = max(1, self.requests // 40)  # 40 questions per 2048-token system prompt
        stream = wl.iter_shared_prefix(num_groups=groups, prompts_per_group=40, seed=7)
        return wl.iter_poisson_arrivals(stream, 2500 * per_64, seed=7)


def run_cell(cell: GridCell) -> dict:
    start = time.monotonic()
    summary = Simulation(
        cell.stream(),
        cell.replicas,
        "prefix",
        H100_LLAMA3_8B,
        block_size=BLOCK,
        routers=cell.routers,
        shared_load=cell.shared_load,
        event_lag_s=EVENT_LAG_S,
        heartbeat_s=HEARTBEAT_S,
    ).run()
    return {**cell.__dict__, **summary, "wall_s": round(time.monotonic() - start, 1)}


def run_grid(quick: bool, log=print) -> list[dict]:
    routers, replicas, requests = ((1, 4), (16,), 2000) if quick else ((1, 4, 16, 64), (64, 256), 20_000)
    cells = [
        GridCell(w, n, k, shared, requests)
        for w, n, k, shared in itertools.product(
            ("mooncake", "shared_prefix"), replicas, routers, (True, False)
        )
    ]
    cells.sort(key=lambda c: -c.replicas * c.routers)  # the longest first: the pool ends together
    rows = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for row in pool.map(run_cell, cells):
            rows.append(row)
            log(
                f"  {row['workload']:<14} {row['replicas']:>4} replicas {row['routers']:>3} routers "
                f"{'shared' if row['shared_load'] else 'own   '}  hit {row['hit_rate']:.3f}  "
                f"p90 {row['ttft_p90']:.3f}s  prefill max/mean {row['load_imbalance_max_over_mean']:.2f}  "
                f"({row['wall_s']:.0f}s)"
            )
    return sorted(rows, key=lambda r: (r["workload"], r["replicas"], r["routers"], not r["shared_load"]))


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(2, len(workloads), figsize=(5.5 * len(workloads), 6.4), squeeze=False)
    for col, workload in enumerate(workloads):
        for (replicas, shared), group in itertools.groupby(
            sorted(
                (r for r in rows if r["workload"] == workload),
                key=lambda r: (r["replicas"], r["shared_load"]),
            ),
            key=lambda r: (r["replicas"], r["shared_load"]),
        ):
            group = sorted(group, key=lambda r: r["routers"])
            xs = [r["routers"] for r in group]
            style = {"marker": "o", "linestyle": "-" if shared else "--"}
            label = f"{replicas} replicas, {'shared load' if shared else 'own counts'}"
            axes[0][col].plot(xs, [r["hit_rate"] for r in group], label=label, **style)
            axes[1][col].plot(xs, [r["ttft_p90"] for r in group], label=label, **style)
        axes[0][col].set_title(workload)
        axes[0][col].set_ylabel("hit rate")
        axes[1][col].set_ylabel("TTFT p90 (s)")
        counts = sorted({r["routers"] for r in rows})
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(counts, [str(n) for n in counts])
            ax.set_xlabel("routers")
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(rows: list[dict], elapsed_s: float) -> str:
    lines = [
        "## Many routers (simulated)",
        "",
        "Regenerated by `kvmesh experiments --routers-grid --out-dir docs` (`docs/sim_routers.json`,",
        f"`docs/img/sim_routers.png`; {elapsed_s:.0f} s on 2 cores). Request i goes to router i mod N;",
        "each router runs its own `prefix` policy object. **shared**: every router sees the fleet's",
        "in-flight work and speculative entries (`--shared-load on`); **own**: only what it sent itself.",
        f"The index is {EVENT_LAG_S * 1000:.0f} ms behind the replicas, heartbeats every {HEARTBEAT_S:.0f} s;",
        "20k requests per cell. Mooncake: the synthetic trace played 6 times in a row with new content",
        "each time, sped up 48x per 64 replicas; shared prefix: 2048-token system prompts x 40",
        "questions, 2,500/s per 64 replicas. Prefill max/mean: uncached prefill per replica.",
        "",
        "![routers](img/sim_routers.png)",
        "",
        "| workload | replicas | routers | hit rate shared / own | TTFT p90 shared / own | prefill max/mean shared / own | requests max/mean shared / own |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    cells = {(r["workload"], r["replicas"], r["routers"], r["shared_load"]): r for r in rows}
    lines[-4:-4] = [*_findings(cells), ""]
    for workload, replicas, routers in sorted({k[:3] for k in cells}):
        s, o = cells.get((workload, replicas, routers, True)), cells.get((workload, replicas, routers, False))
        if s is None or o is None:
            continue
        lines.append(
            f"| {workload} | {replicas} | {routers} | {s['hit_rate']:.3f} / {o['hit_rate']:.3f} "
            f"| {s['ttft_p90']:.3f} / {o['ttft_p90']:.3f} s "
            f"| {s['load_imbalance_max_over_mean']:.2f} / {o['load_imbalance_max_over_mean']:.2f} "
            f"| {s['requests_max_over_mean']:.2f} / {o['requests_max_over_mean']:.2f} |"
        )
    return "\n".join(lines)


def _findings(cells: dict) -> list[str]:
    """What the grid says, computed from it: how far each mode moves from one router."""
    one = {(w, n): r for (w, n, k, shared), r in cells.items() if k == 1 and shared}
    hit_moves, p90_moves, own_p90, own_hit = [], [], [], []
    for (w, n, k, shared), r in cells.items():
        if k == 1 or (w, n) not in one:
            continue
        base = one[(w, n)]
        if shared:
            hit_moves.append(r["hit_rate"] - base["hit_rate"])
            p90_moves.append(r["ttft_p90"] / base["ttft_p90"])
        elif (w, n, k, True) in cells:
            mate = cells[(w, n, k, True)]
            own_p90.append(r["ttft_p90"] / mate["ttft_p90"])
            own_hit.append(r["hit_rate"] - mate["hit_rate"])
    if not hit_moves or not own_p90:
        return []
    return [
        f"With shared load, more routers change almost nothing: from 1 router to {max(k for _, _, k, _ in cells)}, "
        f"hit rate moves by {min(hit_moves):+.3f} to {max(hit_moves):+.3f} and p90 TTFT by "
        f"{min(p90_moves):.2f}x to {max(p90_moves):.2f}x. On their own counts, routers pile onto "
        f"replicas they each think idle: p90 TTFT is {min(own_p90):.1f}x to {max(own_p90):.1f}x the "
        f"shared one, and the hit rate moves by {min(own_hit):+.3f} to {max(own_hit):+.3f}"
        + (
            " (a higher hit rate on its own counts comes with the worse queues: it stuck to prefix holders "
            "that were busy)."
            if max(own_hit) > 0
            else "."
        ),
    ]


def main(out_dir: str, quick: bool) -> int:
    started = time.monotonic()
    out = Path(out_dir)
    (out / "img").mkdir(parents=True, exist_ok=True)
    rows = run_grid(quick)
    elapsed = time.monotonic() - started
    (out / "sim_routers.json").write_text(
        json.dumps(
            {
                "event_lag_s": EVENT_LAG_S,
                "heartbeat_s": HEARTBEAT_S,
                "elapsed_s": round(elapsed),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    plot(rows, out / "img" / "sim_routers.png")
    write_section(out / "experiments.md", SECTION, section(rows, elapsed))
    print(f"\nwrote {out / 'sim_routers.json'} and the '{SECTION}' section of {out / 'experiments.md'}")
    return 0
