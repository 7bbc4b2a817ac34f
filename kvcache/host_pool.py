"""The host tier's ledger: which cached blocks a replica keeps in host memory, in which slot.

A block leaves the device pool when its device block is handed out again; if it is not in
the host pool yet, it gets a slot here (the least recently used one when the pool is full)
and the engine copies its KV there before the device block is overwritten. A prefix match
that ends in the device pool continues here, block by block, with the same collision guard
(parent hash and token bytes); a block found here is restored into a fresh device block and
stays here too, so a block is copied to the host once however often it moves in and out of
the device. Slots are numbers; the bytes behind them are the engine's (``engine/host_kv``),
so this ledger runs without torch: the simulator prices the same tier with it.

What the device and host tiers hold together stays closed under parents, as the device pool
alone does (the index finds a replica's depth counting both tiers by bisection): a block
that leaves both takes its host-only descendants with it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.kvcache.events import HOST, BlockRemoved, BlockStored, KVEvent


@dataclass(frozen=True, slots=True)
class HostBlock:
    """What a slot holds: the block's hash, its parent's (the seed for a chain's first block),
    its chain's root and its token bytes."""

    hash: int
    parent: int
    root: int
    tokens: bytes


class HostPool:
    """``num_blocks`` slots of host memory for blocks of ``block_size`` tokens, LRU."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_events: bool = True,
        on_device: Callable[[int], bool] = lambda h: False,
    ):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_events = enable_events
        self._slots: list[HostBlock | None] = [None] * num_blocks
        self._table: dict[int, int] = {}  # hash -> slot
        self._children: dict[int, set[int]] = {}  # hash -> the hashes here whose parent it is
        self.on_device = on_device  # whether the device pool holds a hash (set by the block ledger)
        self._lru: OrderedDict[int, None] = OrderedDict()  # slots in use, least recently used first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pinned: set[int] = set()  # slots matched for a restore not yet queued: never evicted
        self._events: list[KVEvent] = []
        self.stores = 0  # blocks copied in
        self.restores = 0  # blocks copied back to the device
        self.evictions = 0  # blocks dropped to make room

    @property
    def num_used_blocks(self) -> int:
        return len(self._table)

    def cached_hashes(self) -> set[int]:
        return set(self._table)

    def cached_blocks(self) -> dict[int, int]:
        """Every hash here with its chain's root (what a resync publishes for this tier)."""
        return {block.hash: block.root for block in self._slots if block is not None}

    def find(self, h: int, parent: int, tokens: bytes | memoryview) -> int | None:
        """The slot holding block ``h`` with this parent and these tokens, else None."""
        slot = self._table.get(h)
        if slot is None:
            return None
        block = self._slots[slot]
        return slot if block.parent == parent and block.tokens == tokens else None

    def find_any(self, h: int) -> int | None:
        return self._table.get(h)

    def store(self, block: HostBlock) -> int | None:
        """A slot for ``block`` leaving the device (the caller copies its KV there), or None
        when the pool has it already (then it only becomes the most recently used) or does
        not keep it: every other slot is pinned, or its parent is in neither tier (no match
        could reach it)."""
        held = self._table.get(block.hash)
        if held is not None:
            self._lru.move_to_end(held)
            return None
        if not self._reachable(block):
            return None
        # The block's parent, when only this tier holds it, must outlive the eviction that
        # makes room: evicted, it would leave the new block unreachable.
        slot = self._free.pop() if self._free else self._evict(keep=self._table.get(block.parent))
        if slot is None:
            return None
        if not self._reachable(block):
            self._free.append(slot)  # the room was made by evicting an ancestor, and its parent with it
            return None
        self._slots[slot] = block
        self._table[block.hash] = slot
        self._children.setdefault(block.parent, set()).add(block.hash)
        self._lru[slot] = None
        self.stores += 1
        if self.enable_events:
            self._events.append(BlockStored((block.hash,), block.parent, self.block_size, block.root, HOST))
        return slot

    def _reachable(self, block: HostBlock) -> bool:
        """Whether a match could reach ``block``: it starts a chain, or a tier holds its parent."""
        return block.hash == block.root or block.parent in self._table or self.on_device(block.parent)

    def pin(self, slots: list[int]) -> None:
        """Keep ``slots`` from eviction until ``unpin``: blocks leaving the device while a
        request's restores are being planned must not land in a slot it is about to read."""
        self._pinned.update(slots)

    def unpin(self) -> None:
        self._pinned.clear()

    def restored(self, slot: int) -> None:
        """``slot`` was matched for a copy back to the device: it becomes the most recently used."""
        self._lru.move_to_end(slot)
        self.restores += 1

    def reset(self) -> None:
        """Forget every block (the device pool's reset clears this tier too)."""
        self._slots = [None] * self.num_blocks
        self._table.clear()
        self._children.clear()
        self._lru.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def left_both(self, h: int) -> None:
        """``h`` is in neither tier now: its descendants here could never be reached again."""
        orphans = list(self._children.pop(h, ()))
        while orphans:
            child = orphans.pop()
            slot = self._table.get(child)
            if slot is not None and slot not in self._pinned:
                self._drop(slot)
                self._free.append(slot)
                orphans.extend(self._children.pop(child, ()))

    def _evict(self, keep: int | None) -> int | None:
        slot = next((s for s in self._lru if s not in self._pinned and s != keep), None)
        if slot is None:
            return None
        h = self._slots[slot].hash
        self._drop(slot)
        self.evictions += 1
        if not self.on_device(h):
            self.left_both(h)
        return slot

    def _drop(self, slot: int) -> None:
        block = self._slots[slot]
        del self._lru[slot]
        del self._table[block.hash]
        siblings = self._children.get(block.parent)
        if siblings is not None:
            siblings.discard(block.hash)
            if not siblings:
                del self._children[block.parent]
        self._slots[slot] = None
        if self.enable_events:
            self._events.append(BlockRemoved((block.hash,), (block.root,), HOST))
