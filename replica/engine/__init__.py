"""kvmesh.replica.engine: the engine core, nano-vllm's shape: ``LLMEngine`` (one step at a time:
schedule, run the model, sample, outputs), its step loop in a thread for async streams
(``async_engine``), the scheduler, the model runner with its KV pool and decode CUDA graphs,
the sampler, the detokenizer, requests and the online step-cost fit.

It builds on ``replica/models`` and ``replica/kernels``; it must not import the replica's
server side (backend, gRPC service, publisher, process, actor) or ``replica/vllm``.
"""
