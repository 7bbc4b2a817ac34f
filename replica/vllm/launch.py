"""A replica's settings as a running vLLM engine: what vLLM is asked for, and what the
replica then tells the index and its clients about the model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from kvmesh.engine.config import host_kv_gib
from kvmesh.kvcache import namespace_seed
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.vllm.engine import VllmEngine
from kvmesh.replica.vllm.server import VllmOptions, VllmServer, check_vllm
from kvmesh.serving.model_info import ModelInfo, model_id_of

# vLLM's CPU backend caches blocks in multiples of 32 tokens; on a GPU it defaults to 16.
DEFAULT_BLOCK_SIZE = {"cpu": 32, "cuda": 16}


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def vllm_options(config: ReplicaConfig, model_id: str) -> VllmOptions:
    e = config.engine
    device = e.device or default_device()
    block_size = e.block_size or DEFAULT_BLOCK_SIZE[device]
    host_gib, _ = host_kv_gib(e.host_kv_gib, device, _gpus(device))
    if host_gib and device == "cpu":
        raise ValueError("host_kv_gib: vLLM offloads KV to host memory only from a GPU (0 on a CPU replica)")
    return VllmOptions(
        model_dir=config.model_dir,
        served_name=model_id,
        block_size=block_size,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        kv_cache_memory=e.kv_cache_memory,
        gpu_memory_utilization=e.gpu_memory_utilization,
        seed=e.seed,
        device=device,
        max_model_len=e.max_model_len,
        dtype=e.dtype or ("float32" if device == "cpu" else None),  # kvmesh's engine's default too
        num_kv_blocks=e.num_kv_blocks,
        tokenizer_dir=config.api.tokenizer,
        threads=config.torch_threads,
        host_kv_gib=host_gib,
        **({"python": config.vllm_python} if config.vllm_python else {}),
        extra_args=config.vllm_args,
    )


async def start_vllm_engine(config: ReplicaConfig, token: str | None) -> tuple[VllmEngine, ModelInfo, dict]:
    """Start vLLM for ``config``'s model and wait for it: the engine, the model as clients
    see it, and the index record's fields (as kvmesh's engine gives them)."""
    model_id = model_id_of(config.model_dir, config.model_id)
    options = vllm_options(config, model_id)
    await asyncio.to_thread(check_vllm, options.python)
    hash_seed = namespace_seed(model_id, options.block_size)
    engine = VllmEngine(VllmServer(options, token), config.engine, options.block_size, hash_seed)
    try:
        await engine.start()
        served = (await engine.models())[0]
    except BaseException:
        await engine.stop()
        raise
    model = ModelInfo(
        model_id,
        options.block_size,
        int(served["max_model_len"]),
        _vocab_size(config.model_dir),
        hash_seed,
        config.api.served_model_name,
    )
    info = {
        "model_id": model_id,
        "block_size": options.block_size,
        "hash_seed": hash_seed,
        "max_num_batched_tokens": options.max_num_batched_tokens,
        "max_num_seqs": options.max_num_seqs,
        "hardware": _hardware(options.device),
        "engine": "vllm",
    }
    return engine, model, info


def _gpus(device: str) -> int:
    import torch

    return torch.cuda.device_count() if device == "cuda" else 0


def _vocab_size(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))


def _hardware(device: str) -> str:
    import torch

    from kvmesh.replica.hardware import hardware_name

    return f"{hardware_name(torch.device(device))}/vllm"  # priced apart from kvmesh's engine there
