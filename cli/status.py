"""``kvmesh status``: a deployment's live replicas, their load, and the controller's view of
its replica slots; from a router (``ListReplicas``) or straight from the index (every
deployment of every model there)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict

import grpc

from kvmesh.kvcache.index.redis import RedisPrefixIndex
from kvmesh.protos import pb, pb_grpc
from kvmesh.serving.auth import bearer_metadata
from kvmesh.serving.deployment import DEFAULT_DEPLOYMENT
from kvmesh.serving.index_connection import connect_redis
from kvmesh.serving.step_costs import StepCosts, measured_restore

COLUMNS = (
    "replica_id",
    "address",
    "incarnation",
    "num_running",
    "num_waiting",
    "num_free_blocks",
    "num_blocks",
    "tokens_per_s",
    "heartbeat_age_s",
    "index_state",
    "index_state_cause",
    "share_alarm",
    "engine",
    "num_host_blocks",
    "num_host_used_blocks",
    "restore_block_s",
)
SHARE_ALARM = "SHARE ALARM: over its fair share, no new prefixes"


async def from_router(
    address: str, tls_ca: str | None, token: str | None = None, timeout: float = 10.0
) -> list[dict]:
    """Each model a router serves (with a live replica): what the router knows (it asks nobody
    else); ``token``: the router's bearer token."""
    metadata = bearer_metadata(token)
    if tls_ca:
        with open(tls_ca, "rb") as f:
            channel = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.aio.insecure_channel(address)
    async with channel:
        stub = pb_grpc.RouterStub(channel)
        every = await stub.ListReplicas(pb.ListReplicasRequest(), metadata=metadata, timeout=timeout)
        names = list(dict.fromkeys(r.model for r in every.replicas)) or [""]  # none live: the only model
        models = []
        for name in names:
            info = await stub.GetModelInfo(
                pb.GetModelInfoRequest(model=name), metadata=metadata, timeout=timeout
            )
            listing = await stub.ListReplicas(
                pb.ListReplicasRequest(model=name), metadata=metadata, timeout=timeout
            )
            models.append(_router_model(address, info, listing))
    return models


def _router_model(address: str, info: pb.ModelInfo, listing: pb.ListReplicasResponse) -> dict:
    deployment = json.loads(info.effective_config or "{}").get("deployment", DEFAULT_DEPLOYMENT)
    return {
        "model_id": info.model,
        "deployment": deployment,
        "block_size": info.block_size,
        "router": address,
        "replicas": [{c: getattr(r, c) for c in COLUMNS} for r in listing.replicas],
        "controller": json.loads(listing.controller_state or "{}"),
        "index_state": listing.index_state,
        "index_state_cause": listing.index_state_cause,
        "failing_loops": dict(listing.failing_loops),
    }


async def from_index(redis_url: str) -> list[dict]:
    """Every model served through one Redis."""
    client = connect_redis(redis_url)
    try:
        models = []
        async for key in client.scan_iter(match=b"{k:*}settings", count=1000):
            settings = {k.decode(): v.decode() for k, v in (await client.hgetall(key)).items()}
            deployment = settings.get("deployment", DEFAULT_DEPLOYMENT)  # older settings: the default
            block_size, seed = int(settings["block_size"]), int(settings["hash_seed"])
            index = RedisPrefixIndex(client, settings["model_id"], block_size, seed, deployment)
            now = time.time()
            replicas = [
                {
                    "replica_id": r.replica_id,
                    "address": r.address,
                    "http_address": r.fields.get("http_address", ""),
                    "engine": r.fields.get("engine", "kvmesh")[:16],
                    "incarnation": r.incarnation,
                    "num_running": int(r.load("num_running")),
                    "num_waiting": int(r.load("num_waiting")),
                    "num_free_blocks": int(r.load("num_free_blocks")),
                    "num_blocks": int(r.load("num_blocks")),
                    "num_cached_free_blocks": int(r.load("num_cached_free_blocks")),
                    "prefix_hit_rate": r.load("prefix_hit_rate"),
                    "tokens_per_s": r.load("tokens_per_s"),
                    "heartbeat_age_s": round(now - r.load("heartbeat_at", now), 1),
                    "step_costs": asdict(StepCosts.from_fields(r.load)) if "cost_base_s" in r.fields else {},
                    "num_host_blocks": int(r.load("num_host_blocks")),
                    "num_host_used_blocks": int(r.load("num_host_used_blocks")),
                    "restore_block_s": measured_restore(r.load) or 0.0,
                }
                for r in sorted(await index.live_replicas(), key=lambda r: r.replica_id)
            ]
            models.append(
                {
                    "model_id": settings["model_id"],
                    "deployment": deployment,
                    "block_size": int(settings["block_size"]),
                    "replicas": replicas,
                    "controller": json.loads(await index.controller_state() or "{}"),
                }
            )
        return sorted(models, key=lambda m: (m["model_id"], m["deployment"]))
    finally:
        await client.aclose()


