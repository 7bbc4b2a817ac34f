"""Building blocks shared by every supported decoder family.

Each op follows the Hugging Face reference implementation's order of floating-point
operations, so fp32 outputs on the CPU match ``transformers`` to the last bit wherever the
matmul shapes agree (on CUDA, the fused kernels may round differently).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalized(x, self.eps)


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' x * rsqrt(mean(x^2) + eps) in fp32, back in the input's dtype (the weight
    comes after). ``F.rms_norm`` is one fused kernel on CUDA where the spelled-out form is
    five (a step of a 28-layer model launches 113 norms: on a GPU, steps are launch-bound)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for the positions of one step, computed from ``inv_freq`` like transformers."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]  # broadcast over heads


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos) + (_rotate_half(x) * sin)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
