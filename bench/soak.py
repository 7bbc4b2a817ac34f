"""``kvmesh bench soak``: steady load through the router while replicas are killed.

Closed-loop clients send shared-prefix requests over gRPC for ``duration`` seconds; every
``kill_every`` seconds a random replica actor is killed (the supervisor replaces it), but
never the last one the router sees live: a kill waits until another replica serves (with
two replicas and a slow replacement, killing the other one would leave nothing to serve).
Reported per minute: requests, errors by status code, p99 latency; and the resident memory
of every long-lived process (this process, which hosts the router; Redis; each replica
incarnation), which must stay flat once warm, with the router's open files beside it.

No ordinary request may fail: one whose replica is killed before it answered moves to
another (failover), one that was streaming continues on another (migration). Each failure
is still classified, for the report: streaming from a replica killed while it ran, or
anything else. With ``flood``, a second tenant's clients (``FLOOD`` ones, in two priority
bands) join the ordinary ones (tenant ``steady``): the router's flow control must keep the
steady tenant's time to first token as it was without them (``--calm-first``), queueing and
shedding the flood's requests instead. With ``hostile``, clients of ``hostile.py`` mix bad, oversized, slow
and vanishing requests of every kind into the load: each must get its clean answer, and no
ordinary request may fail because of them; ``idle`` and ``slowloris`` connections are held
open against the router's HTTP port, and each must be dropped within the server's bounds.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvmesh.bench.measure.common import environment, progress, target, write_result
from kvmesh.bench.measure.demo_model import demo_model
from kvmesh.bench.measure.stats import percentile
from kvmesh.bench.measure.workloads import shared_prefix
from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.launcher import LocalCluster
from kvmesh.protos import pb, pb_grpc
from kvmesh.router.flow import FlowConfig
from kvmesh.serving.connections import ConnectionLimits
from kvmesh.serving.metrics import read_samples

HOSTILE_WRITE_TIMEOUT_S = 5.0
# After the attackers' process ends, the router's open files and memory are read this much
# later (its sockets are closed when the process ends; the server sees it within a loop turn).
AFTER_ATTACK_S = 10.0
# With a calm run first: the ordinary requests' p90 under attack, at most this times the calm one.
CALM_P90_RATIO = 1.2  # with hostile clients: their slow readers are cut off within the run
# With a flood and a calm run first: the steady tenant's p90 time to first token, at most this
# times its calm one.
FLOOD_TTFT_RATIO = 1.2
FLOOD_BANDS = ("normal", "batch")  # the flood's clients alternate between these
REFUSED_PAUSE_S = 0.2  # a client refused for load waits this long before its next request
HELD_OPEN_MAX_S = 30.0  # the longest a held-open connection may live: the head timeout, the linger, slack


@dataclass(frozen=True)
class SoakLoad:
    """What one soak run puts on the cluster (``kvmesh bench soak``'s flags)."""

    duration: float
    replicas: int
    clients: int
    kill_every: float
    seed: int = 0
    hostile_clients: int = 0
    idle: int = 0
    slowloris: int = 0
    flood: int = 0
    max_queue_delay_s: float | None = None
    max_num_seqs: int | None = None
    flow_control: bool = True

    def calm(self) -> SoakLoad:
        """The baseline: the same ordinary load and replicas, without hostile clients,
        held-open connections or flood, on the router's default flow control."""
        return SoakLoad(
            self.duration,
            self.replicas,
            self.clients,
            self.kill_every,
            self.seed,
            max_num_seqs=self.max_num_seqs,
        )


def _flood_targets(result: dict, calm_first: bool) -> list[dict]:
    """The steady tenant served as without the flood; the flood queued and shed instead."""
    flow = result["flood"]["flow_by_tenant"]
    flood_shed = sum(flow.get("flood", {}).get("shed", {}).values())
    steady_shed = sum(flow.get("steady", {}).get("shed", {}).values())
    out = [target("steady requests refused by flow control", steady_shed, "<=", 0)]
    if result["flow_control"]:
        queued = flow.get("flood", {}).get("queued", 0)
        out += [
            target("flood requests that waited at the router", queued, ">=", 1),
            target("flood requests refused by flow control", flood_shed, ">=", 1),
        ]
    if calm_first and result["calm"]["ttft_p90_ms"] and result["ttft_p90_ms"]:
        ratio = round(result["ttft_p90_ms"] / result["calm"]["ttft_p90_ms"], 3)
        out.append(target("steady tenant's p90 TTFT under the flood / calm", ratio, "<=", FLOOD_TTFT_RATIO))
    return out


def rss_mb(pid: int) -> float | None:
    """Resident memory of a process (Linux /proc), or None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def open_files(pid: int) -> int | None:
    """How many files (sockets included) a process holds open (Linux /proc), or None if it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


async def closed_loop_client(
    address: str,
    requests,
    stop: asyncio.Event,
    t0: float,
    log: list,
    failures: list,
    key: tuple[str, str] | None = None,
    ttfts: list | None = None,
) -> None:
    """Send ``requests`` round-robin until ``stop``; (start, code, seconds) per request into
    ``log``, its failures into ``failures``, each served one's seconds to its first response
    into ``ttfts``. ``key``: the (tenant, priority band) it sends as."""
    metadata = (("x-kvmesh-tenant", key[0]), ("x-kvmesh-priority", key[1])) if key else None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RouterStub(channel)
        i = random.randrange(len(requests))
        while not stop.is_set():
            req = requests[i % len(requests)]
            i += 1
            msg = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=req.tokens()),
                sampling=pb.SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True),
            )
            start, responses, first = time.perf_counter(), 0, 0.0
            try:
                async for _ in stub.Generate(msg, timeout=60, metadata=metadata):
                    if not responses:
                        first = time.perf_counter() - start
                    responses += 1
                code = "OK"
                if ttfts is not None:
                    ttfts.append(first)
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                failures.append(
                    {
                        "at_s": round(start - t0, 2),
                        "after_s": round(time.perf_counter() - start, 2),
                        "code": code,
                        "responses": responses,
                        "details": exc.details(),
                    }
                )
            log.append((start - t0, code, time.perf_counter() - start))
            if code == "RESOURCE_EXHAUSTED":
                await asyncio.sleep(REFUSED_PAUSE_S)


