"""A step launched on the device and not yet landed: what async scheduling keeps in flight.

With async scheduling the engine plans and launches step N+1 before it reads step N's
tokens, so the host's planning and output work runs while the device computes. A decode
row of step N+1 whose token step N is still sampling reads that token on the device
(``read_pending``); the host learns it when step N lands, one sync a step.
"""

from __future__ import annotations

import torch

from kvmesh.replica.engine.request import Request
from kvmesh.replica.engine.sampler import FailedPick, Pick

# Per input token, the row of the launched step's tokens it reads (-1: its own, known on the
# host), and those tokens.
Pending = tuple[list[int], torch.Tensor]


def read_pending(input_ids: torch.Tensor, sources: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``input_ids`` with each row whose source is a row of ``tokens`` replaced by it."""
    return torch.where(sources >= 0, tokens[sources.clamp(min=0)], input_ids)


class LaunchedStep:
    """The tokens one launched step draws for its sampling ``requests``, copied to the host
    as soon as the device has them; ``land`` waits for that copy alone."""

    def __init__(self, requests: list[Request], tokens: torch.Tensor, failed: dict[int, FailedPick]):
        self.requests = requests
        self.tokens = tokens  # on the device, where the next step reads them
        self.failed = failed  # rows whose own draw failed
        self._ready: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = tokens

    def land(self) -> list[Pick | FailedPick]:
        """Each sampling request's token, in order (or its own failure): the step's one sync."""
        if self._ready is not None:
            self._ready.synchronize()
        values = self._host.tolist()
        return [self.failed.get(j) or (values[j], None) for j in range(len(self.requests))]
