"""Load generator over gRPC: closed loop or open loop (Poisson / trace timestamps), bounded.

Every request becomes one record: when it was sent, its first token and its end, tokens,
which replica served it, what the router predicted it would reuse and what the engine
actually reused. Failures are records too (``error``), never silently dropped.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import grpc

from kvmesh.cluster.experiments.workloads import WorkloadRequest
from kvmesh.protos import pb, pb_grpc


@dataclass
class RequestRecord:
    index: int
    group: str
    policy: str
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0
    replica_id: str = ""
    router_decision_us: int = 0
    sent_s: float = 0.0
    first_token_s: float | None = None
    done_s: float | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    def as_dict(self) -> dict:
        return asdict(self)


async def _one(
    stub, index: int, req: WorkloadRequest, policy: str, t0: float, timeout_s: float
) -> RequestRecord:
    prompt = req.tokens()
    record = RequestRecord(index=index, group=req.group, policy=policy, prompt_tokens=len(prompt))
    sampling = pb.SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True)
    message = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=sampling, policy=policy, affinity_key=req.session
    )
    record.sent_s = time.perf_counter() - t0
    try:
        async for response in stub.Generate(message, timeout=timeout_s):
            if response.WhichOneof("kind") == "chunk":
                if record.first_token_s is None:
                    record.first_token_s = time.perf_counter() - t0
                record.completion_tokens += len(response.chunk.token_ids)
            else:
                c = response.complete
                record.cached_tokens = c.usage.cached_tokens
                record.predicted_cached_tokens = c.predicted_cached_tokens
                record.replica_id = c.replica_id
                record.router_decision_us = c.router_decision_us
        record.done_s = time.perf_counter() - t0
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    return record


async def run_load(
    address: str,
    requests: Sequence[WorkloadRequest],
    policy: str = "",
    concurrency: int = 16,
    rate: float | None = None,
    use_arrival_times: bool = False,
    timeout_s: float = 300.0,
    seed: int = 0,
    progress: bool = False,
) -> list[RequestRecord]:
    """Send ``requests``: all at once bounded by ``concurrency`` (closed loop), at Poisson
    ``rate`` per second, or at their ``arrival_s`` (open loop; still bounded)."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(requests), desc=f"load {policy or 'default'}", unit="req", disable=not progress)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RouterStub(channel)
        t0 = time.perf_counter()

        async def fire(i: int, req: WorkloadRequest) -> RequestRecord:
            async with limit:
                record = await _one(stub, i, req, policy, t0, timeout_s)
            bar.update(1)
            return record

        tasks, at = [], 0.0
        for i, req in enumerate(requests):
            if use_arrival_times:
                at = req.arrival_s
            elif rate:
                at += rng.expovariate(rate)
            if at:
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            tasks.append(asyncio.create_task(fire(i, req)))
        records = await asyncio.gather(*tasks)
    bar.close()
    return list(records)
