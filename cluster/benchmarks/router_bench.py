"""``kvmesh bench router``: what the router costs on top of a replica.

1. Added latency: 1-token generations through the router vs straight to the replica the
   router picks (same prompt, alternating, same run), p50/p99.
2. Routing decision time for a 4k-token text prompt with 8 replicas registered in the
   index, all holding the prompt: tokenize + hash + one lookup + policy.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import grpc

from kvmesh.cluster.benchmarks.common import environment, progress, target, write_result
from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.demo_model import demo_model
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.cluster.launcher import LocalCluster
from kvmesh.cluster.stats import latency_ms
from kvmesh.kvcache import BlockStored, block_hashes
from kvmesh.kvcache.index import PrefixIndex
from kvmesh.protos import pb, pb_grpc
from kvmesh.router.core import RouterCore
from kvmesh.router.registry import ReplicaRegistry
from kvmesh.serving.model_info import ModelInfo
from kvmesh.serving.tokenizer import PromptTokenizer


async def _one_token(stub, request: pb.GenerateRequest) -> tuple[float, str]:
    start = time.perf_counter()
    replica = ""
    async for r in stub.Generate(request, timeout=30):
        if r.WhichOneof("kind") == "complete":
            replica = r.complete.replica_id
    return time.perf_counter() - start, replica


async def added_latency(model_dir: str, samples: int) -> dict:
    config = ClusterConfig.for_model(
        model_dir, 2, engine={"num_kv_blocks": 256}, router={"port": 0, "http_port": -1}
    )
    async with LocalCluster(config) as cluster:
        prompt = [random.Random(0).randrange(3, 1000) for _ in range(64)]
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(temperature=0, max_tokens=1)
        )
        async with grpc.aio.insecure_channel(cluster.router_address) as rch:
            router = pb_grpc.RouterStub(rch)
            _, replica_id = await _one_token(router, request)  # warm: the prompt is cached there now
            async with grpc.aio.insecure_channel(cluster.supervisor.addresses[replica_id]) as dch:
                direct = pb_grpc.ReplicaStub(dch)
                for _ in range(20):
                    await _one_token(direct, request)
                    await _one_token(router, request)
                via_router, straight = [], []
                for _ in range(samples):
                    straight.append((await _one_token(direct, request))[0])
                    t, where = await _one_token(router, request)
                    via_router.append(t)
                    assert where == replica_id, "router moved a cached prompt"
    result = {"direct": latency_ms(straight), "router": latency_ms(via_router), "samples": samples}
    result["added_p50_ms"] = round(result["router"]["p50_ms"] - result["direct"]["p50_ms"], 3)
    result["added_p99_ms"] = round(result["router"]["p99_ms"] - result["direct"]["p99_ms"], 3)
    progress(f"added latency p50 {result['added_p50_ms']} ms (direct {result['direct']['p50_ms']} ms)")
    return result


async def decision_time(model_dir: str, replicas: int, samples: int) -> dict:
    with EmbeddedRedis() as redis:
        info = ModelInfo.from_folder(model_dir, None, 16, None)
        tokenizer = PromptTokenizer(model_dir)
        index = PrefixIndex.from_url(redis.url, info.model_id, info.block_size, info.hash_seed)
        await index.ensure_settings()
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
        text = " ".join(rng.choice(words) for _ in range(6000))
        ids = tokenizer.encode(text)
        while len(ids) > 4000:
            text = text[: int(len(text) * 4000 / len(ids))]
            ids = tokenizer.encode(text)
        hashes = block_hashes(ids, info.block_size, info.hash_seed)
        for r in range(replicas):
            inc = await index.register(f"r{r}", f"127.0.0.1:{20000 + r}", ttl_s=3600)
            await index.publish(f"r{r}", inc, [BlockStored(tuple(hashes), None, info.block_size)])
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
        tokenize = []
        for _ in range(samples):
            start = time.perf_counter()
            tokenizer.encode(text)
            tokenize.append(time.perf_counter() - start)
        result["tokenize_only"] = latency_ms(tokenize)
        await registry.stop()
        await index.close()
    return result


async def run(model_dir: str, quick: bool) -> dict:
    samples = 100 if quick else 500
    latency = await added_latency(model_dir, samples)
    decision = await decision_time(model_dir, 8, samples)
    return {
        "added_latency": latency,
        "decision": decision,
        "targets": [
            target("added latency p50 (ms)", latency["added_p50_ms"], "<=", 2.0),
            target("decision p99, 4k-token text, 8 replicas (ms)", decision["text"]["p99_ms"], "<=", 2.0),
            target("decision p99, 4k token ids, 8 replicas (ms)", decision["token_ids"]["p99_ms"], "<=", 2.0),
        ],
    }


def main(out: str, quick: bool, cache_dir: str) -> int:
    model_dir = str(demo_model(Path(cache_dir)))
    result = {"benchmark": "router", "quick": quick, "environment": environment(), "model": model_dir}
    result.update(asyncio.run(run(model_dir, quick)))
    lat, dec = result["added_latency"], result["decision"]
    print(f"\n1-token generation   direct p50 {lat['direct']['p50_ms']} ms  p99 {lat['direct']['p99_ms']} ms")
    print(f"                     router p50 {lat['router']['p50_ms']} ms  p99 {lat['router']['p99_ms']} ms")
    print(f"added by the router  p50 {lat['added_p50_ms']} ms  p99 {lat['added_p99_ms']} ms")
    print(f"routing decision, {dec['prompt_tokens']} tokens, {dec['replicas']} replicas:")
    for name in ("text", "token_ids"):
        print(f"  from {name:<10} p50 {dec[name]['p50_ms']} ms  p99 {dec[name]['p99_ms']} ms")
    print(
        f"  tokenizing alone p50 {dec['tokenize_only']['p50_ms']} ms  p99 {dec['tokenize_only']['p99_ms']} ms"
    )
    write_result(out, result)
    return 0
