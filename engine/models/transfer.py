"""Host values onto the device without waiting for it.

A blocking host-to-device copy first drains the stream, so with async scheduling a step's
plan would wait for the step before it; a non-blocking copy from pageable memory is staged at
once and the host goes on. Every step-sized value (ids, positions, plans, sampling
parameters, the rows a step picks) goes through here.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device`` (an empty list included)."""
    return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)


def rows_of(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``tensor[rows]`` without the wait that indexing by a list costs (the list is copied to
    the device blocking)."""
    return tensor.index_select(0, to_device(rows, torch.long, tensor.device))
