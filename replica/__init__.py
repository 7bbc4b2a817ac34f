"""kvmesh.replica: the per-accelerator engine, its gRPC service and Ray actor."""

from kvmesh.replica.async_engine import AsyncLLMEngine, EngineDeadError
from kvmesh.replica.config import EngineConfig
from kvmesh.replica.engine import CompletionOutput, EngineStats, LLMEngine
from kvmesh.replica.request import RequestOutput
from kvmesh.replica.sampling_params import SamplingParams

__all__ = [
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
