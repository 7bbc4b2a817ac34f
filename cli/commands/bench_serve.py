"""``kvmesh bench serve``: a workload against a router over gRPC, one JSONL record per request;
with several ``--model``, a mix of models (each its workload and share of the rate), summarized
per model and in all."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path

from kvmesh.bench.measure import workloads as wl
from kvmesh.bench.measure.model_mix import ModelLoad, merge_by_arrival, parse_models
from kvmesh.cli.commands.checks import check_model_folder
from kvmesh.cli.commands.workload_flags import build_workload, model_stream
from kvmesh.cluster.errors import UsageError
from kvmesh.serving.model_info import model_id_of


def bench_serve(args: argparse.Namespace) -> int:
    models = parse_models(args.model) if _is_mix(args.model) else []
    name, requests = _mixed_workload(args, models) if models else build_workload(args)
    if args.duration:
        requests = (
            [r for r in requests if r.arrival_s <= args.duration]
            if (args.rate or args.trace_time)
            else requests
        )
    if not args.address and not args.model:
        raise ValueError("give --address of a running router, or --model DIR to start a local cluster")
    if not args.address:
        for folder in [m.name for m in models] or args.model[:1]:
            check_model_folder(folder)
    return asyncio.run(_bench_serve(args, name, requests, models))


def _is_mix(specs: list[str] | None) -> bool:
    """Several models, or one with a share, workload or replica count of its own."""
    return bool(specs) and (len(specs) > 1 or "," in specs[0])


def _mixed_workload(
    args: argparse.Namespace, models: list[ModelLoad]
) -> tuple[str, list[wl.WorkloadRequest]]:
    """Each model's workload at its share of --rate, merged in arrival order, each request
    naming its model (its folder's name for a local cluster, else as given)."""
    streams, names = {}, []
    for k, m in enumerate(models):
        name, make, _ = model_stream(args, m, k)
        streams[_request_name(args, m)] = list(make())
        names.append(name)
    mixed = [dataclasses.replace(r, model=model) for model, r in merge_by_arrival(streams)]
    return "+".join(names), mixed


def _request_name(args: argparse.Namespace, model: ModelLoad) -> str:
    return model.name if args.address else model_id_of(model.name)


async def _bench_serve(args: argparse.Namespace, name: str, requests: list, models: list[ModelLoad]) -> int:
    from kvmesh.bench.measure.loadgen import run_load
    from kvmesh.bench.measure.report import summarize, write_run
    from kvmesh.cluster.config import ClusterConfig
    from kvmesh.cluster.launcher import LocalCluster
    from kvmesh.cluster.supervisor import ReplicaStartError

    cluster, measured = None, {}
    address = args.address
    if not address:
        router = {"port": 0, "http_port": -1, "block_size": args.block_size}
        folders = [(m.name, m.replicas) for m in models] or [(args.model[0], None)]
        replica = {"engine_kind": args.engine, "vllm_python": args.vllm_python}
        configs = [
            ClusterConfig.for_model(d, n or args.replicas, router=router, replica=replica) for d, n in folders
        ]
        try:
            cluster = await LocalCluster(configs).start()
        except ReplicaStartError as exc:
            raise UsageError(str(exc)) from None
        address = cluster.router_address
    try:
        block_sizes = {m: await _router_block_size(address, m) for m in {r.model for r in requests}}
        ceilings = {
            m: wl.infinite_cache_hit_rate([r for r in requests if r.model == m], size)
            for m, size in block_sizes.items()
        }
        records = await run_load(
            address,
            requests,
            policy=args.policy or "",
            concurrency=args.concurrency,
            use_arrival_times=bool(args.rate or args.trace_time),
            progress=not args.quiet,
        )
        if cluster:
            measured = await _fleet_cost_model(cluster, block_sizes[requests[0].model])
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
        "hit_rate_ceiling": ceilings.get("", ceilings),  # a mix: one per model
        "address": address,
        **(
            {"models": [{**dataclasses.asdict(m), "name": _request_name(args, m)} for m in models]}
            if models
            else {}
        ),
        **measured,
    }
    write_run(Path(args.out), meta, records)
    summary = summarize(records, ceiling=ceilings.get(""))
    if models:
        summary = {
            "all": summary,
            **{m: summarize([r for r in records if r.model == m], ceiling=c) for m, c in ceilings.items()},
        }
    print(json.dumps(summary, indent=2))
    print(f"\nwrote {args.out}")
    return 0


async def _fleet_cost_model(cluster, block_size: int) -> dict:
    """``{"cost_model": ...}``: the step costs the cluster's replicas measured, from their
    heartbeats (``kvmesh simulate --cost-model RUN`` replays with it); empty if none has."""
    from kvmesh.bench.experiments.cost_model import from_cluster

    try:
        return {"cost_model": (await from_cluster(cluster, block_size))[0].as_dict()}
    except ValueError:
        return {}


async def _router_block_size(address: str, model: str = "") -> int:
    import grpc

    from kvmesh.protos import pb, pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        info = await pb_grpc.RouterStub(channel).GetModelInfo(pb.GetModelInfoRequest(model=model), timeout=10)
    return info.block_size
