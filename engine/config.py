"""kvmesh's engine's settings (``EngineConfig``): ``LLMEngine(model_dir, **config)`` takes
exactly its field names (an unknown name is a ``ValueError``, never silently ignored). The
vLLM adapter reads the same fields, so one set of flags sizes either engine. No torch here:
the CLI reads it to parse flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvmesh.serving.options import option

GiB = 1 << 30
MAX_HOST_KV_GIB = 4096  # a bound on the flag: more than any node's memory
# What ``dtype`` may name (the loader maps each to a torch dtype; "auto": the checkpoint's).
ATTENTION_BACKENDS = ("torch", "flash_attn", "triton")
DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half", "auto")


HOST_KV_SHARE = 0.5  # of the node's available memory, split between its GPUs, by default on CUDA


# cgroup v2's and v1's memory limit and usage: a pod's, where /proc/meminfo shows its node's
CGROUP_MEMORY = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def available_memory(meminfo: str = "/proc/meminfo", cgroups=CGROUP_MEMORY) -> int:
    """The memory this process may still take, in bytes: the node's ``MemAvailable``, or
    less where its cgroup (a Kubernetes pod's limit) leaves less; 0 where none can be read."""
    try:
        with open(meminfo) as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        available = int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return 0
    for limit_path, usage_path in cgroups:
        try:
            with open(limit_path) as f, open(usage_path) as g:
                limit, usage = f.read().strip(), int(g.read())
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # "max" (v2) or a huge number (v1): no limit of its own
            available = min(available, max(0, int(limit) - usage))
        break
    return available


def host_kv_gib(configured: float | None, device_type: str, gpus: int) -> tuple[float, str]:
    """The host tier's GiB (``--host-kv-gib``, either engine's) and why: the flag, else on CUDA
    a share of the node's available memory split between its GPUs, off on the CPU (where both
    tiers would be the same RAM)."""
    if configured is not None:
        return configured, f"host_kv_gib={configured:g}" if configured else "off (host_kv_gib=0)"
    if device_type != "cuda":
        return 0.0, "off (on CPU: --host-kv-gib turns it on)"
    share = HOST_KV_SHARE / max(1, gpus)
    return share * available_memory() / GiB, f"{share:.0%} of the node's available memory"


@dataclass
class EngineConfig:
    block_size: int | None = option(
        None, help="KV block size in tokens; auto: the replicas' choice (256 where flash-attn runs, else 16)"
    )
    num_kv_blocks: int | None = option(None, help="KV blocks per replica (wins over the memory settings)")
    kv_cache_memory: int = option(GiB // 2, help="bytes for the KV pool on CPU")
    host_kv_gib: float | None = option(
        None,
        per_model=True,
        zero_unset=False,
        help="GiB of host memory for a second KV tier that blocks leaving the pool move to and come "
        "back from (0: off; default: a share of the node's free memory on CUDA, off on CPU)",
    )
    gpu_memory_utilization: float = option(0.9, help="share of GPU memory for weights, activations and KV")
    max_num_seqs: int = option(64, help="sequences in one batch")
    max_num_batched_tokens: int = option(2048, help="tokens computed in one step (chunked prefill budget)")
    max_queued_requests: int = option(1024, help="waiting requests per replica; beyond: RESOURCE_EXHAUSTED")
    max_model_len: int | None = option(None, help="longest prompt + output (default: the model's)")
    dtype: str | None = option(None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, half on CUDA)")
    device: str | None = option(None, help="cpu | cuda (default: cuda if available)")
    seed: int = option(0, help="seeds the generator that requests without a seed of their own share")
    attention_backend: str | None = option(
        None,
        choices=ATTENTION_BACKENDS,
        help="default: flash-attn where usable, else Triton's kernels on CUDA, else torch",
    )
    enforce_eager: bool = option(
        False, help="CUDA: run decode steps kernel by kernel, without capturing CUDA graphs"
    )
    async_scheduling: bool | None = option(
        None,
        help="plan and launch step N+1 before reading step N's tokens, so the host's work runs "
        "while the device computes (default: on CUDA; a CPU forward leaves nothing to hide)",
    )
    check_invariants: bool = option(False, help="debug: check the block ledger after every step (slow)")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        config = cls(**kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        positive = ["max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "max_queued_requests"]
        positive += [
            n for n in ("block_size", "num_kv_blocks", "max_model_len") if getattr(self, n) is not None
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.host_kv_gib is not None and not (
            isinstance(self.host_kv_gib, int | float) and 0 <= self.host_kv_gib <= MAX_HOST_KV_GIB
        ):
            raise ValueError(f"host_kv_gib must be in [0, {MAX_HOST_KV_GIB}], got {self.host_kv_gib!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in (None, *DTYPE_NAMES):
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