def killed_while_streaming(failure: dict, kill_times: list[float]) -> bool:
    """A failure a replica's death explains: its stream had started, it ended with the
    replica's UNAVAILABLE (its move refused: the migration limit, or no replica left), and a
    replica was killed while it ran."""
    began, ended = failure["at_s"], failure["at_s"] + failure["after_s"]
    return (
        failure["code"] == "UNAVAILABLE"
        and failure["responses"] > 0
        and failure["details"].startswith("replica error")
        and any(began - 0.5 <= k <= ended for k in kill_times)
    )


def classify_failures(failures: list[dict], kill_times: list[float]) -> dict:
    killed = sum(killed_while_streaming(f, kill_times) for f in failures)
    other = [f for f in failures if not killed_while_streaming(f, kill_times)]
    return {"streaming_from_a_killed_replica": killed, "other": len(other), "other_examples": other[:20]}


def soak_config(model_dir: str, load: SoakLoad) -> ClusterConfig:
    """The soak's deployment: with hostile clients, HTTP too, and slow readers cut off within
    the run; flow control as the load asks."""
    abused = bool(load.hostile_clients or load.idle or load.slowloris)
    cut_soon = ConnectionLimits(stream_write_timeout_s=HOSTILE_WRITE_TIMEOUT_S)
    hostile = {"connections": cut_soon} if abused else {}
    flow = FlowConfig(tenants="steady,flood", flow_control="on" if load.flow_control else "off")
    if load.max_queue_delay_s is not None:
        flow = dataclasses.replace(flow, max_queue_delay_s=load.max_queue_delay_s)
    return ClusterConfig.for_model(
        model_dir,
        load.replicas,
        engine={"num_kv_blocks": 1024, **({"max_num_seqs": load.max_num_seqs} if load.max_num_seqs else {})},
        router={"port": 0, "http_port": 0 if abused else -1, "flow": flow, **hostile},
        replica={"heartbeat_s": 0.5, "ttl_s": 3.0, **hostile},
    )


async def _kill_and_sample(cluster, load: SoakLoad, rng, t0: float, log, memory, files, kill_times) -> None:
    """Until the run's end: memory and open files every 10 s, and a replica killed every
    ``kill_every`` seconds (never the last one serving)."""
    next_kill, next_sample = load.kill_every, 0.0
    while (now := time.perf_counter() - t0) < load.duration:
        if now >= next_sample:
            await _sample_memory(cluster, now, memory, files)
            next_sample += 10.0
            errors = sum(1 for e in log if e[1] != "OK")
            progress(f"{now:5.0f}s  {len(log)} requests, {errors} errors, {len(kill_times)} kills")
        live = sorted(e.record.replica_id for e in cluster.router.registry.live())
        if load.kill_every and now >= next_kill and len(live) >= 2:
            import ray

            ray.kill(cluster.supervisor.actors[rng.choice(live)])
            kill_times.append(round(now, 2))
            next_kill = max(next_kill, now) + load.kill_every  # a kill that waited moves the next
        await asyncio.sleep(0.2)


