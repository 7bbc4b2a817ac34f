"""Where a ``kvmesh router`` process spends its CPU, per request and per streamed token, by
stage, over gRPC and HTTP, for a short prompt of token ids and a 4k-token text.

Two windows per case, both of N sequential requests from this process (the client's CPU is
never the router's): an unprofiled one gives the CPU per request, the router's session's and
its event loop thread's, from the kernel; a profiled one (``profiled``: the loop thread's own
CPU per function) gives each stage's share of the loop's part. cProfile slows Python calls,
so its absolute times are not used; what the other threads spent (gRPC core's, a long
prompt tokenized off the loop) is its own row, "threads". Per token: the difference
between 33-token and 1-token answers, over 32."""

from __future__ import annotations

import asyncio
import pstats
import signal
import sys
import time
from pathlib import Path

import grpc
import httpx

from kvmesh.bench.peer_processes import Contender, RouterProcess, kvmesh_router_command
from kvmesh.cluster.embedded_redis import free_port
from kvmesh.protos import pb, pb_grpc

# A function belongs to the first stage one of whose markers is in "file:function" (for a
# built-in, the file is "~" and the function names its type or module).
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tokenize", ("serving/tokenizer", "tokenizers", "transformers/", "serving/offload")),
    ("template", ("serving/prompt", "jinja2")),
    ("hash", ("kvcache/hashing", "xxhash")),
    ("index calls", ("kvcache/", "redis/", "hiredis")),
    (
        "policy",
        (
            "router/policies",
            "router/decision",
            "router/registry",
            "router/replica_load",
            "router/shared_load",
            "router/speculative",
            "router/index_trust/",
            "serving/step_costs",
        ),
    ),
    (
        "parse",
        (
            "serving/openai/protocol",
            "serving/openai/app",
            "serving/openai/requests",
            "serving/limits",
            "serving/admission",
            "serving/sampling_params",
            "serving/generation_config",
            "json/decoder",
            "scanstring",
            "pydantic",
        ),
    ),
    (
        "response encoding",
        (
            "serving/openai/responses",
            "json/encoder",
            "json/__init__",
            "encode_basestring",
            "google/protobuf",
            "SerializeToString",
            "FromString",
        ),
    ),
    (
        "relay",
        (
            "router/relay",
            "router/core",
            "router/grpc_service",
            "router/replica_http",
            "serving/openai/relay",
            "serving/connections",
            "grpc/",
            "cygrpc",
        ),
    ),
    ("HTTP server", ("uvicorn", "starlette", "h11", "httptools", "anyio", "serving/http_server")),
    ("metrics and tracing", ("prometheus_client", "serving/tracing", "router/metrics", "serving/metrics")),
    ("event loop", ("asyncio/", "uvloop", "selectors", "epoll")),
)
CASES = (("grpc", "short"), ("grpc", "4k"), ("http", "short"), ("http", "4k"))
# Answer lengths in tokens: the difference over their gap is what one more streamed token costs
# (a smoke run's longer answer is shorter: each of its tokens is a decode step to wait for).
ANSWERS = (1, 33)
QUICK_ANSWERS = (1, 9)


def stage_of(where: str) -> str:
    return next((stage for stage, markers in STAGES if any(m in where for m in markers)), "other")


def stage_seconds(profile_file: Path) -> dict[str, float]:
    """The loop thread's CPU in the window, by stage: each function's own time (not its
    callees'), so the stages add up to the thread's whole CPU."""
    totals: dict[str, float] = {}
    for (file, _, function), (_, _, own, _, _) in pstats.Stats(str(profile_file)).stats.items():
        stage = stage_of(f"{file}:{function}")
        totals[stage] = totals.get(stage, 0.0) + own
    return totals


