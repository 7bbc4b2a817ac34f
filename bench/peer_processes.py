"""The routers of ``kvmesh bench peers``, each its own process on 127.0.0.1, and guidellm.

kvmesh's router, sglang-router and vllm-router all front the same replicas over OpenAI
HTTP. The peers live in their own venv (``make peers``), never in kvmesh's dependencies.
Both peers open a Prometheus listener too (sglang-router's defaults to 0.0.0.0): every
listener is pinned to 127.0.0.1 here.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvmesh.bench.measure.peer_loads import GuidellmLoad
from kvmesh.cluster.embedded_redis import free_port
from kvmesh.cluster.errors import UsageError

PEER_TOOLS = ("sglang-router", "vllm-router", "guidellm")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# One guidellm worker process. guidellm 0.8.1's Poisson profile gives each worker process its
# own random.Random(seed), all alike, and adds every worker's next draw to one shared clock:
# with its default 10 workers each gap comes 10 times in a row, so 120 requests are 12 blocks
# of evenly spaced arrivals, and a short draw sends 10 requests within a few milliseconds
# (seen in every router's run of a seed). One worker draws each gap once: a Poisson process.
GUIDELLM_ONE_WORKER = {"GUIDELLM__MAX_WORKER_PROCESSES": "1"}


@dataclass(frozen=True)
class Contender:
    router: str  # kvmesh | sglang | vllm
    policy: str

    @property
    def name(self) -> str:
        return f"{self.router} {self.policy}"


CONTENDERS = (
    Contender("kvmesh", "prefix"),
    Contender("kvmesh", "consistent_hash"),
    Contender("kvmesh", "round_robin"),
    Contender("sglang", "cache_aware"),
    Contender("sglang", "round_robin"),
    Contender("vllm", "cache_aware"),
)
# The sweep's default: kvmesh's policy, its strongest own competitor, and the peers' prefix-aware policies.
SWEEP_CONTENDERS = tuple(c for c in CONTENDERS if c.policy in ("prefix", "consistent_hash", "cache_aware"))


def check_peers(venv: Path) -> None:
    missing = [tool for tool in PEER_TOOLS if not (venv / "bin" / tool).is_file()]
    if missing:
        raise UsageError(f"{', '.join(missing)} not found in {venv}: run `make peers` first")


def kvmesh_router_command(
    model_dir: str, redis_url: str, grpc_port: int, http_port: int, *extra: str
) -> list[str]:
    """A ``kvmesh router`` process on 127.0.0.1 (port 0: any free port)."""
    return [
        str(Path(sys.executable).with_name("kvmesh")),
        "router",
        "--model",
        model_dir,
        "--redis-url",
        redis_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        *extra,
    ]


def router_command(
    contender: Contender, venv: Path, port: int, workers: list[str], model_dir: str, redis_url: str
) -> list[str]:
    """How each router is started, listeners on 127.0.0.1, quiet logs, defaults otherwise."""
    if contender.router == "kvmesh":
        return kvmesh_router_command(model_dir, redis_url, 0, port, "--policy", contender.policy)
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        contender.policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--worker-startup-check-interval",
        "1",
    ]
    if contender.router == "sglang":
        return [str(venv / "bin" / "sglang-router"), "launch", *common, "--log-level", "warn"]
    if contender.router == "vllm":
        return [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"]
    raise ValueError(f"unknown router {contender.router!r}")


class RunAgain(RuntimeError):
    """A run that did not measure what it was meant to, through no fault of the router under
    test: the sweep runs that cell again from cold caches."""


class PortTaken(RunAgain):
    """A free port picked for a router was taken before the router bound it (the kernel hands
    the same ephemeral range to outgoing connections, and 4 replicas make many)."""


def _stat_fields(stat: Path) -> list[str] | None:
    """A /proc stat line's fields from the state (field 3) on; None when it is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def session_cpu_seconds(session_id: int) -> float:
    """utime + stime of every process in ``session_id`` (and the reaped children's, counted
    in their parents), from /proc/<pid>/stat."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields is not None and int(fields[3]) == session_id:  # field 6: the session
            ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu_seconds(stat: Path) -> float:
    """utime + stime from a /proc stat file (0 once its process is gone)."""
    fields = _stat_fields(stat)
    return sum(int(f) for f in fields[11:13]) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def process_cpu_seconds(pid: int) -> float:
    """``pid``'s CPU seconds, all its threads."""
    return _cpu_seconds(Path(f"/proc/{pid}/stat"))


def main_thread_cpu_seconds(pid: int) -> float:
    """``pid``'s main thread's CPU seconds alone (an asyncio server's event loop)."""
    return _cpu_seconds(Path(f"/proc/{pid}/task/{pid}/stat"))