async def run(model_dir: str, load: SoakLoad) -> dict:
    rng = random.Random(load.seed)
    requests = shared_prefix(
        num_groups=16,
        prompts_per_group=16,
        system_prompt_len=256,
        question_len=32,
        output_len=16,
        seed=load.seed,
    )
    config = soak_config(model_dir, load)
    log: list[tuple[float, str, float]] = []
    memory: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    files: list[tuple[float, int]] = []  # the router's open files
    kill_times: list[float] = []
    failures: list[dict] = []
    ttfts: list[float] = []
    flooded: list[tuple[float, str, float]] = []
    async with LocalCluster(config) as cluster:
        cluster.supervisor.check_s = 0.5
        stop = asyncio.Event()
        t0 = time.perf_counter()
        address = cluster.router_address
        steady = ("steady", "normal") if load.flood else None
        workers = [
            asyncio.create_task(closed_loop_client(address, requests, stop, t0, log, failures, steady, ttfts))
            for _ in range(load.clients)
        ]
        workers += [  # the flood: half its clients in the sheddable band
            asyncio.create_task(
                closed_loop_client(address, requests, stop, t0, flooded, [], ("flood", FLOOD_BANDS[i % 2]))
            )
            for i in range(load.flood)
        ]
        files_before = open_files(os.getpid())  # the router's, before any attack
        abuse = _start_hostile(cluster, load)
        await _kill_and_sample(cluster, load, rng, t0, log, memory, files, kill_times)
        stop.set()
        await asyncio.gather(*workers)
        hostile_report = await abuse if abuse is not None else None  # its last requests, still served
        await _sample_memory(cluster, time.perf_counter() - t0, memory, files)
        after_attack = None
        if abuse is not None:  # the attackers' process ended: what the router still holds
            await asyncio.sleep(AFTER_ATTACK_S)
            after_attack = {
                "open_files_before": files_before,
                "open_files_after": open_files(os.getpid()),
                "rss_mb_after": rss_mb(os.getpid()),
            }
        restarts = cluster.supervisor.restarts
        metrics = cluster.router.core.render_metrics().decode()
        trust = index_trust_report(metrics)
        samples = read_samples(metrics)
        series = sum(1 for (name, _) in samples if name == "kvmesh_router_requests_total")
    result = {
        "index_trust": trust,
        "minutes": _per_minute(log, files),
        "memory": _memory_report(memory),
        "kills": len(kill_times),
        "kill_times_s": kill_times,
        "failures": failures,
        "restarts": restarts,
        "requests": len(log),
        "p90_ms": ordinary_p90_ms(log),
        "ttft_p90_ms": round(percentile(ttfts, 0.9) * 1e3, 1) if ttfts else None,
        "errors": dict(collections.Counter(c for _, c, _ in log if c != "OK")),
        "failed_ordinary": classify_failures(failures, kill_times),
        "request_series": series,
    }
    if hostile_report is not None:
        result["hostile"] = hostile_report
        result["router_after_attack"] = after_attack
    if load.flood:
        result["flood"] = {
            "clients": load.flood,
            "requests": len(flooded),
            "codes": dict(collections.Counter(c for _, c, _ in flooded)),
            "flow_by_tenant": flow_report(samples),
        }
    return result


def flow_report(samples: dict) -> dict:
    """Per tenant: requests that waited at the router, and those it refused (by why)."""
    out: dict[str, dict] = collections.defaultdict(lambda: {"queued": 0, "shed": {}})
    for (name, labels), value in samples.items():
        label = dict(labels)
        if name == "kvmesh_router_flow_queued_total":
            out[label["tenant"]]["queued"] += int(value)
        elif name == "kvmesh_router_flow_shed_total":
            shed = out[label["tenant"]]["shed"]
            shed[label["reason"]] = shed.get(label["reason"], 0) + int(value)
    return dict(out)


def _start_hostile(cluster: LocalCluster, load: SoakLoad):
    """The hostile clients and held-open connections, in a process of their own (None without any)."""
    if not (load.hostile_clients or load.idle or load.slowloris):
        return None
    from kvmesh.bench.hostile import Target, run_hostile  # needs httpx

    vocab = cluster.router.core.model.vocab_size
    aim = Target(cluster.router_address, cluster.http_url, vocab, HOSTILE_WRITE_TIMEOUT_S)
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    running = asyncio.get_running_loop().run_in_executor(
        pool, run_hostile, aim, load.hostile_clients, load.duration, load.seed, load.idle, load.slowloris
    )
    running.add_done_callback(lambda _: pool.shutdown(wait=False))
    return running


