"""One decoder-only transformer for the Llama, Qwen2 and Qwen3 families.

The families differ only in switches: Qwen2 has a bias on q/k/v, Qwen3 normalizes q and
k per head before rotary, Llama may carry biases everywhere (``attention_bias``,
``mlp_bias``). q/k/v and gate/up are fused into one matmul each; the loader splits the
checkpoint's separate tensors into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvmesh.engine.models.attention import AttentionBackend
from kvmesh.engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary, rms_normalized


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    inv_freq: torch.Tensor
    attention_scaling: float


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.qk_norm_weight = torch.empty(0)  # set by fuse_qk_norm once the weights are in
        self.k_cache = self.v_cache = torch.empty(0)  # set by the model runner

    def fuse_qk_norm(self) -> None:
        """One weight row per head, q's heads then k's: queries and keys are normalized and
        rotated as one tensor, half the small ops (kernel launches, on a GPU) of doing each."""
        if self.qk_norm:
            self.qk_norm_weight = torch.cat(
                [
                    self.q_norm.weight.expand(self.num_heads, self.head_dim),
                    self.k_norm.weight.expand(self.num_kv_heads, self.head_dim),
                ]
            )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend, plan
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(
            tokens, self.num_heads + self.num_kv_heads, self.head_dim
        )
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # transformers' q_norm and k_norm, elementwise the same
            qk = self.qk_norm_weight * rms_normalized(qk, self.q_norm.eps)
        q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        out = backend.forward(q, k, v.contiguous(), self.k_cache, self.v_cache, plan, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)

    def forward(self, x: torch.Tensor, cos, sin, backend: AttentionBackend, plan) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec):
        super().__init__()
        # No random init (every weight is loaded): a normal_ on the meta device imports
        # torch._dynamo, and the frames of that import held the first engine in a cycle.
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(spec.vocab_size, spec.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """Parameter names mirror transformers' (``model.layers.N.self_attn...``, ``lm_head``)."""

    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(spec.inv_freq, spec.attention_scaling)

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_weights(self) -> None:
        """Derived weights, built once the checkpoint is loaded."""
        for layer in self.model.layers:
            layer.self_attn.fuse_qk_norm()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, plan
    ) -> torch.Tensor:
        """Hidden states of every scheduled token (logits are computed for a few only)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, backend, plan)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
