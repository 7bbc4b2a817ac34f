"""kvmesh.replica: the server that hosts one engine on one accelerator: its request path
(``backend``), gRPC service and OpenAI HTTP, the index publisher, metrics, drain, the Ray
actor, and the adapter that makes a vLLM server look like an engine (``replica/vllm``).

It codes against the engine's face (``kvmesh.engine.protocol``); only ``process`` builds
kvmesh's own engine. It must not import the router.
"""