def index_trust_report(metrics_text: str) -> dict:
    """The router's verdicts on its index over the run: every time it stopped trusting a
    replica's entries (no index fault is injected here, so each one is a false alarm), the
    misses by cause, the resyncs asked and the restarts seen."""
    samples = read_samples(metrics_text)

    def by(name: str, key: str) -> dict[str, float]:
        out: dict[str, float] = collections.Counter()
        for (n, labels), v in samples.items():
            if n == name:
                out[dict(labels)[key]] += v
        return dict(out)

    alarms = {
        f"{dict(labels)['state']}/{dict(labels)['cause']}": v
        for (n, labels), v in samples.items()
        if n == "kvmesh_router_replica_index_state_changes_total" and dict(labels)["state"] != "EXACT"
    }
    return {
        "false_alarms": sum(alarms.values()),
        "alarms": alarms,
        "misses": by("kvmesh_router_prediction_misses_total", "cause"),
        "resyncs": sum(by("kvmesh_router_index_resyncs_total", "replica").values()),
        "restarts_seen": sum(by("kvmesh_router_replica_restarts_total", "replica").values()),
        "requests_checked": samples.get(("kvmesh_router_prediction_error_blocks_count", ()), 0.0),
    }


async def _sample_memory(cluster: LocalCluster, now: float, memory: dict, files: list) -> None:
    held = open_files(os.getpid())
    if held is not None:
        files.append((round(now, 1), held))
    pids = {"router+driver": os.getpid()}
    if cluster.redis is not None and cluster.redis._proc is not None:
        pids["redis"] = cluster.redis._proc.pid
    for replica_id, pid in (await cluster.replica_pids()).items():
        pids[f"{replica_id}/pid{pid}"] = pid
    for name, pid in pids.items():
        mb = rss_mb(pid)
        if mb is not None:
            memory[name].append((round(now, 1), round(mb, 1)))


def ordinary_p90_ms(log: list) -> float | None:
    """The p90 latency of every ordinary request served over the whole run."""
    ok = [d for _, c, d in log if c == "OK"]
    return round(percentile(ok, 0.9) * 1e3, 1) if ok else None


