"""``kvmesh bench router``: what the router costs on top of a replica.

1. Added latency: 1-token generations through a ``kvmesh router`` process vs straight to
   the replica the router picks (same prompt, alternating, same run), over gRPC and HTTP.
2. Routing decision time for a 4k-token text prompt with 8 replicas registered in the
   index, all holding the prompt: tokenize + hash + one lookup + policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx

from kvmesh.bench.measure.common import environment, progress, target, write_result
from kvmesh.bench.measure.demo_model import demo_model
from kvmesh.bench.measure.stats import latency_ms
from kvmesh.bench.peer_processes import Contender, RouterProcess, kvmesh_router_command
from kvmesh.bench.peers import replicas_of
from kvmesh.bench.router_cpu import ANSWERS, QUICK_ANSWERS, router_cpu
from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.embedded_redis import EmbeddedRedis, free_port
from kvmesh.cluster.launcher import LocalCluster
from kvmesh.kvcache import BlockStored, block_hashes
from kvmesh.kvcache.index.redis import RedisPrefixIndex
from kvmesh.protos import pb, pb_grpc
from kvmesh.router.core import RouterCore
from kvmesh.router.registry import ReplicaRegistry
from kvmesh.serving.api_config import APIConfig
from kvmesh.serving.model_info import ModelInfo
from kvmesh.serving.tokenizer import PromptTokenizer


async def _one_token(stub, request: pb.GenerateRequest) -> tuple[float, str]:
    start = time.perf_counter()
    replica = ""
    async for r in stub.Generate(request, timeout=30):
        if r.WhichOneof("kind") == "complete":
            replica = r.complete.replica_id
    return time.perf_counter() - start, replica


async def _one_http(http: httpx.AsyncClient, url: str, body: dict) -> float:
    start = time.perf_counter()
    (await http.post(url + "/v1/completions", json=body)).raise_for_status()
    return time.perf_counter() - start


def _added(times: dict[str, list[float]], direct: str) -> dict:
    """Each path's p50/p90/p99 and what it adds over ``direct`` at each."""
    result = {name: latency_ms(t) for name, t in times.items()}
    base = result[direct]
    for name, lat in result.items():
        if name != direct:
            for q in ("p50", "p90", "p99"):
                lat[f"added_{q}_ms"] = round(lat[f"{q}_ms"] - base[f"{q}_ms"], 3)
    return result


@contextlib.contextmanager
def _passthrough(upstream: str, port: int):
    """A pass-through gRPC proxy to ``upstream`` on ``port``, in a process of its own."""
    proxy = subprocess.Popen([sys.executable, "-m", "kvmesh.bench.passthrough_proxy", upstream, str(port)])
    try:
        yield
    finally:
        proxy.terminate()
        proxy.wait()