class RouterProcess:
    """One router in its own session; ready when its readiness URL answers 200."""

    def __init__(
        self,
        contender: Contender,
        command: list[str],
        port: int,
        log_path: Path,
        env: dict[str, str] | None = None,
    ):
        """``env``: added to its environment (a kvmesh router's index user)."""
        self.contender = contender
        self.command = command
        self.env = env or {}
        self.url = f"http://127.0.0.1:{port}"
        # sglang-router's /health is 200 before any worker is; /readiness waits for one.
        self.ready_url = self.url + ("/readiness" if contender.router == "sglang" else "/health")
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    async def start(self, timeout_s: float = 120.0) -> RouterProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env},
            )
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    tail = self.log_tail()
                    lost_port = "address already in use" in tail.lower()
                    raise (PortTaken if lost_port else RuntimeError)(f"{self.contender.name} exited: {tail}")
                try:
                    if (await http.get(self.ready_url)).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.contender.name} not ready in {timeout_s:.0f}s: {self.log_tail()}")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the router has spent so far, from the kernel: every live
        process of its session, plus the children it has reaped."""
        return session_cpu_seconds(self.proc.pid)

    def loop_cpu_seconds(self) -> float:
        """The part of ``cpu_seconds`` its main thread (a Python server's event loop) spent."""
        return main_thread_cpu_seconds(self.proc.pid)

    def log_tail(self, chars: int = 800) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    async def __aenter__(self) -> RouterProcess:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        self.stop()


def run_guidellm(
    load: GuidellmLoad, venv: Path, target: str, model_id: str, model_dir: str, out: Path
) -> dict:
    """Run guidellm against ``target`` and summarize its JSON report."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    done = subprocess.run(
        load.command(venv, target, model_id, model_dir, out),
        cwd=out.parent,
        env={**os.environ, **OFFLINE, **GUIDELLM_ONE_WORKER},
        capture_output=True,
        text=True,
        timeout=load.max_seconds + 180,
    )
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"guidellm failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}")
    return summarize_guidellm(json.loads(out.read_text()))


class GuidellmLate(RunAgain):
    """guidellm did not send the load it was asked for: its own ``root_late`` warning says the
    arrivals went out later than the whole run lasted. Seen with guidellm 0.8.1's Poisson
    profile in about one run in eight: every target time comes out near the epoch, so all
    requests leave at once (a burst instead of a rate). Such a run measures something else
    and is run again. A merely late dispatcher (a busy client) is kept: it is the same for
    every router."""


class GuidellmNotPoisson(RuntimeError):
    """guidellm's arrival times repeat their gaps: not the Poisson load the row would claim."""


# Consecutive equal gaps between arrival targets that a Poisson schedule never shows (each
# gap is a fresh exponential draw) and guidellm's 10 alike workers show in every run.
_MOST_EQUAL_GAPS = 3


def equal_gaps_in_a_row(targets: list[float]) -> int:
    """The longest run of consecutive arrival gaps equal to within a microsecond."""
    times = sorted(targets)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    longest = run = 1 if gaps else 0
    for before, gap in itertools.pairwise(gaps):
        run = run + 1 if abs(gap - before) < 1e-6 else 1
        longest = max(longest, run)
    return longest


def summarize_guidellm(report: dict) -> dict:
    """TTFT, throughput and errors from guidellm's report (it exits 0 even if all failed)."""
    bench = report["benchmarks"][0]
    for warning in bench.get("warnings") or []:
        if warning.get("code") == "root_late" and warning.get("observed", 0) > bench["duration"]:
            raise GuidellmLate(warning.get("message", "root_late"))
    targets = [
        r["info"]["timings"]["targeted_start"]
        for r in bench["requests"]["successful"]
        if (r.get("info") or {}).get("timings", {}).get("targeted_start") is not None
    ]
    if (repeats := equal_gaps_in_a_row(targets)) >= _MOST_EQUAL_GAPS:
        raise GuidellmNotPoisson(
            f"guidellm spaced {repeats} arrivals in a row evenly: its workers drew alike "
            f"(is {next(iter(GUIDELLM_ONE_WORKER))}=1 set?)"
        )
    metrics = bench["metrics"]
    ttft = metrics["time_to_first_token_ms"]["successful"]["percentiles"]
    totals = metrics["request_totals"]
    ok = bench["requests"]["successful"]
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    return {
        "requests": totals["total"],
        "errors": totals["errored"] + totals["incomplete"],
        "ttft_p50_ms": round(ttft["p50"], 1),
        "ttft_p90_ms": round(ttft["p90"], 1),
        "ttft_p99_ms": round(ttft["p99"], 1),
        "req_per_s": round(metrics["requests_per_second"]["successful"]["mean"], 2),
        "output_tokens_per_s": round(metrics["output_tokens_per_second"]["successful"]["mean"], 1),
        "client_hit_rate": round(cached / prompt, 4) if prompt else 0.0,  # from usage, as reported
    }
