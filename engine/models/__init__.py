"""kvmesh.engine.models: what a model is made of: the decoder families kvmesh serves (Llama,
Qwen2, Qwen3), their layers, the loader from a local Hugging Face folder, and the paged
attention backends a layer calls (torch, flash-attn, kvmesh's Triton kernels). It must not
import the engine (``engine``) that runs it."""
