"""kvmesh.engine: kvmesh's own engine, nano-vllm's shape: ``LLMEngine`` (one step at a time:
schedule, run the model, sample, outputs), its step loop in a thread for async streams
(``async_engine``), the scheduler, the model runner with its KV pool and decode CUDA graphs,
the sampler, the detokenizer, requests and the online step-cost fit; the models it runs
(``engine/models``) and its Triton kernels (``engine/kernels``).

``protocol`` is the face a replica needs of any engine (this one or vLLM behind its adapter):
a replica server codes against it. The engine must not import the replica server that hosts
it (``kvmesh.replica``), the router or the cluster.

Names are imported lazily, so ``kvmesh.engine.config`` (read by the CLI, which never loads
torch to parse flags) does not pull in torch.
"""

from importlib import import_module

_EXPORTS = {
    "AsyncLLMEngine": "kvmesh.engine.async_engine",
    "EngineConfig": "kvmesh.engine.config",
    "EngineDeadError": "kvmesh.engine.protocol",
    "CompletionOutput": "kvmesh.engine.llm_engine",
    "EngineStats": "kvmesh.engine.protocol",
    "LLMEngine": "kvmesh.engine.llm_engine",
    "RequestOutput": "kvmesh.engine.request",
    "SamplingParams": "kvmesh.serving.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvmesh.engine' has no attribute {name!r}")
