"""``kvmesh status``: every model served through one Redis, its live replicas and their load."""

from __future__ import annotations

import asyncio
import time

from kvmesh.kvcache.index import PrefixIndex
from kvmesh.serving.index_connection import connect_redis


async def collect(redis_url: str) -> list[dict]:
    client = connect_redis(redis_url)
    try:
        models = []
        async for key in client.scan_iter(match=b"{k:*}settings", count=1000):
            settings = {k.decode(): v.decode() for k, v in (await client.hgetall(key)).items()}
            index = PrefixIndex(
                client, settings["model_id"], int(settings["block_size"]), int(settings["hash_seed"])
            )
            models.append({"settings": settings, "replicas": await index.live_replicas()})
        return models
    finally:
        await client.aclose()


def render(models: list[dict]) -> str:
    if not models:
        return "no kvmesh model in this Redis"
    lines, now = [], time.time()
    for m in models:
        s = m["settings"]
        lines.append(
            f"model {s['model_id']}  block_size {s['block_size']}  replicas live: {len(m['replicas'])}"
        )
        lines.append(
            f"  {'replica':<14}{'grpc':<22}{'http':<30}{'inc':>5}{'run':>5}{'wait':>5}{'free/total blocks':>19}"
            f"{'cached':>8}{'hit rate':>9}{'tok/s':>8}{'hb age':>8}"
        )
        for r in sorted(m["replicas"], key=lambda r: r.replica_id):
            free, total = int(r.load("num_free_blocks")), int(r.load("num_blocks"))
            lines.append(
                f"  {r.replica_id:<14}{r.address:<22}{r.fields.get('http_address', '-'):<30}{r.incarnation:>5}{int(r.load('num_running')):>5}"
                f"{int(r.load('num_waiting')):>5}{f'{free}/{total}':>19}{int(r.load('num_cached_free_blocks')):>8}"
                f"{r.load('prefix_hit_rate'):>9.3f}{r.load('tokens_per_s'):>8.1f}{now - r.load('heartbeat_at', now):>7.1f}s"
            )
    return "\n".join(lines)


def main(redis_url: str) -> int:
    print(render(asyncio.run(collect(redis_url))))
    return 0
