"""``kvmesh bench peers``: kvmesh's router beside sglang-router and vllm-router, swept over
rates and workloads, with repeats.

N CPU replicas start once; each router in turn fronts them over OpenAI HTTP, from cold
caches (checked empty), under the same seeded load: the shared-prefix shape from guidellm
(a generator nobody here wrote) and from kvmesh's own, and multi-turn chat (closed loop:
kvmesh's generator for every router, each turn resending the answer it got). Every repeat
runs every (router, workload, rate) cell once, in its own shuffled order, with its own
seed; each run starts its own router process, or (``one_router``) each contender keeps one
through all its runs, as a router lives in production. The replicas, not the clients, say
what was cached: their /metrics counters are read around every run. Router overhead is
measured in every run by interleaving identical requests sent through the router and
straight to a replica. The summary gives, per (router, workload, rate), medians and
min/max across repeats.

The KV pool is sized to hold only some of the shared prefixes per replica, so a router
that scatters a prefix over every replica evicts it again; with a pool that holds every
prefix everywhere, any router converges to the same hit rate.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import random
import shutil
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvmesh.bench.measure.common import environment, over_repeats, progress, target, write_result
from kvmesh.bench.measure.demo_model import demo_model
from kvmesh.bench.measure.loadgen import run_http_conversations, run_http_load
from kvmesh.bench.measure.peer_loads import DEFAULT_LOAD, MOONCAKE_BLOCK_TOKENS, GuidellmLoad, mooncake_at
from kvmesh.bench.measure.report import PEERS_SECTION, markdown_table, pyplot, summarize, write_section
from kvmesh.bench.measure.stats import percentile
from kvmesh.bench.measure.text_workload import as_text, segment_text, word_table
from kvmesh.bench.measure.workloads import (
    conversations,
    multi_turn,
    shared_prefix,
)
from kvmesh.bench.peer_processes import (
    SWEEP_CONTENDERS,
    Contender,
    RouterProcess,
    RunAgain,
    process_cpu_seconds,
    router_command,
    run_guidellm,
)
from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.embedded_redis import free_port
from kvmesh.cluster.launcher import LocalCluster
from kvmesh.serving.metrics import read_samples

_SAMPLES = {  # key -> (sample name, labels) in a replica's /metrics
    "ok": ("kvmesh_replica_requests_total", (("outcome", "ok"),)),
    "prompt": ("kvmesh_replica_finished_prompt_tokens_total", ()),
    "cached": ("kvmesh_replica_cached_prompt_tokens_total", ()),
    "cached_hashes": ("kvmesh_replica_kv_cached_hashes", ()),
    # its fitted cost of a prompt token, as its heartbeat tells the router: a fit that drifts
    # away from its peers' changes where kvmesh ``prefix`` sends cold prompts
    "prefill_token_s": ("kvmesh_replica_step_cost_seconds", (("term", "prefill_token"),)),
}
_LOADGEN_KEYS = ("requests", "errors", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "output_tokens_per_s")


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
    """Per replica: finished requests, their prompt and cached tokens, cached hashes held, and
    its fitted prompt-token cost."""
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


async def router_account(http: httpx.AsyncClient, url: str) -> collections.Counter:
    """A kvmesh router's own account so far (its /metrics): its decisions by branch, and its
    predictions that missed, by replica and cause. Over a run (the difference of two), it says
    why requests went where they did: a run whose requests piled on one replica shows whether
    the router saw a prefix there, fell back to load, or was held by its guard."""
    counts: collections.Counter = collections.Counter()
    for (name, labels), value in read_samples((await http.get(url + "/metrics")).text).items():
        labels = dict(labels)
        if name == "kvmesh_router_decision_branches_total":
            counts[f"branch {labels['branch']}"] += value
        elif name == "kvmesh_router_prediction_misses_total":
            counts[f"miss {labels['replica']} {labels['cause']}"] += value
    return counts


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
    return {
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "cached_tokens": int(cached),
        "prompt_tokens": int(prompt),
        "requests_per_replica": per_replica,
        "uncached_prefill_per_replica": [int(u) for u in uncached],
        "prefill_max_over_mean": max_over_mean(uncached),
        "requests_max_over_mean": max_over_mean(list(per_replica.values())),
        "spread": "/".join(str(n) for n in per_replica.values()),
    }


def max_over_mean(values: list[float]) -> float:
    """How lopsided a spread over replicas is (1.0: even; 0.0 when nothing was spread)."""
    mean = sum(values) / len(values) if values else 0.0
    return round(max(values) / mean, 3) if mean else 0.0


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
    d90, r90 = percentile(direct, 0.9) * 1e3, percentile(routed, 0.9) * 1e3
    return {
        "direct_p50_ms": round(d, 3),
        "routed_p50_ms": round(r, 3),
        "added_p50_ms": round(r - d, 3),
        "added_p90_ms": round(r90 - d90, 3),
    }


async def unloaded_ttft_ms(http: httpx.AsyncClient, replica: Replica, model_id: str, prompt: str) -> float:
    """A lone cold request of the workload's size: the yardstick for 'this load queues'."""
    start = time.perf_counter()
    body = {"model": model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    (await http.post(replica.http_url + "/v1/completions", json=body)).raise_for_status()
    return round((time.perf_counter() - start) * 1e3, 1)


WORKLOADS = ("shared_prefix", "multi_turn", "mooncake")
CHAT_TURNS = 6
RUN_TRIES = 5  # runs of one cell before a cause that keeps coming back fails the sweep
_METRICS = (  # summarized per (router, workload, rate, generator): median, min and max over repeats
    "hit_rate",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "output_tokens_per_s",
    "requests_max_over_mean",
    "prefill_max_over_mean",
    "added_p50_ms",
    "added_p90_ms",
    "router_cpu_ms_per_request",
    "replicas_cpu_ms_per_request",
    "system_cpu_ms_per_request",
)


@dataclass(frozen=True)
class PeersConfig:
    out: str
    venv: Path
    cache_dir: Path
    replicas: int = 4
    num_kv_blocks: int = 160
    load: GuidellmLoad = DEFAULT_LOAD  # the shape; its rate and seed are the sweep's
    rates: tuple[float, ...] = (2.0, 4.0, 6.0)
    repeats: int = 3
    workloads: tuple[str, ...] = WORKLOADS
    overhead_pairs: int = 60
    contenders: tuple[Contender, ...] = SWEEP_CONTENDERS
    guidellm: bool = True  # False: kvmesh's load generator only (no peer venv needed for kvmesh routers)
    model_dir: Path | None = None  # None: the demo's tiny model, built once in cache_dir
    docs: Path | None = None  # write the results as a section of this document (docs/experiments.md)
    resume: bool = False  # keep the runs rows.jsonl already has (a sweep cut short) and run the rest
    one_router: bool = False  # one router process per contender through all its runs, as in production
    guidellm_only: bool = False  # the shared-prefix cell through guidellm alone (no kvmesh-generator runs)
    engine: str = "kvmesh"  # what the replicas run: kvmesh's engine or real vLLM servers
    vllm_python: str | None = None  # engine "vllm": the Python that has vLLM

    @property
    def main_generator(self) -> str:
        """Whose numbers the summary's targets and plots use for the shared-prefix shape."""
        return "guidellm" if self.guidellm else "kvmesh_loadgen"

    def generators(self, workload: str) -> tuple[str, ...]:
        if workload == "shared_prefix" and self.guidellm:
            return ("guidellm",) if self.guidellm_only else ("guidellm", "kvmesh_loadgen")
        return ("kvmesh_loadgen",)  # multi-turn is closed loop: kvmesh's generator for every router

    @property
    def scratch(self) -> Path:
        """Beside the JSON: router logs, guidellm reports and the kept rows."""
        return Path(self.out).resolve().with_suffix("")

    @property
    def kept_rows(self) -> Path:
        """Each run's row, appended as it lands: what a cut-short sweep still has."""
        return self.scratch / "rows.jsonl"


@dataclass
class _Bench:
    """What every run shares: replicas, model, its word table, a scratch folder."""

    config: PeersConfig
    model: Path
    words: list[str]
    scratch: Path  # router logs, guidellm reports
    replicas: list[Replica]
    cluster: LocalCluster
    http: httpx.AsyncClient
    kept: dict[str, RouterProcess] = field(default_factory=dict)  # with ``one_router``: by contender

    def new_router(self, contender: Contender, stem: str) -> RouterProcess:
        """A router process in front of the replicas, not started yet, logging to ``stem``.log."""
        port = free_port()
        workers = [r.http_url for r in self.replicas]
        command = router_command(
            contender, self.config.venv, port, workers, str(self.model), self.cluster.redis_url
        )
        log = self.scratch / f"{stem}.log"
        return RouterProcess(contender, command, port, log, self.cluster.router_environment())

    @contextlib.asynccontextmanager
    async def router(self, contender: Contender, stem: str) -> AsyncIterator[RouterProcess]:
        """The run's router: a new process, stopped after the run, or with ``one_router`` the
        contender's kept one (started at its first run, or again if it exited; ``stop_routers``
        stops it)."""
        if not self.config.one_router:
            async with self.new_router(contender, stem) as router:
                yield router
            return
        kept = self.kept.get(contender.name)
        if kept is None or kept.proc.poll() is not None:
            if kept is not None:
                progress(f"  {contender.name}'s router exited ({kept.proc.returncode}); starting a new one")
            kept = self.kept[contender.name] = await self.new_router(contender, stem).start()
        yield kept

    def stop_routers(self) -> None:
        """The kept routers' end: the sweep's, or its error's."""
        for router in self.kept.values():
            router.stop()

    async def run(
        self, contender: Contender, workload: str, rate: float, generator: str, repeat: int
    ) -> dict:
        """A router process, its overhead, cold caches, one load: one row."""
        stem = f"{contender.name.replace(' ', '-')}-{workload}-{rate:g}-{generator}-{repeat}"
        async with self.router(contender, stem) as router:
            overhead = await router_overhead(
                self.http, router.url, self.replicas, self.model.name, self.config.overhead_pairs
            )
            await reset_caches(self.cluster, self.http, self.replicas)
            await asyncio.sleep(2.5)  # kvmesh's speculative entries from the overhead probe expire
            replica_pids = list((await self.cluster.replica_pids()).values())  # asked each run: restarts
            before, cpu_before = await counters(self.http, self.replicas), router.cpu_seconds()
            replicas_cpu_before = sum(map(process_cpu_seconds, replica_pids))
            kvmesh = contender.router == "kvmesh"
            account = await router_account(self.http, router.url) if kvmesh else None
            load = dataclasses.replace(self.config.load, rate=rate, seed=self.config.load.seed + repeat)
            client = await self.drive(
                workload, generator, load, router.url, contender.name, self.scratch / f"{stem}.json"
            )
            cpu_s = router.cpu_seconds() - cpu_before
            replicas_cpu_s = sum(map(process_cpu_seconds, replica_pids)) - replicas_cpu_before
            after = await counters(self.http, self.replicas)
            served_counts = served(before, after)
            costs = {rid: round(1e6 * c["prefill_token_s"], 1) for rid, c in after.items()}
            if kvmesh:  # the router's own account of this run
                account = {
                    k: int(v) for k, v in ((await router_account(self.http, router.url)) - account).items()
                }
        requests = max(1, sum(served_counts["requests_per_replica"].values()))
        cpu = {  # the replicas' too: kvmesh's router tokenizes for them, the peers leave it to them
            "router_cpu_ms_per_request": 1000 * cpu_s / requests,
            "replicas_cpu_ms_per_request": 1000 * replicas_cpu_s / requests,
            "system_cpu_ms_per_request": 1000 * (cpu_s + replicas_cpu_s) / requests,
        }
        return {
            "router": contender.name,
            "workload": workload,
            "rate": rate,
            "repeat": repeat,
            "generator": generator,
            "router_pid": router.proc.pid,  # with one_router: which runs one process served
            **client,
            **served_counts,
            **overhead,
            **cpu,
            "replica_prefill_us_per_token": costs,
            **({"router_account": account} if kvmesh else {}),
        }

    async def run_honest(
        self, contender: Contender, workload: str, rate: float, generator: str, repeat: int
    ) -> dict:
        """``run``, again from cold caches (at most ``RUN_TRIES`` times) when it did not measure
        what it was meant to: guidellm sent a burst, or a router's port was taken (the row
        counts the runs thrown away)."""
        for discarded in range(RUN_TRIES):
            try:
                return await self.run(contender, workload, rate, generator, repeat) | {
                    "runs_discarded": discarded
                }
            except RunAgain as why:
                progress(f"  {type(why).__name__}: {str(why)[-300:]}; running again")
                last = why
        raise RuntimeError(f"{RUN_TRIES} runs of one cell in a row did not measure it: {last}")

    async def drive(
        self, workload: str, generator: str, load: GuidellmLoad, url: str, label: str, report: Path
    ) -> dict:
        """The load, as the client saw it."""
        if generator == "guidellm":
            return await asyncio.to_thread(
                run_guidellm, load, self.config.venv, url, self.model.name, str(self.model), report
            )
        if workload in ("shared_prefix", "mooncake"):
            if workload == "shared_prefix":  # Poisson arrivals at the load's rate
                requests, pacing = (
                    shared_prefix(
                        num_groups=load.prefix_count,
                        prompts_per_group=max(1, load.requests // load.prefix_count),
                        system_prompt_len=load.prefix_tokens,
                        question_len=load.prompt_tokens,
                        output_len=load.output_tokens,
                        seed=load.seed,
                    ),
                    {"rate": load.rate},
                )
            else:  # the trace's own arrival times, scaled to the rate
                requests, pacing = mooncake_at(load), {"use_arrival_times": True}
            texts = as_text(requests, self.words)
            records = await run_http_load(
                url, requests, texts, label, self.model.name, concurrency=256, seed=load.seed, **pacing
            )
        else:  # rate r: r conversations at once, each sending its next turn when answered
            chats = conversations(
                multi_turn(
                    num_sessions=max(1, load.requests // CHAT_TURNS),
                    turns=CHAT_TURNS,
                    system_prompt_len=load.prefix_tokens,
                    user_len=load.prompt_tokens,
                    answer_len=load.output_tokens,
                    seed=load.seed,
                )
            )
            records = await run_http_conversations(
                url,
                chats,
                lambda segment: segment_text(segment, self.words),
                label,
                self.model.name,
                concurrency=max(1, round(load.rate)),
            )
        summary = summarize(records)
        return {k: summary[k] for k in _LOADGEN_KEYS} | {"client_hit_rate": summary["hit_rate"]}


async def run(config: PeersConfig) -> dict:
    model = (config.model_dir or demo_model(config.cache_dir)).resolve()  # guidellm runs elsewhere
    replica, engine = {}, {"num_kv_blocks": config.num_kv_blocks}
    if config.engine == "vllm":
        replica = {"engine_kind": "vllm", "vllm_python": config.vllm_python}
        engine["max_model_len"] = 2048  # vLLM refuses a pool smaller than one longest request
    cluster_config = ClusterConfig.for_model(
        str(model),
        config.replicas,
        engine=engine,
        replica=replica,
        with_router=False,
    )
    progress(
        f"starting {config.replicas} {config.engine} replicas ({config.num_kv_blocks} KV blocks each) ..."
    )
    rows: list[dict] = []
    # open replicas (loopback): the bench reads their own counters and calls them directly
    async with (
        LocalCluster(cluster_config, open_replicas=True) as cluster,
        httpx.AsyncClient(timeout=120) as http,
    ):
        replicas = await replicas_of(cluster)
        bench = _Bench(
            config,
            model,
            word_table(model),
            config.scratch,
            replicas,
            cluster,
            http,
        )
        bench.scratch.mkdir(parents=True, exist_ok=True)
        rows = resumed_rows(config)
        config.kept_rows.write_text("".join(json.dumps(row) + "\n" for row in rows))
        prompt = "".join(bench.words[: config.load.prefix_tokens + config.load.prompt_tokens])
        baseline = await unloaded_ttft_ms(http, replicas[0], model.name, prompt)
        try:
            for repeat, cells in sweep_plan(config, rows):
                for n, (contender, workload, rate, generator) in enumerate(cells, 1):
                    progress(
                        f"repeat {repeat + 1}/{config.repeats}, run {n}/{len(cells)}: {contender.name}, {workload} at {rate:g}/s, {generator} ..."
                    )
                    row = await bench.run_honest(contender, workload, rate, generator, repeat)
                    rows.append(row)
                    with config.kept_rows.open("a") as kept:
                        kept.write(json.dumps(row) + "\n")
                    progress(f"  {_line(row)}")
        finally:
            bench.stop_routers()
    return _report(config, rows, baseline)


def _run_key(row: dict) -> tuple:
    return row["router"], row["workload"], row["rate"], row["generator"], row["repeat"]


def sweep_plan(config: PeersConfig, done: list[dict]) -> list[tuple[int, list[tuple]]]:
    """Each repeat's runs in its own seeded order, without the ones ``done`` already has (a
    resumed sweep runs exactly what the cut-short one had left, in the order it would have).

    With ``one_router`` a repeat runs each contender's runs back to back (contenders in the
    order the shuffle first meets them, each one's runs in shuffled order): its kept router
    then goes from one run straight into its next, as a router serving without pause does,
    instead of idling through other routers' runs, and the others idle while it runs."""
    finished = {_run_key(row) for row in done}
    plan = []
    for repeat in range(config.repeats):
        cells = [
            (c, w, rate, g)
            for c in config.contenders
            for w in config.workloads
            for rate in config.rates
            for g in config.generators(w)
        ]
        random.Random(config.load.seed + repeat).shuffle(cells)
        if config.one_router:
            contenders = list(dict.fromkeys(c for c, *_ in cells))
            cells.sort(key=lambda cell: contenders.index(cell[0]))  # stable: shuffled within
        left = [cell for cell in cells if (cell[0].name, *cell[1:], repeat) not in finished]
        if left:
            plan.append((repeat, left))
    return plan


def resumed_rows(config: PeersConfig) -> list[dict]:
    """The runs a cut-short sweep kept, when resuming; ValueError when they are not all runs
    of this sweep (other flags: their rows would be summarized with this sweep's)."""
    if not config.resume or not config.kept_rows.exists():
        return []
    rows = [json.loads(line) for line in config.kept_rows.read_text().splitlines() if line.strip()]
    planned = {(c.name, *cell, repeat) for repeat, cells in sweep_plan(config, []) for c, *cell in cells}
    foreign = [row for row in rows if _run_key(row) not in planned]
    if foreign:
        raise ValueError(
            f"--resume: {config.kept_rows} holds {len(foreign)} runs this sweep does not have "
            f"(first: {_run_key(foreign[0])}); resume with the flags it was started with"
        )
    return rows


def _line(s: dict) -> str:
    return (
        f"hit {s['hit_rate']:.3f}, TTFT p50 {s['ttft_p50_ms']:.0f} ms p90 {s['ttft_p90_ms']:.0f} ms, "
        f"{s['errors']} errors, per replica {s['spread']}, added {s['added_p50_ms']:.2f} ms"
    )


_CELL = ("router", "workload", "rate", "generator")  # what a summary row is about


def summarize_rows(rows: list[dict]) -> list[dict]:
    """One row per (router, workload, rate, generator): medians, min and max over repeats,
    and the errors of all its runs."""
    summary = over_repeats(rows, _CELL, _METRICS)
    for row in summary:
        row["errors"] = sum(r["errors"] for r in rows if all(r[k] == row[k] for k in _CELL))
    return summary


def cell_targets(summary: list[dict], generator_of: dict[str, str]) -> list[dict]:
    """Per (workload, rate): kvmesh prefix's median hit rate >= the best other's - 0.01, and its
    median p90 TTFT <= 1.05 x the fastest other's (peers and kvmesh's own policies alike)."""
    checks, strict_wins = [], []
    for workload, generator in generator_of.items():
        for rate in sorted({s["rate"] for s in summary if s["workload"] == workload}):
            cell = [
                s
                for s in summary
                if s["workload"] == workload and s["rate"] == rate and s["generator"] == generator
            ]
            ours = next((s for s in cell if s["router"] == "kvmesh prefix"), None)
            others = [s for s in cell if s["router"] != "kvmesh prefix"]
            if ours is None or not others:
                continue
            best = max(others, key=lambda s: s["hit_rate_median"])
            fastest = min(others, key=lambda s: s["ttft_p90_ms_median"])
            where = f"{workload} at {rate:g}/s ({generator})"
            checks.append(
                target(
                    f"hit rate median, {where}: kvmesh prefix - {best['router']}",
                    round(ours["hit_rate_median"] - best["hit_rate_median"], 4),
                    ">=",
                    -0.01,
                )
            )
            checks.append(
                target(
                    f"TTFT p90 median, {where}: kvmesh prefix / {fastest['router']}",
                    _ratio(ours["ttft_p90_ms_median"], fastest["ttft_p90_ms_median"]),
                    "<=",
                    1.05,
                )
            )
            strict_wins.append(
                ours["hit_rate_median"] > best["hit_rate_median"]
                and ours["ttft_p90_ms_median"] < fastest["ttft_p90_ms_median"]
            )
    if strict_wins:
        checks.append(
            target(
                f"cells (of {len(strict_wins)}) where kvmesh prefix is strictly better on both",
                sum(strict_wins),
                ">=",
                len(strict_wins) // 2 + 1,
            )
        )
    return checks


def _report(config: PeersConfig, rows: list[dict], unloaded_ms: float) -> dict:
    summary = summarize_rows(rows)
    generator_of = {
        w: config.main_generator if w == "shared_prefix" else "kvmesh_loadgen" for w in config.workloads
    }
    return {
        "benchmark": "peers",
        "config": {
            "replicas": config.replicas,
            "engine": config.engine,
            "num_kv_blocks": config.num_kv_blocks,
            "load": asdict(config.load),
            "rates": list(config.rates),
            "repeats": config.repeats,
            "workloads": list(config.workloads),
            "main_generator": config.main_generator,
            "generator_of": generator_of,
            "one_router": config.one_router,
        },
        "unloaded_cold_ttft_ms": unloaded_ms,
        "runs_discarded": sum(r["runs_discarded"] for r in rows),
        "rows": rows,
        "summary": summary,
        "targets": cell_targets(summary, generator_of),
        "environment": environment(),
    }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("inf")


_SWEEP_TABLE = [
    ("hit rate", "hit_rate", "{:.3f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p90", "ttft_p90_ms", "{:.0f}"),
    ("TTFT p99", "ttft_p99_ms", "{:.0f}"),
    ("tok/s", "output_tokens_per_s", "{:.0f}"),
    ("requests max/mean", "requests_max_over_mean", "{:.2f}"),
    ("prefill max/mean", "prefill_max_over_mean", "{:.2f}"),
    ("added p50", "added_p50_ms", "{:.2f}"),
    ("added p90", "added_p90_ms", "{:.2f}"),
    ("router CPU ms/req", "router_cpu_ms_per_request", "{:.2f}"),
    ("router+replicas CPU ms/req", "system_cpu_ms_per_request", "{:.1f}"),
]


def _cell(s: dict, key: str, fmt: str) -> str:
    if f"{key}_median" not in s:
        return "-"
    median, low, high = (fmt.format(s[f"{key}_{part}"]) for part in ("median", "min", "max"))
    return median if s["runs"] == 1 else f"{median} [{low}-{high}]"


LOPSIDED = 1.6  # requests max/mean over which a run counts as piled on one replica


def lopsided_runs(rows: list[dict], summary: list[dict]) -> list[str]:
    """Per kvmesh cell of ``summary``, how many of its runs were lopsided: a median over
    repeats hides the one run in many where a router piles requests on one replica."""
    lines = []
    for s in summary:
        if s["router"].startswith("kvmesh "):
            spreads = [r["requests_max_over_mean"] for r in rows if all(r[k] == s[k] for k in _CELL)]
            above = sum(spread > LOPSIDED for spread in spreads)
            lines.append(
                f"- {s['router']} at {s['rate']:g}/s: runs with requests max/mean above {LOPSIDED:g}: "
                f"{above} of {len(spreads)}"
            )
    return lines


def write_tables(result: dict, out: str) -> str:
    """Markdown tables (one per workload and load generator: medians [min-max] over repeats;
    TTFT and added latency in ms), each with its kvmesh cells' lopsided runs, and plots beside
    the JSON."""
    routers = (
        "one router process per contender through all its runs (caches reset between runs)"
        if result["config"]["one_router"]
        else "a new router process per run"
    )
    sections = [f"Routers: {routers}."]
    for workload in result["config"]["workloads"]:
        for generator in ("guidellm", "kvmesh_loadgen"):
            rows = [s for s in result["summary"] if s["workload"] == workload and s["generator"] == generator]
            if not rows:
                continue
            rows = sorted(rows, key=lambda s: (s["rate"], s["router"]))
            cells = [
                (s["router"], {"rate": f"{s['rate']:g}"} | {k: _cell(s, k, f) for _, k, f in _SWEEP_TABLE})
                for s in rows
            ]
            columns = [("rate/s", "rate", "{}"), *((h, k, "{}") for h, k, _ in _SWEEP_TABLE)]
            table = markdown_table(cells, columns, first="router")
            lopsided = "\n".join(lopsided_runs(result["rows"], rows))
            sections.append(
                f"**{workload}, {generator}** ({rows[0]['runs']} runs per cell)\n\n{table}"
                + (f"\n\n{lopsided}" if lopsided else "")
            )
            plot_sweep_bands(
                Path(out).with_name(f"{Path(out).stem}_{workload}_{generator}.png"),
                rows,
                f"{workload} ({generator})",
            )
    text = "\n\n".join(sections) + "\n"
    Path(out).with_suffix(".md").write_text(text)
    return text


def plot_sweep_bands(path: Path, summary: list[dict], title: str) -> None:
    """Hit rate and p90 TTFT vs rate, one line per router (medians), min-max bands."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for router in sorted({s["router"] for s in summary}):
        points = sorted((s for s in summary if s["router"] == router), key=lambda s: s["rate"])
        rates = [s["rate"] for s in points]
        for ax, key in zip(axes, ("hit_rate", "ttft_p90_ms"), strict=True):
            (line,) = ax.plot(rates, [s[f"{key}_median"] for s in points], marker="o", label=router)
            ax.fill_between(
                rates,
                [s[f"{key}_min"] for s in points],
                [s[f"{key}_max"] for s in points],
                color=line.get_color(),
                alpha=0.15,
            )
    axes[0].set_ylabel("hit rate (replicas' counters)")
    axes[1].set_ylabel("TTFT p90 (ms)")
    for ax in axes:
        ax.set_xlabel("requests / s (multi-turn: conversations at once)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(result: dict, tables: str, out: str, docs: Path) -> None:
    """The results as the ``bench peers`` section of ``docs`` (plots copied to docs/img/)."""
    c, load = result["config"], result["config"]["load"]
    images = []
    for workload, generator in c["generator_of"].items():
        plot = Path(out).with_name(f"{Path(out).stem}_{workload}_{generator}.png")
        if plot.is_file():
            image = docs.parent / "img" / f"peers_{workload}.png"
            image.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(plot, image)
            images.append(f"![peers {workload}](img/{image.name})")
    checks = "\n".join(
        f"| {t['target']} | {t['value']} | {t['bound']} | {'yes' if t['met'] else '**no**'} |"
        for t in result["targets"]
    )
    setup = (
        f"{c['replicas']} CPU replicas of the demo's tiny Qwen3, {c['num_kv_blocks']} KV blocks each (room for a few "
        "of the shared prefixes, not all). Each router in turn fronts them over OpenAI HTTP, from cold caches, under "
        f"the same seeded loads, rates {', '.join(f'{r:g}' for r in c['rates'])}/s, {c['repeats']} repeats (each with "
        "its own seed and a shuffled run order). Shared prefix: "
        f"{load['prefix_count']} prefixes of {load['prefix_tokens']} tokens + {load['prompt_tokens']} unique tokens, "
        f"{load['output_tokens']} out, Poisson, {load['requests']} requests, from guidellm and kvmesh's own generator. "
        f"Multi-turn: {CHAT_TURNS}-turn conversations (8 system prompts of {load['prefix_tokens']} tokens, "
        f"{load['prompt_tokens']}-token messages, {load['output_tokens']}-token answers resent as given), closed loop, "
        "'rate' conversations at once. Mooncake: the synthetic trace's last "
        f"{load['requests']} requests with {MOONCAKE_BLOCK_TOKENS}-token blocks, answers capped at "
        f"{load['output_tokens']} tokens, its timestamps rescaled to the rate (bursts kept). The hit rate is what the replicas counted (their /metrics). Added latency: "
        "the same cached 1-token request through the router and straight to a replica, interleaved, in every run. "
        f"A lone cold request takes {result['unloaded_cold_ttft_ms']} ms. Cells: median [min-max] over repeats."
    )
    body = "\n\n".join(
        [
            "## Side by side with real peers: sglang-router and vllm-router (`kvmesh bench peers --docs docs/experiments.md`)",
            setup,
            "| target | value | bound | met |\n|---|---:|---|---|\n" + checks,
            tables.rstrip(),
            *images,
        ]
    )
    write_section(docs, PEERS_SECTION, body)


def main(config: PeersConfig) -> int:
    """The whole comparison (the command checked the peers are installed)."""
    result = asyncio.run(run(config))
    write_result(config.out, result)
    tables = write_tables(result, config.out)
    print(tables)
    for t in result["targets"]:
        print(f"{'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']} ({t['bound']})")
    if config.docs:
        write_docs(result, tables, config.out, config.docs)
        print(f"updated {config.docs}")
    return 0
