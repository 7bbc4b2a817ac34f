"""``kvmesh bench dashboard``: the Grafana dashboard's panels, drawn from a live run.

Grafana is not installable here, so this starts what Grafana would read: a local cluster
(router + replicas) under shared-prefix load, and a real Prometheus server (Debian's
``prometheus``) scraping the router and every replica every second. Midway Redis goes away
for ``outage_s`` and comes back empty (faults the router must notice), then the dashboard's own queries
(``helm/kvmesh/files/dashboard.json``) are run through Prometheus' HTTP API, with
``$__rate_interval`` set as Grafana sets it for a 1 s scrape, and each panel is drawn with
matplotlib. Writes the PNG and the queried series as JSON.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from kvmesh.bench.measure.common import environment, progress, write_result
from kvmesh.bench.measure.demo_model import demo_model
from kvmesh.bench.measure.workloads import shared_prefix
from kvmesh.bench.soak import closed_loop_client
from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.embedded_redis import free_port
from kvmesh.cluster.errors import UsageError
from kvmesh.cluster.launcher import LocalCluster

DASHBOARD = Path(__file__).resolve().parents[1] / "helm" / "kvmesh" / "files" / "dashboard.json"
RATE_INTERVAL = "10s"  # Grafana's $__rate_interval for a 1 s scrape and a 2 s step
ALL_MODELS = ".+"  # the model selector's "All" (its allValue)


class Prometheus:
    """A throwaway Prometheus server scraping ``targets`` (host:port) every second."""

    def __init__(self, binary: str, targets: list[str]):
        self.folder = Path(tempfile.mkdtemp(prefix="kvmesh-prometheus-"))
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "kvmesh", "static_configs": [{"targets": targets}]}],
        }
        (self.folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    async def wait_ready(self, http: httpx.AsyncClient, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if (await http.get(self.url + "/-/ready")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError("prometheus did not become ready")

    async def query_range(self, http: httpx.AsyncClient, expr: str, start: float, end: float) -> list[dict]:
        params = {"query": expr, "start": start, "end": end, "step": "2s"}
        reply = (await http.get(self.url + "/api/v1/query_range", params=params)).json()
        if reply.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {reply.get('error')}")
        return reply["data"]["result"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


async def run(
    model_dir: str,
    binary: str,
    duration: float,
    replicas: int,
    clients: int,
    fault_at: float,
    outage_s: float,
) -> dict:
    requests = shared_prefix(
        num_groups=12, prompts_per_group=16, system_prompt_len=256, question_len=32, output_len=16, seed=0
    )
    config = ClusterConfig.for_model(
        model_dir, replicas, engine={"num_kv_blocks": 512}, router={"port": 0, "http_port": 0}
    )
    panels = json.loads(DASHBOARD.read_text())["panels"]
    # open replicas (loopback): the bench reads their own counters and calls them directly
    async with LocalCluster(config, open_replicas=True) as cluster, httpx.AsyncClient(timeout=30) as http:
        records = await cluster.index.live_replicas()
        targets = [cluster.http_url.removeprefix("http://")] + [
            r.fields["http_address"].removeprefix("http://") for r in records
        ]
        prometheus = Prometheus(binary, targets)
        try:
            await prometheus.wait_ready(http)
            stop, log, failures = asyncio.Event(), [], []
            t0 = time.perf_counter()
            start = time.time()
            workers = [
                asyncio.create_task(
                    closed_loop_client(cluster.router_address, requests, stop, t0, log, failures)
                )
                for _ in range(clients)
            ]
            await asyncio.sleep(fault_at)
            progress(
                f"{fault_at:.0f}s: Redis away for {outage_s:.0f} s, back empty (routing by load, then resync)"
            )
            cluster.redis.stop()
            await asyncio.sleep(outage_s)
            cluster.redis.start()
            while time.perf_counter() - t0 < duration:
                await asyncio.sleep(5)
                progress(f"{time.perf_counter() - t0:4.0f}s  {len(log)} requests")
            stop.set()
            await asyncio.gather(*workers)
            await asyncio.sleep(3)  # the last scrapes
            end = time.time()
            series = []
            for panel in panels:
                lines = []
                for target in panel["targets"]:
                    expr = (
                        target["expr"]
                        .replace("$__rate_interval", RATE_INTERVAL)
                        .replace("$model", ALL_MODELS)
                    )
                    for result in await prometheus.query_range(http, expr, start, end):
                        points = [(float(t) - start, float(v)) for t, v in result["values"]]
                        lines.append(
                            {"label": legend(target["legendFormat"], result["metric"]), "points": points}
                        )
                series.append(
                    {
                        "title": panel["title"],
                        "unit": panel["fieldConfig"]["defaults"]["unit"],
                        "lines": lines,
                    }
                )
        finally:
            prometheus.close()
    return {
        "requests": len(log),
        "errors": len(failures),
        "fault_at_s": fault_at,
        "outage_s": outage_s,
        "panels": series,
    }


def plot(panels: list[dict], fault_at: float, outage_s: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(13, 2.6 * rows), sharex=True)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for line in panel["lines"]:
            points = [(t, v) for t, v in line["points"] if v == v]  # NaN: no data in that window
            if points:
                ax.plot(*zip(*points, strict=True), label=line["label"], linewidth=1.2)
        ax.axvspan(fault_at, fault_at + outage_s, color="grey", alpha=0.15, linewidth=0)
        ax.set_title(panel["title"], fontsize=10)
        ax.tick_params(labelsize=8)
        if panel["unit"] == "percentunit":
            ax.set_ylim(-0.02, 1.02)
        if panel["lines"]:
            ax.legend(fontsize=7, loc="best")
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("seconds (shaded: Redis away, back empty)", fontsize=8)
    fig.suptitle("kvmesh dashboard, drawn from a live run through Prometheus", fontsize=12)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)


def main(out: str, png: str, duration: float, replicas: int, clients: int, cache_dir: str) -> int:
    binary = shutil.which("prometheus")
    if binary is None:
        raise UsageError("bench dashboard needs a prometheus server binary (apt-get install prometheus)")
    model = str(demo_model(Path(cache_dir)))
    fault_at, outage_s = duration / 2, 10.0
    result = {
        "benchmark": "dashboard",
        "duration_s": duration,
        "replicas": replicas,
        "clients": clients,
        "environment": environment(),
    }
    result.update(asyncio.run(run(model, binary, duration, replicas, clients, fault_at, outage_s)))
    plot(result["panels"], fault_at, outage_s, Path(png))
    empty = [p["title"] for p in result["panels"] if not p["lines"]]
    result["empty_panels"] = empty
    write_result(out, result)
    print(f"wrote {png}" + (f"; panels without data: {', '.join(empty)}" if empty else ""))
    return 0
