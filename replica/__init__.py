"""kvmesh.replica: the per-accelerator engine, its gRPC service and Ray actor.

Names are imported lazily, so ``kvmesh.replica.config`` (read by the CLI, which never loads
torch to parse flags) does not pull in torch.
"""

from importlib import import_module

_EXPORTS = {
    "AsyncLLMEngine": "kvmesh.replica.engine.async_engine",
    "EngineDeadError": "kvmesh.replica.engine.async_engine",
    "EngineConfig": "kvmesh.replica.config",
    "CompletionOutput": "kvmesh.replica.engine.llm_engine",
    "EngineStats": "kvmesh.replica.engine.llm_engine",
    "LLMEngine": "kvmesh.replica.engine.llm_engine",
    "RequestOutput": "kvmesh.replica.engine.request",
    "SamplingParams": "kvmesh.serving.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvmesh.replica' has no attribute {name!r}")
