"""Token selection for one step: greedy rows by argmax, the rest by filtered sampling.

Every sampled request draws from its own ``torch.Generator``, so a request with a seed
gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from kvmesh.serving.sampling import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """One token id per row of ``logits`` ([rows, vocab], float32)."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = _filtered_probs(logits[rows], [params[i] for i in rows])
        for j, i in enumerate(rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of temperature-scaled logits after per-row top-k and top-p filtering."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        drop = rank >= top_k[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest head whose mass reaches top_p: drop a token once the mass
        # before it already does (the first token always stays).
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)