class _Client:
    """One request at a time to the router, gRPC or HTTP, short ids or a 4k-token text."""

    def __init__(
        self, stub: pb_grpc.RouterStub, http: httpx.AsyncClient, url: str, model: str, long_text: str
    ):
        self.stub, self.http, self.url, self.model, self.long_text = stub, http, url, model, long_text
        self.short_ids = list(range(100, 164))

    async def send(self, api: str, prompt: str, max_tokens: int) -> None:
        text = self.long_text if prompt == "4k" else None
        if api == "grpc":
            request = pb.GenerateRequest(
                sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            )
            if text is None:
                request.token_ids.ids.extend(self.short_ids)
            else:
                request.text = text
            async for _ in self.stub.Generate(request, timeout=60):
                pass
            return
        body = {
            "model": self.model,
            "prompt": text or self.short_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        async with self.http.stream("POST", self.url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for _ in response.aiter_raw():
                pass


async def _window(
    router: RouterProcess, client: _Client, case: tuple[str, str], answer: int, n: int
) -> tuple[float, float]:
    """The router's CPU seconds for ``n`` sequential requests: all of it, and its loop's."""
    before, loop_before = router.cpu_seconds(), router.loop_cpu_seconds()
    for _ in range(n):
        await client.send(*case, answer)
    return router.cpu_seconds() - before, router.loop_cpu_seconds() - loop_before


async def _profiled_window(
    router: RouterProcess, client: _Client, case: tuple[str, str], answer: int, n: int, out: Path
) -> dict[str, float]:
    out.unlink(missing_ok=True)
    router.proc.send_signal(signal.SIGUSR1)
    await asyncio.sleep(0.2)  # the signal is handled between two bytecodes of the loop thread
    for _ in range(n):
        await client.send(*case, answer)
    router.proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while not out.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router wrote no profile: {router.log_tail()}")
        await asyncio.sleep(0.05)
    return stage_seconds(out)


def _per_request(cpu_s: float, loop_s: float, stages: dict[str, float], n: int) -> dict:
    """The window's CPU per request (ms): the loop thread's, split by the profiled window's
    stage shares, and the other threads' ("threads": gRPC core, long prompts tokenized)."""
    total_ms, loop_ms = 1000 * cpu_s / n, 1000 * min(loop_s, cpu_s) / n
    profiled = sum(stages.values())
    split = {s: round(loop_ms * t / profiled, 3) for s, t in stages.items()} if profiled else {}
    split["threads"] = round(total_ms - loop_ms, 3)
    return {
        "cpu_ms_per_request": round(total_ms, 3),
        "by_stage_ms": dict(sorted(split.items(), key=lambda kv: -kv[1])),
    }


async def router_cpu(
    model_dir: str,
    model_name: str,
    redis_url: str,
    environment: dict[str, str],
    long_text: str,
    n: int,
    scratch: Path,
    answers: tuple[int, int] = ANSWERS,
) -> dict:
    """Each (api, prompt) case at 1- and 33-token answers: CPU per request by stage, and per
    streamed token; one router process for all, started under ``profiled``."""
    grpc_port, http_port = free_port(), free_port()
    profile = scratch / "window.prof"
    command = [
        sys.executable,
        "-m",
        "kvmesh.cli.profiled",
        str(profile),
        *kvmesh_router_command(model_dir, redis_url, grpc_port, http_port)[1:],
    ]
    result = {}
    async with (
        RouterProcess(
            Contender("kvmesh", "prefix"), command, http_port, scratch / "router-cpu.log", environment
        ) as router,
        grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        httpx.AsyncClient(timeout=60) as http,
    ):
        client = _Client(pb_grpc.RouterStub(channel), http, router.url, model_name, long_text)
        for case in CASES:
            for _ in range(5):  # warm: the prompt cached on its replica, connections open
                await client.send(*case, 1)
            rows = {}
            for answer in answers:
                cpu_s, loop_s = await _window(router, client, case, answer, n)
                stages = await _profiled_window(router, client, case, answer, n, profile)
                rows[answer] = _per_request(cpu_s, loop_s, stages, n)
            short, long = rows[answers[0]], rows[answers[1]]
            per_token = (long["cpu_ms_per_request"] - short["cpu_ms_per_request"]) / (answers[1] - answers[0])
            result[f"{case[0]}_{case[1]}"] = {
                "per_request_1_token": short,
                f"per_request_{answers[1]}_tokens": long,
                "cpu_ms_per_streamed_token": round(per_token, 4),
            }
    return result
