"""The nano-vllm article's block manager, written plainly: the baseline and the test oracle.

Mechanics kept on purpose, because they are what kvmesh's ledger is measured against:
``Block`` objects, a ``deque`` free list whose ``remove`` is O(n), eager hashing at
allocation with a fresh ``np.array(tokens).tobytes()`` and ``xxh64`` per block.

Two corrections, so that it is a trustworthy oracle for tests:
  - ``can_allocate`` returns the reusable block count (the design's API) and counts
    exactly what allocation will take from the free list;
  - handing a block out again removes its hash from the table. The article leaves the
    stale entry behind, guarded only by token equality, so a block later refilled with
    the same tokens at another position would be returned for the old prefix.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import xxhash

from kvmesh.kvcache.sequence import Sequence


def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.array(token_ids).tobytes())
    return h.intdigest()


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.parent = -1  # the hash it was chained on (-1: first block)
        self.token_ids: list[int] = []


class ReferenceBlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    def _lookup(self, seq: Sequence) -> list[int]:
        """Block ids of the leading cached blocks (the last block is never looked up)."""
        found, h = [], -1
        for i in range((len(seq) - 1) // self.block_size):
            token_ids = seq.block(i)
            h = compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            found.append(block_id)
        return found

    def can_allocate(self, seq: Sequence) -> int:
        found = self._lookup(seq)
        need = seq.num_blocks - len(found) + sum(b not in self.used_block_ids for b in found)
        return len(found) if need <= len(self.free_block_ids) else -1

    def _allocate_block(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.ref_count, block.hash, block.token_ids = 1, -1, []
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def _take_free_block(self) -> Block:
        """A fresh block: the head of the free list (whatever it cached is overwritten)."""
        return self._allocate_block(self.free_block_ids[0])

    def _register(self, block: Block, h: int, token_ids: list[int], parent: int) -> None:
        """The newest holder of a hash wins (an older duplicate is simply no longer found)."""
        block.hash, block.parent, block.token_ids = h, parent, token_ids
        self.hash_to_block_id[h] = block.block_id

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        h = -1
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            parent = h
            h = compute_hash(token_ids, h) if len(token_ids) == self.block_size else -1
            if i < num_cached_blocks:
                block_id = self.hash_to_block_id[h]
                seq.num_cached_tokens += self.block_size
                if block_id in self.used_block_ids:
                    self.blocks[block_id].ref_count += 1
                else:
                    self._register(self._allocate_block(block_id), h, token_ids, parent)
            else:
                block = self._take_free_block()
                block_id = block.block_id
                if h != -1:
                    self._register(block, h, token_ids, parent)
            seq.block_table.append(block_id)

    def may_append(self, seq: Sequence) -> None:
        block_table = seq.block_table
        if len(seq) % self.block_size == 1:
            block_table.append(self._take_free_block().block_id)
        elif len(seq) % self.block_size == 0:
            token_ids = seq.block(seq.num_blocks - 1)
            prefix = self.blocks[block_table[-2]].hash if len(block_table) > 1 else -1
            self._register(self.blocks[block_table[-1]], compute_hash(token_ids, prefix), token_ids, prefix)

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()
