"""A request's tokens and the block ledger's view of them (block table and progress)."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable

_seq_ids = itertools.count()


class Sequence:
    """Token ids plus the bookkeeping the BlockManager and scheduler share.

    Progress counters, all in tokens:
      - ``num_cached_tokens``: prompt tokens reused from the prefix cache at allocation
        (what usage reports as cached tokens);
      - ``num_host_cached_tokens``: of those, the ones restored from the host tier;
      - ``num_computed_tokens``: tokens whose KV is in the cache now;
      - ``num_scheduled_tokens``: tokens the current engine step computes.
    ``block_hashes`` is the content hash chain of the full blocks, filled lazily by the
    BlockManager; ``num_hashed_blocks`` counts the leading blocks already entered in its
    hash table (reused on allocation or registered by ``hash_blocks``); ``hash_collided``
    is set when one of its blocks collided with different content, after which none of
    its later blocks is shared.
    """

    def __init__(self, token_ids: Iterable[int], block_size: int, seq_id: int | None = None):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        # a compact array("I") is kept as it is: the simulator holds 100,000s of prompts at once
        self.token_ids: list[int] | array = token_ids if isinstance(token_ids, array) else list(token_ids)
        if not self.token_ids:
            raise ValueError("a sequence needs at least one token")
        self.seq_id = next(_seq_ids) if seq_id is None else seq_id
        self.block_size = block_size
        self.num_prompt_tokens = len(self.token_ids)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_hashed_blocks = 0
        self.hash_collided = False
        self.num_cached_tokens = 0
        self.num_host_cached_tokens = 0
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={len(self)}, blocks={self.block_table}, "
            f"cached={self.num_cached_tokens}, computed={self.num_computed_tokens})"
        )

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold every token, the partial last one included."""
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def num_full_blocks(self) -> int:
        return len(self.token_ids) // self.block_size

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_tokens // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return len(self.token_ids) - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """Token ids of block ``i``."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block {i} out of range for {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def reset_progress(self) -> None:
        """Forget placement and progress (after the blocks were freed); keep the tokens."""
        self.block_table = []
        self.num_hashed_blocks = 0
        self.num_cached_tokens = 0
        self.num_host_cached_tokens = 0
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
