"""kvmesh.replica.vllm: a real vLLM server as a replica's engine (``--engine vllm``).

Owns starting vLLM, reading its KV events into kvmesh's hashes, and relaying requests to it;
the replica around it (gRPC, OpenAI front end, index publisher) is kvmesh's own. Imported
only for engine=vllm: it needs kvmesh[vllm]'s pyzmq and httpx, never vLLM itself (vLLM runs in
its own process, from whichever Python has it).
"""
