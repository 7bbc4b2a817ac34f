"""``kvmesh bench soak``: steady load through the router while replicas are killed.

Closed-loop clients send shared-prefix requests over gRPC for ``duration`` seconds; every
``kill_every`` seconds a random replica actor is killed (the supervisor replaces it).
Reported per minute: requests, errors by status code, p99 latency; and the resident memory
of every long-lived process (this process, which hosts the router; Redis; each replica
incarnation), which must stay flat once warm.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time
from pathlib import Path

import grpc
from ray.exceptions import RayError

from kvmesh.cluster.benchmarks.common import environment, progress, target, write_result
from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.demo_model import demo_model
from kvmesh.cluster.experiments.workloads import shared_prefix
from kvmesh.cluster.launcher import LocalCluster
from kvmesh.cluster.stats import percentile
from kvmesh.protos import pb, pb_grpc
from kvmesh.serving.metrics import read_samples


def rss_mb(pid: int) -> float | None:
    """Resident memory of a process (Linux /proc), or None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def closed_loop_client(
    address: str, requests, stop: asyncio.Event, t0: float, log: list, failures: list
) -> None:
    """Send ``requests`` round-robin until ``stop``; (start, code, seconds) per request into ``log``."""
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
            start, responses = time.perf_counter(), 0
            try:
                async for _ in stub.Generate(msg, timeout=60):
                    responses += 1
                code = "OK"
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                failures.append({"at_s": round(start - t0, 2), "after_s": round(time.perf_counter() - start, 2),
                                 "code": code, "responses": responses, "details": exc.details()})  # fmt: skip
            log.append((start - t0, code, time.perf_counter() - start))


async def run(
    model_dir: str, duration: float, replicas: int, clients: int, kill_every: float, seed: int
) -> dict:
    rng = random.Random(seed)
    requests = shared_prefix(
        num_groups=16, prompts_per_group=16, system_prompt_len=256, question_len=32, output_len=16, seed=seed
    )
    config = ClusterConfig.for_model(
        model_dir, replicas, engine={"num_kv_blocks": 1024}, router={"port": 0, "http_port": -1},
        replica={"heartbeat_s": 0.5, "ttl_s": 3.0},
    )  # fmt: skip
    log: list[tuple[float, str, float]] = []
    memory: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    kill_times: list[float] = []
    failures: list[dict] = []
    async with LocalCluster(config) as cluster:
        cluster.supervisor.check_s = 0.5
        stop = asyncio.Event()
        t0 = time.perf_counter()
        workers = [
            asyncio.create_task(closed_loop_client(cluster.router_address, requests, stop, t0, log, failures))
            for _ in range(clients)
        ]
        next_kill, next_sample = kill_every, 0.0
        while (now := time.perf_counter() - t0) < duration:
            if now >= next_sample:
                await _sample_memory(cluster, now, memory)
                next_sample += 10.0
                progress(
                    f"{now:5.0f}s  {len(log)} requests, {sum(1 for e in log if e[1] != 'OK')} errors, {len(kill_times)} kills"
                )
            if kill_every and now >= next_kill:
                victim = rng.choice(sorted(cluster.supervisor.actors))
                import ray

                ray.kill(cluster.supervisor.actors[victim])
                kill_times.append(round(now, 2))
                next_kill += kill_every
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*workers)
        await _sample_memory(cluster, time.perf_counter() - t0, memory)
        restarts = cluster.supervisor.restarts
        truth = index_truth_report(cluster.router.core.render_metrics().decode())
    return {"index_truth": truth, "minutes": _per_minute(log), "memory": _memory_report(memory), "kills": len(kill_times), "kill_times_s": kill_times, "failures": failures, "restarts": restarts,
            "requests": len(log), "errors": dict(collections.Counter(c for _, c, _ in log if c != "OK"))}  # fmt: skip


def index_truth_report(metrics_text: str) -> dict:
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


