"""``kvmesh bench serve``: a workload against a router over gRPC, one JSONL record per request."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from kvmesh.cluster.commands.workload_flags import build_workload
from kvmesh.cluster.measure import workloads as wl


def bench_serve(args: argparse.Namespace) -> int:
    name, requests = build_workload(args)
    if args.duration:
        requests = (
            [r for r in requests if r.arrival_s <= args.duration]
            if (args.rate or args.trace_time)
            else requests
        )
    if not args.address and not args.model:
        raise ValueError("give --address of a running router, or --model DIR to start a local cluster")
    return asyncio.run(_bench_serve(args, name, requests))


async def _bench_serve(args: argparse.Namespace, name: str, requests: list) -> int:
    from kvmesh.cluster.config import ClusterConfig
    from kvmesh.cluster.launcher import LocalCluster
    from kvmesh.cluster.measure.loadgen import run_load
    from kvmesh.cluster.measure.report import summarize, write_run

    cluster, measured = None, {}
    address = args.address
    if not address:
        router = {"port": 0, "http_port": -1, "block_size": args.block_size}
        config = ClusterConfig.for_model(args.model, args.replicas, router=router)
        cluster = await LocalCluster(config).start()
        address = cluster.router_address
    try:
        block_size = await _router_block_size(address)
        ceiling = wl.infinite_cache_hit_rate(requests, block_size)
        records = await run_load(
            address,
            requests,
            policy=args.policy or "",
            concurrency=args.concurrency,
            use_arrival_times=bool(args.rate or args.trace_time),
            progress=not args.quiet,
        )
        if cluster:
            measured = await _fleet_cost_model(cluster, block_size)
    finally:
        if cluster:
            await cluster.stop()
    meta = {
        "workload": name,
        "policy": args.policy,
        "rate": args.rate,
        "trace_time": args.trace_time,
        "speedup": args.speedup,
        "requests": len(requests),
        "hit_rate_ceiling": ceiling,
        "address": address,
        **measured,
    }
    write_run(Path(args.out), meta, records)
    print(json.dumps(summarize(records, ceiling=ceiling), indent=2))
    print(f"\nwrote {args.out}")
    return 0


async def _fleet_cost_model(cluster, block_size: int) -> dict:
    """``{"cost_model": ...}``: the step costs the cluster's replicas measured, from their
    heartbeats (``kvmesh simulate --cost-model RUN`` replays with it); empty if none has."""
    from kvmesh.cluster.experiments.cost_model import from_cluster

    try:
        return {"cost_model": (await from_cluster(cluster, block_size))[0].as_dict()}
    except ValueError:
        return {}


async def _router_block_size(address: str) -> int:
    import grpc

    from kvmesh.protos import pb, pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        info = await pb_grpc.RouterStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    return info.block_size
