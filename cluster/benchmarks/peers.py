"""``kvmesh bench peers``: kvmesh's router beside sglang-router and vllm-router, one run.

N CPU replicas start once; each router in turn fronts them over OpenAI HTTP, from cold
caches, under the same seeded shared-prefix load: guidellm's (a generator nobody here
wrote) and kvmesh's own. The replicas, not the clients, say what was cached: their
/metrics counters are read around every run. Router overhead is measured by interleaving
identical requests sent through the router and straight to a replica.

The KV pool is sized to hold only some of the shared prefixes per replica, so a router
that scatters a prefix over every replica evicts it again; with a pool that holds every
prefix everywhere, any router converges to the same hit rate.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from kvmesh.cluster.benchmarks.common import environment, progress, target, write_result
from kvmesh.cluster.benchmarks.peer_routers import (
    CONTENDERS,
    Contender,
    GuidellmLoad,
    RouterProcess,
    router_command,
    run_guidellm,
)
from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.demo_model import demo_model
from kvmesh.cluster.embedded_redis import free_port
from kvmesh.cluster.experiments.loadgen import run_http_load
from kvmesh.cluster.experiments.report import (
    PEERS_SECTION,
    markdown_table,
    plot_policies,
    summarize,
    write_section,
)
from kvmesh.cluster.experiments.text_workload import as_text, word_table
from kvmesh.cluster.experiments.workloads import shared_prefix
from kvmesh.cluster.launcher import LocalCluster
from kvmesh.serving.metrics import read_samples

_SAMPLES = {  # key -> (sample name, labels) in a replica's /metrics
    "ok": ("kvmesh_replica_requests_total", (("outcome", "ok"),)),
    "prompt": ("kvmesh_replica_finished_prompt_tokens_total", ()),
    "cached": ("kvmesh_replica_cached_prompt_tokens_total", ()),
    "cached_hashes": ("kvmesh_replica_kv_cached_hashes", ()),
}
_LOADGEN_KEYS = ("requests", "errors", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "output_tokens_per_s")
_TABLE = [
    ("hit rate (replicas)", "hit_rate", "{:.3f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.0f} ms"),
    ("TTFT p90", "ttft_p90_ms", "{:.0f} ms"),
    ("tok/s", "output_tokens_per_s", "{:.0f}"),
    ("requests per replica", "spread", "{}"),
    ("errors", "errors", "{}"),
    ("added latency p50", "added_p50_ms", "{:.2f} ms"),
]


@dataclass(frozen=True)
class Replica:
    replica_id: str
    http_url: str


async def replicas_of(cluster: LocalCluster) -> list[Replica]:
    records = await cluster.index.live_replicas()
    return sorted(
        (Replica(r.replica_id, r.fields["http_address"]) for r in records),
        key=lambda r: r.replica_id,
    )


async def counters(http: httpx.AsyncClient, replicas: list[Replica]) -> dict[str, dict[str, float]]:
    """Per replica: finished requests, their prompt and cached tokens, cached hashes held."""
    out = {}
    for r in replicas:
        samples = read_samples((await http.get(r.http_url + "/metrics")).text)
        missing = [
            name for key, (name, labels) in _SAMPLES.items() if key != "ok" and (name, labels) not in samples
        ]
        if missing:  # a renamed metric must fail the benchmark, not read as zero
            raise RuntimeError(f"replica {r.replica_id} exports no {', '.join(missing)}")
        out[r.replica_id] = {key: samples.get(sample, 0.0) for key, sample in _SAMPLES.items()}
    return out


def served(before: dict, after: dict) -> dict:
    """What the replicas did between two ``counters`` snapshots: the true hit rate."""
    delta = {
        rid: {k: after[rid][k] - before.get(rid, {}).get(k, 0.0) for k in ("ok", "prompt", "cached")}
        for rid in after
    }
    prompt = sum(d["prompt"] for d in delta.values())
    cached = sum(d["cached"] for d in delta.values())
    per_replica = {rid: int(d["ok"]) for rid, d in sorted(delta.items())}
    uncached = [d["prompt"] - d["cached"] for _, d in sorted(delta.items())]
    mean_uncached = sum(uncached) / len(uncached) if uncached else 0.0
    return {
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "cached_tokens": int(cached),
        "prompt_tokens": int(prompt),
        "requests_per_replica": per_replica,
        "uncached_prefill_per_replica": [int(u) for u in uncached],
        "prefill_max_over_mean": round(max(uncached) / mean_uncached, 3) if mean_uncached else 0.0,
        "spread": "/".join(str(n) for n in per_replica.values()),
    }


async def reset_caches(cluster: LocalCluster, http: httpx.AsyncClient, replicas: list[Replica]) -> None:
    """Every router starts cold: replicas forget their prefixes (checked, not assumed)."""
    await cluster.reset_prefix_caches()
    left = {
        rid: c["cached_hashes"] for rid, c in (await counters(http, replicas)).items() if c["cached_hashes"]
    }
    if left:
        raise RuntimeError(f"prefix caches not empty after reset: {left}")


async def router_overhead(
    http: httpx.AsyncClient, router_url: str, replicas: list[Replica], model_id: str, pairs: int
) -> dict:
    """Added latency: the same cached 1-token request through the router and straight to a
    replica, interleaved so drift hits both alike; medians."""
    body = {"model": model_id, "prompt": " hello world" * 8, "max_tokens": 1, "temperature": 0}

    async def timed(url: str) -> float:
        start = time.perf_counter()
        reply = await http.post(url + "/v1/completions", json=body)
        reply.raise_for_status()
        return time.perf_counter() - start

    for r in replicas:
        await timed(r.http_url)
    for _ in range(5):
        await timed(router_url)
    direct, routed = [], []
    for i in range(pairs):
        direct.append(await timed(replicas[i % len(replicas)].http_url))
        routed.append(await timed(router_url))
    d, r = statistics.median(direct) * 1e3, statistics.median(routed) * 1e3
    return {"direct_p50_ms": round(d, 3), "routed_p50_ms": round(r, 3), "added_p50_ms": round(r - d, 3)}


async def unloaded_ttft_ms(http: httpx.AsyncClient, replica: Replica, model_id: str, prompt: str) -> float:
    """A lone cold request of the workload's size: the yardstick for 'this load queues'."""
    start = time.perf_counter()
    body = {"model": model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    (await http.post(replica.http_url + "/v1/completions", json=body)).raise_for_status()
    return round((time.perf_counter() - start) * 1e3, 1)


DEFAULT_LOAD = GuidellmLoad(
    prefix_tokens=512,
    prefix_count=8,
    prompt_tokens=64,
    output_tokens=16,
    rate=6.0,
    requests=240,
    max_seconds=120,
)


@dataclass(frozen=True)
class PeersConfig:
    out: str
    venv: Path
    cache_dir: Path
    replicas: int = 4
    num_kv_blocks: int = 160
    load: GuidellmLoad = DEFAULT_LOAD
    overhead_pairs: int = 60
    contenders: tuple[Contender, ...] = CONTENDERS
    guidellm: bool = True  # False: kvmesh's load generator only (no peer venv needed for kvmesh routers)
    model_dir: Path | None = None  # None: the demo's tiny model, built once in cache_dir
    docs: Path | None = None  # write the results as a section of this document (docs/experiments.md)


@dataclass
class _Bench:
    """What every (router, load generator) run shares: replicas, model, workload, a scratch folder."""

    config: PeersConfig
    model: Path
    workload: list
    prompts: list[str]
    scratch: Path  # router logs, guidellm reports
    replicas: list[Replica]
    cluster: LocalCluster
    http: httpx.AsyncClient

    async def run(self, contender: Contender, generator: str, result: dict) -> None:
        """One router process, cold caches, one load; adds to ``result`` (overhead once)."""
        port = free_port()
        workers = [r.http_url for r in self.replicas]
        command = router_command(
            contender, self.config.venv, port, workers, str(self.model), self.cluster.redis_url
        )
        stem = f"{contender.name.replace(' ', '-')}-{generator}"
        async with RouterProcess(contender, command, port, self.scratch / f"{stem}.log") as router:
            if "overhead" not in result:
                result["overhead"] = await router_overhead(
                    self.http, router.url, self.replicas, self.model.name, self.config.overhead_pairs
                )
            await reset_caches(self.cluster, self.http, self.replicas)
            await asyncio.sleep(2.5)  # kvmesh's speculative entries from the overhead probe expire
            before = await counters(self.http, self.replicas)
            progress(f"{contender.name}: {generator} ...")
            client = await self.drive(generator, router.url, contender.name, self.scratch / f"{stem}.json")
            result[generator] = {**client, **served(before, await counters(self.http, self.replicas))}
            progress(f"{contender.name}: {generator}: {_line(result[generator])}")

    async def drive(self, generator: str, url: str, label: str, report: Path) -> dict:
        """The load, as the client saw it."""
        load = self.config.load
        if generator == "guidellm":
            return await asyncio.to_thread(
                run_guidellm, load, self.config.venv, url, self.model.name, str(self.model), report
            )
        records = await run_http_load(
            url, self.workload, self.prompts, label, self.model.name,
            concurrency=256, rate=load.rate, seed=load.seed,
        )  # fmt: skip
        summary = summarize(records)
        return {k: summary[k] for k in _LOADGEN_KEYS} | {"client_hit_rate": summary["hit_rate"]}


async def run(config: PeersConfig) -> dict:
    model = (config.model_dir or demo_model(config.cache_dir)).resolve()  # guidellm runs elsewhere
    load = config.load
    workload = shared_prefix(
        num_groups=load.prefix_count, prompts_per_group=max(1, load.requests // load.prefix_count),
        system_prompt_len=load.prefix_tokens, question_len=load.prompt_tokens, output_len=load.output_tokens,
        seed=load.seed,
    )  # fmt: skip
    prompts = as_text(workload, word_table(model))
    cluster_config = ClusterConfig.for_model(
        str(model), config.replicas, engine={"num_kv_blocks": config.num_kv_blocks}, with_router=False
    )
    generators = ("guidellm", "kvmesh_loadgen") if config.guidellm else ("kvmesh_loadgen",)
    progress(f"starting {config.replicas} replicas ({config.num_kv_blocks} KV blocks each) ...")
    runs: dict[str, dict] = {}
    async with LocalCluster(cluster_config) as cluster, httpx.AsyncClient(timeout=120) as http:
        replicas = await replicas_of(cluster)
        bench = _Bench(
            config, model, workload, prompts, Path(config.out).resolve().with_suffix(""), replicas,
            cluster, http,
        )  # fmt: skip
        baseline = await unloaded_ttft_ms(http, replicas[0], model.name, prompts[0])
        for contender in config.contenders:
            runs[contender.name] = {}
            for generator in generators:
                await bench.run(contender, generator, runs[contender.name])
    return _report(config, runs, baseline)


def _line(s: dict) -> str:
    return (
        f"hit {s['hit_rate']:.3f}, TTFT p50 {s['ttft_p50_ms']:.0f} ms p90 {s['ttft_p90_ms']:.0f} ms, "
        f"{s['errors']} errors, per replica {s['spread']}"
    )


def _report(config: PeersConfig, runs: dict[str, dict], unloaded_ms: float) -> dict:
    main_generator = "guidellm" if config.guidellm else "kvmesh_loadgen"
    ours = runs.get("kvmesh prefix")
    targets = []
    if ours:
        mine = ours[main_generator]
        for peer in ("sglang cache_aware", "vllm cache_aware"):
            if peer in runs:
                theirs = runs[peer][main_generator]
                targets.append(
                    target(
                        f"hit rate: kvmesh prefix / {peer}",
                        _ratio(mine["hit_rate"], theirs["hit_rate"]),
                        ">=",
                        1.0,
                    )
                )
                targets.append(target(f"TTFT p90: {peer} / kvmesh prefix", _ratio(theirs["ttft_p90_ms"], mine["ttft_p90_ms"]), ">=", 1.0))  # fmt: skip
        if "sglang cache_aware" in runs:
            gap = ours["overhead"]["added_p50_ms"] - runs["sglang cache_aware"]["overhead"]["added_p50_ms"]
            targets.append(target("added latency: kvmesh - sglang-router (ms)", round(gap, 3), "<=", 1.0))
    queued = {name: _ratio(r[main_generator]["ttft_p90_ms"], unloaded_ms) for name, r in runs.items()}
    return {
        "benchmark": "peers",
        "config": {
            "replicas": config.replicas,
            "num_kv_blocks": config.num_kv_blocks,
            "load": asdict(config.load),
            "main_generator": main_generator,
        },
        "unloaded_cold_ttft_ms": unloaded_ms,
        "ttft_p90_over_unloaded": queued,
        "runs": runs,
        "targets": targets,
        "environment": environment(),
    }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("inf")


def write_tables(result: dict, out: str) -> str:
    """Markdown tables (one per load generator) and a plot beside the JSON."""
    sections = []
    for generator in ("guidellm", "kvmesh_loadgen"):
        rows = [
            (name, {**r[generator], **r["overhead"]}) for name, r in result["runs"].items() if generator in r
        ]
        if not rows:
            continue
        sections.append(f"**{generator}**\n\n{markdown_table(rows, _TABLE)}")
        plot_policies(Path(out).with_name(f"{Path(out).stem}_{generator}.png"), rows, f"peers: {generator}")
    text = "\n\n".join(sections) + "\n"
    Path(out).with_suffix(".md").write_text(text)
    return text


def write_docs(result: dict, tables: str, out: str, docs: Path) -> None:
    """The results as the ``bench peers`` section of ``docs`` (plot copied to docs/img/)."""
    c, load = result["config"], result["config"]["load"]
    plot = Path(out).with_name(f"{Path(out).stem}_{c['main_generator']}.png")
    image = docs.parent / "img" / "peers.png"
    image.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plot, image)
    checks = "\n".join(
        f"| {t['target']} | {t['value']} | {t['bound']} | {'yes' if t['met'] else '**no**'} |"
        for t in result["targets"]
    )
    queued = ", ".join(f"{name} {ratio}x" for name, ratio in result["ttft_p90_over_unloaded"].items())
    setup = (
        f"{c['replicas']} CPU replicas of the demo's tiny Qwen3, {c['num_kv_blocks']} KV blocks each (room for a few "
        "of the shared prefixes, not all). Each router in turn fronts them over OpenAI HTTP, from cold caches, under "
        f"the same seeded load: {load['prefix_count']} shared prefixes of {load['prefix_tokens']} tokens + "
        f"{load['prompt_tokens']} unique tokens, {load['output_tokens']} out, Poisson {load['rate']}/s, "
        f"{load['requests']} requests; driven by guidellm (synthetic_text, local tokenizer, offline) and by kvmesh's "
        "own HTTP load generator (the same shape, as text). The hit rate is what the replicas counted (their "
        "/metrics), not what clients were told. Added latency: the same cached 1-token request through the router "
        "and straight to a replica, interleaved, medians."
    )
    load_note = (
        f"A lone cold request takes {result['unloaded_cold_ttft_ms']} ms; {c['main_generator']}'s TTFT p90 over "
        f"that (how much the load queues): {queued}."
    )
    body = "\n\n".join(
        [
            "## Side by side with real peers: sglang-router and vllm-router (`kvmesh bench peers --docs docs/experiments.md`)",
            setup,
            load_note,
            "| target | value | bound | met |\n|---|---:|---|---|\n" + checks,
            tables.rstrip(),
            "![peers](img/peers.png)",
        ]
    )
    write_section(docs, PEERS_SECTION, body)


def main(config: PeersConfig) -> int:
    """The whole comparison (the command checked the peers are installed)."""
    result = asyncio.run(run(config))
    write_result(config.out, result)
    tables = write_tables(result, config.out)
    print(tables)
    if config.docs:
        write_docs(result, tables, config.out, config.docs)
        print(f"updated {config.docs}")
    return 0