def _per_minute(log: list, files: list[tuple[float, int]]) -> list[dict]:
    rows = []
    for minute in range(int(max((t for t, _, _ in log), default=0) // 60) + 1):
        entries = [e for e in log if minute * 60 <= e[0] < (minute + 1) * 60]
        ok = [d for _, c, d in entries if c == "OK"]
        held = [n for t, n in files if minute * 60 <= t < (minute + 1) * 60]
        rows.append(
            {
                "minute": minute + 1,
                "requests": len(entries),
                "errors": dict(collections.Counter(c for _, c, _ in entries if c != "OK")),
                "p50_ms": round(percentile(ok, 0.5) * 1e3, 1) if ok else None,
                "p99_ms": round(percentile(ok, 0.99) * 1e3, 1) if ok else None,
                "router_open_files": max(held, default=None),
            }
        )
    return rows


def _memory_report(memory: dict) -> dict:
    """Per process: RSS after warm-up (past 60 s) and at the end, each the median of a
    minute of samples (a transient peak, a megabyte body being parsed, is not growth), the
    growth between them, and every sample."""
    out = {}
    for name, samples in memory.items():
        warmed = [mb for t, mb in samples if t >= 60] or [mb for _, mb in samples]
        warm, end = statistics.median(warmed[:6]), statistics.median(warmed[-6:])
        out[name] = {
            "warm_mb": warm,
            "end_mb": end,
            "growth_pct": round(100 * (end - warm) / warm, 1),
            "samples": len(samples),
            "lived_s": round(samples[-1][0] - samples[0][0], 1),
            "rss_mb": samples,
        }
    return out


def soak_targets(result: dict, load: SoakLoad, calm_first: bool) -> list[dict]:
    """The soak's targets, from its result."""
    long_lived = {
        k: v
        for k, v in result["memory"].items()
        if v["lived_s"] >= min(load.duration * 0.8, load.duration - 30)
    }
    worst = max((v["growth_pct"] for v in long_lived.values()), default=0.0)
    errors = sum(result["errors"].values())
    targets = [
        target("memory growth after warm-up, worst long-lived process (%)", worst, "<=", 10.0),
        target(
            "requests that hung until their 60 s deadline",
            result["errors"].get("DEADLINE_EXCEEDED", 0),
            "<=",
            0,
        ),
        target("ordinary requests failed", errors, "<=", 0),
        target(
            "index false alarms (no index fault injected)", result["index_trust"]["false_alarms"], "<=", 0
        ),
    ]
    if load.hostile_clients:
        targets.append(
            target(
                "hostile requests not answered as they must be", result["hostile"]["total_surprises"], "<=", 0
            )
        )
    if load.idle or load.slowloris:
        longest = result["hostile"]["held_longest_s"]
        targets.append(target("longest a held-open connection lived (s)", longest, "<=", HELD_OPEN_MAX_S))
    if result.get("router_after_attack"):
        after = result["router_after_attack"]
        targets.append(
            target(
                f"router open files {AFTER_ATTACK_S:g} s after the attackers left, over those before",
                after["open_files_after"] - after["open_files_before"],
                "<=",
                16,
            )
        )
    if calm_first and load.hostile_clients and result["calm"]["p90_ms"] and result["p90_ms"]:
        ratio = round(result["p90_ms"] / result["calm"]["p90_ms"], 3)
        targets.append(target("ordinary p90 under attack / calm p90", ratio, "<=", CALM_P90_RATIO))
    if load.flood:
        targets += _flood_targets(result, calm_first)
    return targets


def _print_report(result: dict, load: SoakLoad, calm_first: bool) -> None:
    failed = result["failed_ordinary"]
    print(f"\n{'minute':>6}{'requests':>10}{'p50 ms':>9}{'p99 ms':>9}{'files':>7}  errors")
    for row in result["minutes"]:
        print(
            f"{row['minute']:>6}{row['requests']:>10}{row['p50_ms'] or '-':>9}{row['p99_ms'] or '-':>9}"
            f"{row['router_open_files'] or '-':>7}  {json.dumps(row['errors'])}"
        )
    print(
        f"\nordinary p90 {result['p90_ms']} ms"
        + (f" (calm run first: {result['calm']['p90_ms']} ms)" if calm_first else "")
    )
    if result.get("router_after_attack"):
        print(f"router after the attack: {json.dumps(result['router_after_attack'])}")
    print(f"{result['kills']} replicas killed, {result['restarts']} restarted by the supervisor")
    print(
        f"ordinary requests failed: {failed['streaming_from_a_killed_replica']} streaming from a killed replica, "
        f"{failed['other']} otherwise"
    )
    if load.idle or load.slowloris:
        print(f"held-open connections: {json.dumps(result['hostile']['held_open'])}")
    if load.hostile_clients:
        hostile = result["hostile"]
        print(
            f"hostile requests: {hostile['total_sent']} sent ({len(hostile['sent'])} kinds), "
            f"{hostile['total_surprises']} not answered as they must be; "
            f"router request series: {result['request_series']}"
        )
    print(f"index trust: {json.dumps(result['index_trust'])}")
    for name, m in sorted(result["memory"].items()):
        print(
            f"  {name:<28} warm {m['warm_mb']:>8.1f} MB  end {m['end_mb']:>8.1f} MB  growth {m['growth_pct']:>5.1f}%  over {m['lived_s']} s"
        )


def main(out: str, cache_dir: str, load: SoakLoad, calm_first: bool = False) -> int:
    """``calm_first``: the same soak without the hostile clients, held-open connections and
    flood first, as the baseline of the ordinary requests' p90 (and time to first token)."""
    model = str(demo_model(Path(cache_dir)))
    result = {
        "benchmark": "soak",
        "duration_s": load.duration,
        "replicas": load.replicas,
        "clients": load.clients,
        "kill_every_s": load.kill_every,
        "hostile_clients": load.hostile_clients,
        "held_open": {"idle": load.idle, "slowloris": load.slowloris},
        "flood_clients": load.flood,
        "max_queue_delay_s": load.max_queue_delay_s,
        "max_num_seqs": load.max_num_seqs,
        "flow_control": load.flow_control,
        "environment": environment(),
    }
    if calm_first:
        calm = asyncio.run(run(model, load.calm()))
        keep = ("p90_ms", "ttft_p90_ms", "requests", "errors", "minutes", "memory")
        result["calm"] = {k: calm[k] for k in keep}
    result.update(asyncio.run(run(model, load)))
    result["targets"] = soak_targets(result, load, calm_first)
    _print_report(result, load, calm_first)
    write_result(out, result)
    return 0