async def _sample_memory(cluster: LocalCluster, now: float, memory: dict) -> None:
    pids = {"router+driver": os.getpid()}
    if cluster.redis is not None and cluster.redis._proc is not None:
        pids["redis"] = cluster.redis._proc.pid
    for replica_id, actor in list(cluster.supervisor.actors.items()):
        try:
            pid = await asyncio.wait_for(actor.pid.remote(), 2.0)
        except (RayError, TimeoutError):  # killed a moment ago
            continue
        pids[f"{replica_id}/pid{pid}"] = pid
    for name, pid in pids.items():
        mb = rss_mb(pid)
        if mb is not None:
            memory[name].append((round(now, 1), round(mb, 1)))


def _per_minute(log: list) -> list[dict]:
    rows = []
    for minute in range(int(max((t for t, _, _ in log), default=0) // 60) + 1):
        entries = [e for e in log if minute * 60 <= e[0] < (minute + 1) * 60]
        ok = [d for _, c, d in entries if c == "OK"]
        rows.append({
            "minute": minute + 1,
            "requests": len(entries),
            "errors": dict(collections.Counter(c for _, c, _ in entries if c != "OK")),
            "p50_ms": round(percentile(ok, 0.5) * 1e3, 1) if ok else None,
            "p99_ms": round(percentile(ok, 0.99) * 1e3, 1) if ok else None,
        })  # fmt: skip
    return rows


def _memory_report(memory: dict) -> dict:
    """Per process: RSS after warm-up (first sample past 60 s, or the first), at the end, growth."""
    out = {}
    for name, samples in memory.items():
        warm = next((mb for t, mb in samples if t >= 60), samples[0][1])
        end = samples[-1][1]
        out[name] = {"warm_mb": warm, "end_mb": end, "growth_pct": round(100 * (end - warm) / warm, 1), "samples": len(samples),
                     "lived_s": round(samples[-1][0] - samples[0][0], 1)}  # fmt: skip
    return out


def main(
    out: str, duration: float, replicas: int, clients: int, kill_every: float, cache_dir: str, seed: int
) -> int:
    model = str(demo_model(Path(cache_dir)))
    result = {"benchmark": "soak", "duration_s": duration, "replicas": replicas, "clients": clients,
              "kill_every_s": kill_every, "environment": environment()}  # fmt: skip
    result.update(asyncio.run(run(model, duration, replicas, clients, kill_every, seed)))
    long_lived = {
        k: v for k, v in result["memory"].items() if v["lived_s"] >= min(duration * 0.8, duration - 30)
    }
    worst = max((v["growth_pct"] for v in long_lived.values()), default=0.0)
    errors = sum(result["errors"].values())
    result["targets"] = [
        target("memory growth after warm-up, worst long-lived process (%)", worst, "<=", 10.0),
        target(
            "requests that hung until their 60 s deadline",
            result["errors"].get("DEADLINE_EXCEEDED", 0),
            "<=",
            0,
        ),
        target("error share (%)", round(100 * errors / max(result["requests"], 1), 2), "<=", 5.0),
        target(
            "index false alarms (no index fault injected)", result["index_truth"]["false_alarms"], "<=", 0
        ),
    ]
    print(f"\n{'minute':>6}{'requests':>10}{'p50 ms':>9}{'p99 ms':>9}  errors")
    for row in result["minutes"]:
        print(
            f"{row['minute']:>6}{row['requests']:>10}{row['p50_ms'] or '-':>9}{row['p99_ms'] or '-':>9}  {json.dumps(row['errors'])}"
        )
    print(f"\n{result['kills']} replicas killed, {result['restarts']} restarted by the supervisor")
    print(f"index truth: {json.dumps(result['index_truth'])}")
    for name, m in sorted(result["memory"].items()):
        print(
            f"  {name:<28} warm {m['warm_mb']:>8.1f} MB  end {m['end_mb']:>8.1f} MB  growth {m['growth_pct']:>5.1f}%  over {m['lived_s']} s"
        )
    write_result(out, result)
    return 0
