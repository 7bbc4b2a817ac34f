"""``kvmesh bench routers``: one set of replicas, the same workload through 1, 2 and 4 real
``kvmesh router`` processes (the load generator spreads requests over them, request i to
router i mod n), caches reset and checked empty before every run, runs shuffled per repeat.

Per run: hit rate (from the replicas' own counters), TTFT p50/p90/p99 (client side),
requests and uncached prefill per replica (max/mean). Each router count runs with the
routers sharing their in-flight work through the index (``--shared-load on``) and with
each router on its own counts (``off``, the baseline).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvmesh.bench.measure.common import environment, over_repeats, progress, target, write_result
from kvmesh.bench.measure.demo_model import demo_model
from kvmesh.bench.measure.loadgen import run_load
from kvmesh.bench.measure.report import summarize
from kvmesh.bench.measure.workloads import shared_prefix
from kvmesh.bench.peer_processes import Contender, RouterProcess, kvmesh_router_command
from kvmesh.bench.peers import counters, replicas_of, reset_caches, served
from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.embedded_redis import free_port
from kvmesh.cluster.launcher import LocalCluster
from kvmesh.serving.metrics import read_samples


@dataclass(frozen=True)
class RoutersConfig:
    out: str
    cache_dir: Path
    router_counts: tuple[int, ...] = (1, 2, 4)
    shared_modes: tuple[bool, ...] = (True, False)
    repeats: int = 2
    replicas: int = 4
    num_kv_blocks: int = 160
    groups: int = 8
    prompts_per_group: int = 16
    prefix_tokens: int = 512
    question_tokens: int = 64
    output_tokens: int = 16
    concurrency: int = 8
    seed: int = 0


async def _one_run(
    cluster,
    http,
    replicas,
    model: str,
    workload,
    routers: int,
    shared: bool,
    config: RoutersConfig,
    scratch: Path,
):
    ports = [(free_port(), free_port()) for _ in range(routers)]
    contender = Contender("kvmesh", "prefix")
    processes = []
    for i, (grpc_port, http_port) in enumerate(ports):
        command = kvmesh_router_command(
            model, cluster.redis_url, grpc_port, http_port, "--shared-load", "on" if shared else "off"
        )
        log = scratch / f"router-{routers}-{'shared' if shared else 'own'}-{i}.log"
        processes.append(RouterProcess(contender, command, http_port, log, cluster.router_environment()))
    try:
        for p in processes:
            await p.start()
        if shared:  # each has seen the others (a heartbeat): every request shared from the first
            await _until_sharing(http, processes)
        await reset_caches(cluster, http, replicas)
        before = await counters(http, replicas)
        records = await run_load(
            [f"127.0.0.1:{g}" for g, _ in ports], workload, concurrency=config.concurrency, seed=config.seed
        )
        after = await counters(http, replicas)
        window = await race_window(http, processes) if shared and routers > 1 else None
    finally:
        for p in processes:
            p.stop()
    client = summarize(records)
    served_counts = served(before, after)
    return {
        "routers": routers,
        "shared_load": shared,
        "hit_rate": served_counts["hit_rate"],
        "ttft_p50": client["ttft_p50_ms"],
        "ttft_p90": client["ttft_p90_ms"],
        "ttft_p99": client["ttft_p99_ms"],
        "errors": client["errors"],
        "requests_per_replica": list(served_counts["requests_per_replica"].values()),
        "uncached_prefill_per_replica": served_counts["uncached_prefill_per_replica"],
        "prefill_max_over_mean": served_counts["prefill_max_over_mean"],
        "requests_max_over_mean": served_counts["requests_max_over_mean"],
        "race_window": window,
    }


async def _until_sharing(
    http: httpx.AsyncClient, routers: list[RouterProcess], timeout_s: float = 15.0
) -> None:
    deadline = time.monotonic() + timeout_s
    for router in routers:
        while True:
            samples = read_samples((await http.get(router.url + "/metrics")).text)
            if samples.get(("kvmesh_router_fleet_routers", ()), 0) >= len(routers):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"router {router.url} never saw the other {len(routers) - 1} routers")
            await asyncio.sleep(0.1)


async def race_window(http: httpx.AsyncClient, routers: list[RouterProcess]) -> dict:
    """Shared load's race window over every router (``kvmesh_router_fleet_sync_seconds``):
    the mean, and the histogram bucket that holds the 99th percentile."""
    count = total = 0.0
    buckets: dict[float, float] = {}
    for router in routers:
        samples = read_samples((await http.get(router.url + "/metrics")).text)
        count += samples.get(("kvmesh_router_fleet_sync_seconds_count", ()), 0.0)
        total += samples.get(("kvmesh_router_fleet_sync_seconds_sum", ()), 0.0)
        for (name, labels), value in samples.items():
            if name == "kvmesh_router_fleet_sync_seconds_bucket":
                bound = float(dict(labels)["le"])
                buckets[bound] = buckets.get(bound, 0.0) + value
    p99 = next((b for b in sorted(buckets) if count and buckets[b] >= 0.99 * count), None)
    return {
        "batches": int(count),
        "mean_ms": round(total / count * 1e3, 3) if count else None,
        "p99_at_most_ms": None if p99 is None or p99 == float("inf") else p99 * 1e3,
    }


def plot(summary: list[dict], rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, key, title in zip(
        axes,
        ("hit_rate", "prefill_max_over_mean", "ttft_p90"),
        ("hit rate (replicas' counters)", "uncached prefill, max/mean replica", "TTFT p90 (ms)"),
        strict=True,
    ):
        for shared, color in ((True, "tab:blue"), (False, "tab:orange")):
            mode = "shared load" if shared else "per-router load"
            mine = [r for r in rows if r["shared_load"] == shared]
            ax.scatter([r["routers"] for r in mine], [r[key] for r in mine], alpha=0.35, color=color)
            medians = [s for s in summary if s["shared_load"] == shared]
            ax.plot(
                [s["routers"] for s in medians],
                [s[f"{key}_median"] for s in medians],
                marker="o",
                color=color,
                label=f"{mode} (median; dots: runs)",
            )
        xs = [r["routers"] for r in rows]
        ax.set_xticks(sorted(set(xs)))
        ax.set_xlabel("routers")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)


async def run(config: RoutersConfig) -> dict:
    model = str(demo_model(config.cache_dir))
    workload = shared_prefix(
        num_groups=config.groups,
        prompts_per_group=config.prompts_per_group,
        system_prompt_len=config.prefix_tokens,
        question_len=config.question_tokens,
        output_len=config.output_tokens,
        seed=config.seed,
    )
    cluster_config = ClusterConfig.for_model(
        model, config.replicas, engine={"num_kv_blocks": config.num_kv_blocks}, with_router=False
    )
    scratch = Path(tempfile.mkdtemp(prefix="kvmesh-bench-routers-"))  # router logs, for failures
    rows = []
    rng = random.Random(config.seed)
    # open replicas (loopback): the bench reads their own counters and calls them directly
    async with (
        LocalCluster(cluster_config, open_replicas=True) as cluster,
        httpx.AsyncClient(timeout=120) as http,
    ):
        replicas = await replicas_of(cluster)
        for repeat in range(config.repeats):
            order = [(n, shared) for n in config.router_counts for shared in config.shared_modes]
            rng.shuffle(order)
            for routers, shared in order:
                row = await _one_run(
                    cluster, http, replicas, model, workload, routers, shared, config, scratch
                )
                row["repeat"] = repeat
                rows.append(row)
                progress(
                    f"{routers} router(s), shared load {'on' if shared else 'off'}, repeat {repeat}: hit {row['hit_rate']:.3f}, p90 {row['ttft_p90']} ms, "
                    f"requests {row['requests_per_replica']}, prefill max/mean {row['prefill_max_over_mean']}"
                    + (f", race window mean {row['race_window']['mean_ms']} ms" if row["race_window"] else "")
                )
    summary = over_repeats(
        rows,
        ("routers", "shared_load"),
        ("hit_rate", "ttft_p90", "prefill_max_over_mean", "requests_max_over_mean"),
    )
    return {"rows": rows, "summary": summary, "targets": _targets(summary)}


def _targets(summary: list[dict]) -> list[dict]:
    """With shared load: 2+ routers within 3 % of one router's hit rate, uncached prefill max/mean <= 1.25."""
    shared = {s["routers"]: s for s in summary if s["shared_load"]}
    if 1 not in shared:
        return []
    one = shared[1]["hit_rate_median"]
    out = []
    for n, s in sorted(shared.items()):
        if n > 1:
            out.append(
                target(
                    f"{n} routers, shared load: hit rate / one router's",
                    round(s["hit_rate_median"] / one, 3),
                    ">=",
                    0.97,
                )
            )
        out.append(
            target(
                f"{n} router(s), shared load: uncached prefill max/mean",
                s["prefill_max_over_mean_median"],
                "<=",
                1.25,
            )
        )
    return out


def main(config: RoutersConfig, png: str) -> int:
    result = {
        "benchmark": "routers",
        "config": {k: str(v) for k, v in vars(config).items()},
        "environment": environment(),
    }
    result.update(asyncio.run(run(config)))
    plot(result["summary"], result["rows"], Path(png))
    print(
        f"\n{'routers':>8}{'shared':>8}{'runs':>6}{'hit rate':>10}{'TTFT p90':>10}{'prefill max/mean':>18}{'requests max/mean':>19}"
    )
    for s in result["summary"]:
        print(
            f"{s['routers']:>8}{'on' if s['shared_load'] else 'off':>8}{s['runs']:>6}{s['hit_rate_median']:>10.3f}"
            f"{s['ttft_p90_median']:>9.0f}ms{s['prefill_max_over_mean_median']:>18.2f}{s['requests_max_over_mean_median']:>19.2f}"
        )
    write_result(config.out, result)
    print(f"wrote {png}")
    return 0