def render(models: list[dict]) -> str:
    if not models:
        return "no kvmesh model in this Redis"
    lines = []
    for m in models:
        where = f"  router {m['router']}" if "router" in m else ""
        trust = f"  index {_state(m)}" if m.get("index_state") else ""
        lines.append(
            f"model {m['model_id']}  deployment {m['deployment']}  block_size {m['block_size']}{where}  "
            f"replicas live: {len(m['replicas'])}{trust}"
        )
        lines.append(
            f"  {'replica':<14}{'engine':<8}{'grpc':<22}{'http':<30}{'inc':>5}{'run':>5}{'wait':>5}{'free/total blocks':>19}"
            f"{'tok/s':>8}{'hb age':>8}"
            + ("  step cost: base ms, us/prompt tok, us/decode seq" if _costs(m) else "")
            + ("  host tier: used/total blocks, us/restored block" if _host(m) else "")
        )
        for r in m["replicas"]:
            blocks = f"{r['num_free_blocks']}/{r['num_blocks']}"
            lines.append(
                f"  {r['replica_id']:<14}{r.get('engine') or 'kvmesh':<8}{r['address']:<22}{r.get('http_address') or '-':<30}{r['incarnation']:>5}"
                f"{r['num_running']:>5}{r['num_waiting']:>5}{blocks:>19}{r['tokens_per_s']:>8.1f}{r['heartbeat_age_s']:>7.1f}s"
                + (f"  index {_state(r)}" if r.get("index_state") else "")
                + (_cost_columns(r["step_costs"]) if r.get("step_costs") else "")
                + (_host_columns(r) if r.get("num_host_blocks") else "")
                + (f"  {SHARE_ALARM}" if r.get("share_alarm") else "")
            )
        for replica_id, slot in sorted(m["controller"].items()):
            if slot["state"] != "ready":
                retry = f", retry in {slot['retry_in_s']} s" if slot.get("retry_in_s") is not None else ""
                lines.append(
                    f"  {replica_id}: {slot['state']} ({slot['failures']} failed starts{retry}) {slot['error']}"
                )
        for loop, why in sorted(m.get("failing_loops", {}).items()):
            lines.append(f"  router loop {loop} failing: {why}")
    return "\n".join(lines)


def _costs(model: dict) -> bool:
    return any(r.get("step_costs") for r in model["replicas"])


def _host(model: dict) -> bool:
    return any(r.get("num_host_blocks") for r in model["replicas"])


def _host_columns(row: dict) -> str:
    """Its host tier: blocks in use of its size, and a restore's measured cost (- : not yet)."""
    blocks = f"{row['num_host_used_blocks']}/{row['num_host_blocks']}"
    restore = f"{row['restore_block_s'] * 1e6:.1f}" if row.get("restore_block_s") else "-"
    return f"  host {blocks:>13} {restore:>8}"


def _cost_columns(costs: dict[str, float]) -> str:
    """A replica's measured step costs (its heartbeat), in the units people read them in."""
    return f"  {costs['base_s'] * 1e3:7.2f} {costs['prefill_token_s'] * 1e6:8.2f} {costs['decode_seq_s'] * 1e6:8.1f}"


def _state(row: dict) -> str:
    cause = row.get("index_state_cause")
    return f"{row['index_state']} ({cause})" if cause else row["index_state"]


def main(address: str, redis_url: str | None, as_json: bool, tls_ca: str | None, token: str | None) -> int:
    models = asyncio.run(from_index(redis_url) if redis_url else from_router(address, tls_ca, token))
    print(json.dumps(models, indent=2) if as_json else render(models))
    return 0
