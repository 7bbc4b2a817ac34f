"""Memory-efficiency report of paged allocation (the nanoLLMServe article's numbers).

A paged ledger reserves whole blocks, so each sequence wastes at most ``block_size - 1``
tokens in its last block. The baseline it replaces reserves one contiguous slot per
sequence sized for the longest sequence present.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FragmentationReport:
    num_sequences: int
    block_size: int
    allocated_tokens: int  # tokens the sequences actually hold
    reserved_tokens: int  # whole blocks reserved for them
    fragmented_tokens: int  # reserved but unused (internal fragmentation)
    utilization: float  # allocated / reserved
    fixed_slot_tokens: int  # contiguous baseline: every sequence gets a max-length slot
    fixed_slot_utilization: float

    def as_dict(self) -> dict[str, int | float]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def fragmentation_report(seq_lengths: Sequence[int], block_size: int) -> FragmentationReport:
    """Report for sequences of ``seq_lengths`` tokens paged into ``block_size`` blocks."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if any(n < 0 for n in seq_lengths):
        raise ValueError("sequence lengths must be non-negative")
    allocated = sum(seq_lengths)
    reserved = sum(-(-n // block_size) * block_size for n in seq_lengths)
    fixed = len(seq_lengths) * max(seq_lengths, default=0)
    return FragmentationReport(
        num_sequences=len(seq_lengths),
        block_size=block_size,
        allocated_tokens=allocated,
        reserved_tokens=reserved,
        fragmented_tokens=reserved - allocated,
        utilization=allocated / reserved if reserved else 1.0,
        fixed_slot_tokens=fixed,
        fixed_slot_utilization=allocated / fixed if fixed else 1.0,
    )
