"""A step launched on the device and not yet landed: what async scheduling keeps in flight.

With async scheduling the engine plans and launches step N+1 before it reads step N's
tokens, so the host's planning and output work runs while the device computes. A decode
row of step N+1 whose token step N is still sampling reads that token on the device
(``read_pending``); the host learns it when step N lands, one sync a step.
"""

from __future__ import annotations

import torch

from kvmesh.engine.request import Request
from kvmesh.engine.sampler import Drawn, FailedPick, Pick

# Per input token, the row of the launched step's tokens it reads (-1: its own, known on the
# host), and those tokens.
Pending = tuple[list[int], torch.Tensor]


def read_pending(input_ids: torch.Tensor, sources: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``input_ids`` with each row whose source is a row of ``tokens`` replaced by it."""
    return torch.where(sources >= 0, tokens[sources.clamp(min=0)], input_ids)


class LaunchedStep:
    """What one launched step draws for its sampling ``requests`` (tokens, log-probabilities),
    copied to the host as soon as the device has it; ``land`` waits for that copy alone."""

    def __init__(self, requests: list[Request], drawn: Drawn):
        self.requests = requests
        self.drawn = drawn
        self._ready: torch.cuda.Event | None = None
        self._host = drawn.tensors
        if drawn.tokens.device.type == "cuda":
            self._host = [_to_pinned(t) if t.device.type == "cuda" else t for t in self._host]
            self._ready = torch.cuda.Event()
            self._ready.record()

    @property
    def tokens(self) -> torch.Tensor:
        """Its drawn tokens, on the device, where the next step reads them."""
        return self.drawn.tokens

    def land(self) -> list[Pick | FailedPick]:
        """Each sampling request's pick, in order (or its own failure): the step's one sync."""
        if self._ready is not None:
            self._ready.synchronize()
        return self.drawn.read([t.tolist() for t in self._host])


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