async def _interleaved(paths: dict, samples: int) -> dict[str, list[float]]:
    """Seconds of each path's call, the paths taken in turn ``samples`` times after a warm-up
    (so drift hits all alike)."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    warmup = min(20, samples // 4)  # rounds that warm up (a smoke run: fewer)
    for i in range(samples + warmup):
        for name, path in paths.items():
            took = await path()
            if i >= warmup:
                times[name].append(took[0] if isinstance(took, tuple) else took)
    return times


async def added_latency(model_dir: str, samples: int, answers: tuple[int, int] = ANSWERS) -> dict:
    """The same cached 1-token request straight to a replica, through a ``kvmesh router``
    process (as deployed: its own process, shared load on) and, over gRPC, through a
    pass-through proxy (the floor: the extra hop alone), interleaved so drift hits all alike;
    over gRPC and over HTTP (/v1/completions)."""
    config = ClusterConfig.for_model(model_dir, 2, engine={"num_kv_blocks": 256}, with_router=False)
    scratch = Path(tempfile.mkdtemp(prefix="kvmesh-bench-router-"))
    prompt = [random.Random(0).randrange(3, 1000) for _ in range(64)]
    sampling = pb.SamplingParams(temperature=0, max_tokens=1)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
    name = ModelInfo.from_folder(model_dir, None, 16, None).api_name
    body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    # open replicas (loopback): the bench reads their own counters and calls them directly
    async with LocalCluster(config, open_replicas=True) as cluster:
        # picked once the cluster is up: Ray and the replicas take ports while starting
        grpc_port, http_port, proxy_port = free_port(), free_port(), free_port()
        async with (
            httpx.AsyncClient(timeout=30) as http,
            RouterProcess(
                Contender("kvmesh", "prefix"),
                kvmesh_router_command(model_dir, cluster.redis_url, grpc_port, http_port),
                http_port,
                scratch / "router.log",
                cluster.router_environment(),
            ) as router_process,
            grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as router_channel,
        ):
            router = pb_grpc.RouterStub(router_channel)
            _, replica_id = await _one_token(router, request)  # the prompt is cached there now
            replica_http = {r.replica_id: r.http_url for r in await replicas_of(cluster)}[replica_id]
            replica_address = cluster.supervisor.addresses[replica_id]
            with _passthrough(replica_address, proxy_port):
                async with (
                    grpc.aio.insecure_channel(replica_address) as direct_channel,
                    grpc.aio.insecure_channel(f"127.0.0.1:{proxy_port}") as proxy_channel,
                ):
                    await proxy_channel.channel_ready()

                    async def via_router() -> float:
                        took, where = await _one_token(router, request)
                        assert where == replica_id, "router moved a cached prompt"
                        return took

                    direct, passthrough = (
                        pb_grpc.ReplicaStub(direct_channel),
                        pb_grpc.RouterStub(proxy_channel),
                    )
                    times = await _interleaved(
                        {
                            "grpc_direct": lambda: _one_token(direct, request),
                            "grpc_router": via_router,
                            "grpc_passthrough": lambda: _one_token(passthrough, request),
                            "http_direct": lambda: _one_http(http, replica_http, body),
                            "http_router": lambda: _one_http(http, router_process.url, body),
                        },
                        samples,
                    )
        cpu = await router_cpu(
            model_dir,
            body["model"],
            cluster.redis_url,
            cluster.router_environment(),
            long_text(PromptTokenizer(model_dir), 4000),
            max(20, samples // 5),  # the kernel counts CPU in 10 ms ticks: a window worth several
            scratch,
            answers,
        )
    return _added_report(samples, times, cpu)


def _added_report(samples: int, times: dict[str, list[float]], cpu: dict) -> dict:
    result = {
        "samples": samples,
        "grpc": _added({k[5:]: v for k, v in times.items() if k.startswith("grpc")}, "direct"),
        "http": _added({k[5:]: v for k, v in times.items() if k.startswith("http")}, "direct"),
        "router_cpu": cpu,
    }
    g, h = result["grpc"], result["http"]
    progress(
        f"added p50: gRPC router {g['router']['added_p50_ms']} ms (pass-through proxy "
        f"{g['passthrough']['added_p50_ms']} ms), HTTP router {h['router']['added_p50_ms']} ms"
    )
    return result


def long_text(tokenizer: PromptTokenizer, tokens: int) -> str:
    """A text of at most ``tokens`` tokens (just under), of common words."""
    rng = random.Random(1)
    words = [
        "cache",
        "block",
        "prefix",
        "token",
        "router",
        "replica",
        "index",
        "serve",
        "batch",
        "queue",
        "memory",
        "stream",
    ]
    text = " ".join(rng.choice(words) for _ in range(int(tokens * 1.5)))
    while len(ids := tokenizer.encode(text)) > tokens:
        text = text[: int(len(text) * tokens / len(ids))]
    return text


async def decision_time(model_dir: str, replicas: int, samples: int) -> dict:
    with EmbeddedRedis() as redis:
        info = ModelInfo.from_folder(model_dir, None, 16, None)
        tokenizer = PromptTokenizer(model_dir)
        index = RedisPrefixIndex.from_url(redis.url, info.model_id, info.block_size, info.hash_seed)
        await index.ensure_settings()
        text = long_text(tokenizer, 4000)
        ids = tokenizer.encode(text)
        hashes = block_hashes(ids, info.block_size, info.hash_seed)
        for r in range(replicas):
            inc = await index.register(f"r{r}", f"127.0.0.1:{20000 + r}", ttl_s=3600)
            await index.publish(f"r{r}", inc, [BlockStored(tuple(hashes), None, info.block_size, hashes[0])])
        registry = ReplicaRegistry(index)
        await registry.refresh()
        core = RouterCore(info, tokenizer, index, registry)
        as_text = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=1))
        as_ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=1))
        result = {"replicas": replicas, "prompt_tokens": len(ids), "blocks": len(hashes)}
        for name, request in (("text", as_text), ("token_ids", as_ids)):
            for _ in range(20):
                await core.decide(request)
            times = [(await core.decide(request)).decision_s for _ in range(samples)]
            decision = await core.decide(request)
            assert len(decision.matched) == replicas and set(decision.matched.values()) == {len(hashes)}
            result[name] = latency_ms(times)
            progress(
                f"decision from {name}: p50 {result[name]['p50_ms']} ms, p99 {result[name]['p99_ms']} ms"
            )
        result["token_ids_beside_text"] = latency_ms(await _beside(core, as_ids, as_text, samples))
        progress(
            f"decision from token_ids while 4k-token texts tokenize: p99 {result['token_ids_beside_text']['p99_ms']} ms"
        )
        result["tokenize_only"] = latency_ms(_tokenize_times(tokenizer, [text] * samples))
        # as a router tokenizes by default: a text whose parts it has seen, with a new ending
        cached = APIConfig().load_tokenizer(model_dir)
        cached.encode(text)
        endings = [f"{text} and question {i} asks again?" for i in range(samples)]
        result["tokenize_shared_prefix"] = latency_ms(_tokenize_times(cached, endings))
        await registry.stop()
        await index.close()
    return result


def _tokenize_times(tokenizer: PromptTokenizer, texts: list[str]) -> list[float]:
    times = []
    for text in texts:
        start = time.perf_counter()
        tokenizer.encode(text)
        times.append(time.perf_counter() - start)
    return times


async def _beside(
    core: RouterCore, measured: pb.GenerateRequest, other: pb.GenerateRequest, samples: int
) -> list[float]:
    """``measured``'s decision times while two other tasks decide ``other`` back to back: a
    text long enough to tokenize off the event loop must not hold up the decisions beside it."""
    stop = asyncio.Event()

    async def keep_deciding() -> int:
        n = 0
        while not stop.is_set():
            await core.decide(other)
            n += 1
        return n

    others = [asyncio.create_task(keep_deciding()) for _ in range(2)]
    await asyncio.sleep(0.05)
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        await core.decide(measured)
        times.append(time.perf_counter() - start)
    stop.set()
    if min(await asyncio.gather(*others)) < 2:
        raise RuntimeError("the text decisions did not run beside the measured ones")
    return times


async def run(model_dir: str, quick: bool) -> dict:
    samples = 40 if quick else 500  # quick: a smoke run (its p99s are the slowest few samples)
    latency = await added_latency(model_dir, samples, QUICK_ANSWERS if quick else ANSWERS)
    decision = await decision_time(model_dir, 8, samples)
    return {
        "added_latency": latency,
        "decision": decision,
        "targets": [
            target(
                "added latency p50, gRPC (ms)",
                latency["grpc"]["router"]["added_p50_ms"],
                "<=",
                1.0,
                f"a pass-through gRPC proxy adds {latency['grpc']['passthrough']['added_p50_ms']} ms",
            ),
            target("added latency p50, HTTP (ms)", latency["http"]["router"]["added_p50_ms"], "<=", 1.0),
            target("decision p99, 4k token ids, 8 replicas (ms)", decision["token_ids"]["p99_ms"], "<=", 1.0),
            target(
                "decision p99 from token ids beside 4k-token texts (ms)",
                decision["token_ids_beside_text"]["p99_ms"],
                "<=",
                1.0,
            ),
        ],
    }


def main(out: str, quick: bool, cache_dir: str) -> int:
    model_dir = str(demo_model(Path(cache_dir)))
    result = {"benchmark": "router", "quick": quick, "environment": environment(), "model": model_dir}
    result.update(asyncio.run(run(model_dir, quick)))
    lat, dec = result["added_latency"], result["decision"]
    for api in ("grpc", "http"):
        print(f"\n1-token generation over {api}, ms     p50      p90      p99   added p50  added p90")
        for path, r in lat[api].items():
            added = f"{r['added_p50_ms']:>9}  {r['added_p90_ms']:>9}" if "added_p50_ms" in r else ""
            print(f"  {path:<30} {r['p50_ms']:>8} {r['p90_ms']:>8} {r['p99_ms']:>8}  {added}")
    print("router CPU, ms per request (1-token answer) and per streamed token; its top stages:")
    for case, rows in lat["router_cpu"].items():
        one = rows["per_request_1_token"]
        top = ", ".join(f"{stage} {ms}" for stage, ms in list(one["by_stage_ms"].items())[:4])
        print(
            f"  {case:<12} {one['cpu_ms_per_request']:>7} ms  +{rows['cpu_ms_per_streamed_token']} per token  ({top})"
        )
    print(f"routing decision, {dec['prompt_tokens']} tokens, {dec['replicas']} replicas:")
    for name in ("text", "token_ids"):
        print(f"  from {name:<10} p50 {dec[name]['p50_ms']} ms  p99 {dec[name]['p99_ms']} ms")
    beside = dec["token_ids_beside_text"]
    print(
        f"  from token_ids while 4k-token texts tokenize: p50 {beside['p50_ms']} ms  p99 {beside['p99_ms']} ms"
    )
    for name, what in (("tokenize_only", "alone"), ("tokenize_shared_prefix", "of a known text, new ending")):
        print(f"  tokenizing {what} p50 {dec[name]['p50_ms']} ms  p99 {dec[name]['p99_ms']} ms")
    write_result(out, result)
    return 0
