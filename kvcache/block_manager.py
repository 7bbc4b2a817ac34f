"""Paged KV block ledger with a chained-hash prefix cache (nano-vllm semantics, O(1) ops).

Semantics, as in nano-vllm's BlockManager:
  - blocks are ref-counted; a full block whose KV is computed is entered in a hash table;
  - a freed block keeps its hash and stays hittable until it is handed out again;
  - a prompt's last block is never looked up, so at least one token is always computed;
  - blocks are freed in reverse order, so a sequence's tail is evicted before its head;
  - a hit is only taken when the block's stored tokens equal the request's (collision guard).

What differs: the free pool is one insertion-ordered dict (LRU order, O(1) removal of a
free block that gets a hit, where nano-vllm's ``deque.remove`` is O(n)); hashing walks one
token buffer per call; and every change to the set of hittable hashes is recorded as a KV
event so a remote index can mirror it exactly.

With a host tier (``HostPool``), a hashed block whose device block is handed out again moves
to the host pool, and a prefix match continues there past the device's blocks: those blocks
get fresh device blocks and count as cached. The KV copies this asks for (``Transfer``:
offloads to host slots, restores from them) are drained by the engine, which runs them in
order before the step that overwrites or reads those device blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from kvmesh.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmesh.kvcache.fragmentation import FragmentationReport, fragmentation_report
from kvmesh.kvcache.hashing import hash_chain, token_buffer
from kvmesh.kvcache.host_pool import HostBlock, HostPool
from kvmesh.kvcache.sequence import Sequence

OFFLOAD, RESTORE = "offload", "restore"


@dataclass(frozen=True, slots=True)
class Transfer:
    """One block's KV copy between the tiers: ``offload`` device block -> host slot, or
    ``restore`` host slot -> device block. Run in the order they were asked for."""

    kind: str
    block: int
    slot: int


class KVCacheError(RuntimeError):
    """The ledger was used in a way that would corrupt it (double free, no space, ...)."""


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    num_blocks: int
    block_size: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int  # free, but still hittable
    num_cached_hashes: int  # hashes a new request could hit
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int  # hashed blocks handed out again

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens and the prefix hash table.

    Typical engine use per sequence::

        n = bm.can_allocate(seq)         # -1: does not fit now
        bm.allocate(seq, n)              # reuses n cached blocks, takes fresh ones for the rest
        ... compute KV, advance seq.num_computed_tokens ...
        bm.hash_blocks(seq)              # newly full, computed blocks become hittable
        if bm.can_append(seq): bm.may_append(seq)   # before each decode step
        bm.deallocate(seq)               # finished, aborted or preempted
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        seed: int = 0,
        enable_events: bool = True,
        host: HostPool | None = None,
    ):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.seed = seed
        self.enable_events = enable_events
        self.host = host
        self._transfers: list[Transfer] = []
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # Collision guard: a hit needs the same parent hash and the same token bytes.
        self._parent: list[int | None] = [None] * num_blocks
        self._root: list[int | None] = [None] * num_blocks  # the first hash of the block's chain
        self._children: dict[int, set[int]] = {}  # hash -> hashed blocks whose parent it is
        self._tokens: list[bytes | None] = [None] * num_blocks
        # Free blocks, oldest first: allocation pops the head, freeing appends at the tail.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._table: dict[int, int] = {}  # hash -> the one block holding it
        if host is not None:
            host.on_device = self._table.__contains__
        self._live: dict[int, Sequence] = {}  # seq_id -> sequences holding blocks
        self._events: list[KVEvent] = []
        self._num_cached_free = 0
        self._mutations = 0
        # (seq, len, mutations, device hits, host slots after them): the last match, reused by
        # allocate while nothing changed
        self._last_match: tuple[int, int, int, int, list[int]] | None = None
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.host_hit_tokens = 0  # of prefix_hit_tokens, those restored from the host tier
        self.evictions = 0
        # For telling an index that lags from one that lies: when each block became
        # hittable, and when recently evicted hashes left (bounded: the last num_blocks).
        self._stored_at = [0.0] * num_blocks
        self._evicted_at: OrderedDict[int, float] = OrderedDict()

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash[block_id]

    def cached_hashes(self) -> set[int]:
        """Hashes a new request could hit right now."""
        return set(self._table)

    def cached_blocks(self) -> dict[int, int]:
        """Hashes a new request could hit right now, each with its chain's root (first) hash:
        what a resync publishes (the index places a chain's blocks by their root)."""
        root = self._root
        return {h: root[b] for h, b in self._table.items()}

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_used_blocks=self.num_used_blocks,
            num_free_blocks=len(self._free),
            num_cached_free_blocks=self._num_cached_free,
            num_cached_hashes=len(self._table),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            evictions=self.evictions,
        )

    def hit_facts(self, seq: Sequence) -> tuple[list[float], float | None]:
        """For a just-allocated ``seq``: when each block it reused became hittable, and when
        the first prompt block past them was evicted (None: not recently), both monotonic."""
        hits = seq.num_cached_tokens // self.block_size
        stored = [self._stored_at[b] for b in seq.block_table[:hits]]
        after = seq.block_hashes[hits] if hits < len(seq.block_hashes) else None
        return stored, self._evicted_at.get(after) if after is not None else None

    def fragmentation(self) -> FragmentationReport:
        """Allocated vs reserved tokens over the sequences holding blocks now."""
        return fragmentation_report([len(s) for s in self._live.values()], self.block_size)

    def drain_events(self) -> list[KVEvent]:
        """KV events since the last drain, oldest first within each tier (the device's, then
        the host's: a reset, the one event of both, moves the host's earlier ones ahead of it)."""
        events, self._events = self._events, []
        return events + self.host.drain_events() if self.host is not None else events

    def drain_transfers(self) -> list[Transfer]:
        """The KV copies asked for since the last drain, in the order they must run."""
        transfers, self._transfers = self._transfers, []
        return transfers

    # ------------------------------------------------------------------ allocation

    def can_allocate(self, seq: Sequence) -> int:
        """Number of cached blocks ``seq`` would reuse (from the device, then restored from
        the host), or -1 if it cannot fit now."""
        if seq.block_table:
            raise KVCacheError(f"sequence {seq.seq_id} already has a block table")
        hits, hits_free, host_slots = self._match(seq)
        self._last_match = (seq.seq_id, len(seq), self._mutations, hits, host_slots)
        fits = seq.num_blocks - hits + hits_free <= len(self._free)
        return hits + len(host_slots) if fits else -1

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        """Give ``seq`` its block table: ``num_cached_blocks`` reused, the rest fresh."""
        if seq.block_table:
            raise KVCacheError(f"sequence {seq.seq_id} already has a block table")
        hits, host_slots = self._verified_hits(seq)
        if not 0 <= num_cached_blocks <= hits + len(host_slots):
            raise KVCacheError(
                f"sequence {seq.seq_id}: {num_cached_blocks} cached blocks requested, "
                f"only {hits + len(host_slots)} match (call can_allocate right before allocate)"
            )
        on_device = min(num_cached_blocks, hits)
        reused = [self._table[h] for h in seq.block_hashes[:on_device]]
        needed = seq.num_blocks - on_device + sum(1 for b in reused if self._ref[b] == 0)
        if needed > len(self._free):
            raise KVCacheError(
                f"sequence {seq.seq_id} needs {needed} free blocks, {len(self._free)} are free"
            )
        self._mutations += 1
        for b in reused:
            if self._ref[b] == 0:
                del self._free[b]
                self._num_cached_free -= 1
            self._ref[b] += 1
        slots = host_slots[: num_cached_blocks - on_device]
        if slots:
            self.host.pin(slots)
        removed: list[tuple[int, int]] = []
        fresh = [self._take_free_block(removed) for _ in range(seq.num_blocks - on_device)]
        self._emit_removed(removed)
        if slots:
            self._restore(seq, on_device, slots, fresh)
            self.host.unpin()
        seq.block_table = reused + fresh
        seq.num_hashed_blocks = num_cached_blocks
        seq.num_cached_tokens = seq.num_computed_tokens = num_cached_blocks * self.block_size
        seq.num_host_cached_tokens = len(slots) * self.block_size
        self.prefix_query_tokens += len(seq)
        self.prefix_hit_tokens += seq.num_cached_tokens
        self.host_hit_tokens += seq.num_host_cached_tokens
        self._live[seq.seq_id] = seq

    def can_append(self, seq: Sequence) -> bool:
        """Whether the blocks ``seq``'s tokens need (at most one more when decoding) are free."""
        return seq.num_blocks - len(seq.block_table) <= len(self._free)

    def may_append(self, seq: Sequence) -> None:
        """Grow the block table so every token fits: a new block when len % block_size == 1."""
        if not seq.block_table:
            raise KVCacheError(f"sequence {seq.seq_id} has no blocks; allocate it first")
        missing = seq.num_blocks - len(seq.block_table)
        if missing <= 0:
            return
        if missing > len(self._free):
            raise KVCacheError(
                f"sequence {seq.seq_id} needs {missing} more block(s) and none are free "
                "(check can_append and preempt first)"
            )
        self._mutations += 1
        removed: list[tuple[int, int]] = []
        for _ in range(missing):
            seq.block_table.append(self._take_free_block(removed))
        self._emit_removed(removed)

    def hash_blocks(self, seq: Sequence) -> None:
        """Enter the full blocks whose KV is now computed into the hash table (hittable)."""
        bs = self.block_size
        start = seq.num_hashed_blocks
        end = min(seq.num_computed_tokens, len(seq)) // bs
        if end <= start or seq.hash_collided:
            return
        if end > len(seq.block_table):
            raise KVCacheError(f"sequence {seq.seq_id} computed tokens beyond its block table")
        self._mutations += 1
        now = time.monotonic()
        buf = token_buffer(seq.token_ids[start * bs : end * bs])
        hashes = self._content_hashes(seq, end, buf, start)
        if start and hashes[start - 1] not in self._table:
            return  # its parent was evicted: the rest of this chain could never be hit
        step = bs * 4
        run: list[int] = []
        parent = hashes[start - 1] if start else self.seed
        run_parent = hashes[start - 1] if start else None  # events name no parent for block 0
        for i in range(start, end):
            b, h = seq.block_table[i], hashes[i]
            tokens = bytes(buf[(i - start) * step : (i - start + 1) * step])
            holder = self._table.get(h)
            if holder is None:
                run.append(h)
            elif self._holds(holder, parent, tokens):
                # The same content computed twice: the newer block (freed later, evicted
                # later) takes over the hash; the hash stays resolvable, so no event.
                self._emit_stored(run, run_parent, hashes[0])
                run, run_parent = [], h
                self._drop_hash(holder)
            else:
                # A real collision: this block and every later one of the chain would be
                # found under another prefix's hashes, so none of them is entered.
                seq.hash_collided = True
                break
            self._enter(b, h, parent, tokens, hashes[0], now)
            parent = h
        self._emit_stored(run, run_parent, hashes[0])
        seq.num_hashed_blocks = end

    def _enter(self, b: int, h: int, parent: int, tokens: bytes, root: int, now: float) -> None:
        """Block ``b`` holds ``h`` (its KV computed, or restored before any step reads it)."""
        self._table[h] = b
        self._hash[b], self._parent[b], self._tokens[b] = h, parent, tokens
        self._root[b] = root
        if h != root:
            self._children.setdefault(parent, set()).add(b)
        self._stored_at[b] = now

    def deallocate(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first; hashed blocks stay hittable until reused."""
        if not seq.block_table:
            raise KVCacheError(f"sequence {seq.seq_id} holds no blocks (freed twice?)")
        self._mutations += 1
        for b in reversed(seq.block_table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._hash[b] is not None:
                    self._num_cached_free += 1
        self._live.pop(seq.seq_id, None)
        seq.reset_progress()

    def reset(self) -> None:
        """Forget every cached hash (cold cache). Only allowed while no sequence holds blocks."""
        if self._live:
            raise KVCacheError(
                f"cannot reset the prefix cache while {len(self._live)} sequence(s) hold blocks"
            )
        self._mutations += 1
        self._hash = [None] * self.num_blocks
        self._parent = [None] * self.num_blocks
        self._root = [None] * self.num_blocks
        self._children.clear()
        self._tokens = [None] * self.num_blocks
        self._table.clear()
        self._num_cached_free = 0
        if self.host is not None:
            self._events += self.host.drain_events()  # before the clear that ends them
            self.host.reset()
        if self.enable_events:
            self._events.append(AllBlocksCleared())

    def check_invariants(self) -> None:
        """Raise KVCacheError naming the first broken invariant (O(blocks); for tests and
        the engine's ``check_invariants`` debug setting):

        - each block's ref count equals the number of live block tables holding it;
        - free blocks are exactly the unreferenced ones (free and used partition the pool);
        - ``_table[h] == b`` exactly when ``_hash[b] == h``;
        - the cached-free count equals the free blocks that still hold a hash.
        """
        holders = [0] * self.num_blocks
        for seq in self._live.values():
            if len(set(seq.block_table)) != len(seq.block_table):
                raise KVCacheError(f"sequence {seq.seq_id} holds a block twice: {seq.block_table}")
            for b in seq.block_table:
                holders[b] += 1
        wrong = next((b for b in range(self.num_blocks) if self._ref[b] != holders[b]), None)
        if wrong is not None:
            raise KVCacheError(
                f"block {wrong} has ref count {self._ref[wrong]} but {holders[wrong]} block tables hold it"
            )
        unreferenced = {b for b in range(self.num_blocks) if self._ref[b] == 0}
        if set(self._free) != unreferenced or len(self._free) != len(unreferenced):
            raise KVCacheError(
                f"free list {sorted(self._free)} differs from the unreferenced blocks {sorted(unreferenced)}"
            )
        for h, b in self._table.items():
            if self._hash[b] != h:
                raise KVCacheError(f"table maps hash {h} to block {b}, which holds hash {self._hash[b]}")
        for b, h in enumerate(self._hash):
            if h is not None and self._table.get(h) != b:
                raise KVCacheError(f"block {b} holds hash {h}, which the table maps to {self._table.get(h)}")
        cached_free = sum(1 for b in self._free if self._hash[b] is not None)
        if cached_free != self._num_cached_free:
            raise KVCacheError(
                f"cached-free count is {self._num_cached_free}, {cached_free} free blocks hold a hash"
            )

    # ------------------------------------------------------------------ internals

    def _content_hashes(self, seq: Sequence, n_blocks: int, buf: memoryview, buf_block: int) -> list[int]:
        """``seq.block_hashes`` extended to ``n_blocks``; ``buf`` holds blocks from ``buf_block``."""
        have = len(seq.block_hashes)
        if have < n_blocks:
            parent = seq.block_hashes[-1] if have else self.seed
            step = self.block_size * 4
            lo = (have - buf_block) * step
            seq.block_hashes.extend(
                hash_chain(buf[lo : (n_blocks - buf_block) * step], self.block_size, parent)
            )
        return seq.block_hashes

    def _match(self, seq: Sequence) -> tuple[int, int, list[int]]:
        """(leading blocks hittable, how many of those are free, the host slots of the blocks
        after them that the host tier holds) for ``seq``."""
        bs = self.block_size
        lookable = (len(seq) - 1) // bs  # the last block is never looked up
        if lookable == 0:
            return 0, 0, []
        buf = token_buffer(seq.token_ids[: lookable * bs])
        hashes = self._content_hashes(seq, lookable, buf, 0)
        step = bs * 4
        hits = hits_free = 0
        parent = self.seed
        for i in range(lookable):
            b = self._table.get(hashes[i])
            if b is None or not self._holds(b, parent, buf[i * step : (i + 1) * step]):
                break
            hits += 1
            hits_free += self._ref[b] == 0
            parent = hashes[i]
        host_slots = self._host_run(hashes, hits, lookable, buf) if self.host is not None else []
        return hits, hits_free, host_slots

    def _host_run(self, hashes: list[int], start: int, end: int, buf: memoryview) -> list[int]:
        """The host slots holding blocks ``start``, ``start + 1``, ... of a chain, up to the
        first it lacks (``buf``: the chain's token bytes from block 0)."""
        step = self.block_size * 4
        slots = []
        parent = hashes[start - 1] if start else self.seed
        for i in range(start, end):
            if hashes[i] in self._table:
                break  # the device holds this hash for other tokens (a collision): not ours to restore
            slot = self.host.find(hashes[i], parent, buf[i * step : (i + 1) * step])
            if slot is None:
                break
            slots.append(slot)
            parent = hashes[i]
        return slots

    def _restore(self, seq: Sequence, start: int, slots: list[int], fresh: list[int]) -> None:
        """Blocks ``start:`` of ``seq`` come back from ``slots`` into its first fresh blocks:
        hittable at once (the copies run before any step reads them)."""
        now = time.monotonic()
        hashes, bs = seq.block_hashes, self.block_size
        buf = token_buffer(seq.token_ids[start * bs : (start + len(slots)) * bs])
        parent = hashes[start - 1] if start else self.seed
        run = []
        for k, (slot, b) in enumerate(zip(slots, fresh, strict=False)):
            h = hashes[start + k]
            self._enter(b, h, parent, bytes(buf[k * bs * 4 : (k + 1) * bs * 4]), hashes[0], now)
            self._transfers.append(Transfer(RESTORE, b, slot))
            self.host.restored(slot)
            run.append(h)
            parent = h
        self._emit_stored(run, hashes[start - 1] if start else None, hashes[0])

    def _holds(self, b: int, parent: int, tokens: bytes | memoryview) -> bool:
        return self._parent[b] == parent and self._tokens[b] == tokens

    def _verified_hits(self, seq: Sequence) -> tuple[int, list[int]]:
        """(device hits, host slots after them) from the last can_allocate if nothing changed
        since, else a fresh match."""
        last = self._last_match
        if last is not None and last[:3] == (seq.seq_id, len(seq), self._mutations):
            return last[3], last[4]
        hits, _, host_slots = self._match(seq)
        return hits, host_slots

    def _take_free_block(self, removed: list[tuple[int, int]]) -> int:
        """Pop the least recently freed block; its hash, if any, stops being resolvable."""
        b, _ = self._free.popitem(last=False)
        h = self._hash[b]
        if h is not None:
            self.evictions += 1
            self._offload(b)
            self._unhash(b, removed)
            # Its cached descendants can no longer be hit (a hit walks the chain from its first
            # block): they leave too, so what is hittable stays closed under parents.
            orphaned = [h]
            while orphaned:
                for child in self._children.pop(orphaned.pop(), ()):
                    orphaned.append(self._hash[child])
                    self._offload(child)
                    self._unhash(child, removed)
        self._ref[b] = 1
        return b

    def _offload(self, b: int) -> None:
        """Block ``b``'s hash leaves the device: keep it in the host tier (copied once)."""
        if self.host is None:
            return
        h = self._hash[b]
        slot = self.host.store(HostBlock(h, self._parent[b], self._root[b], self._tokens[b]))
        if slot is not None:
            self._transfers.append(Transfer(OFFLOAD, b, slot))
        elif self.host.find_any(h) is None:  # not kept: it leaves both tiers, with its host descendants
            self.host.left_both(h)

    def _unhash(self, b: int, removed: list[tuple[int, int]]) -> None:
        """Block ``b``'s hash stops being resolvable (noted in ``removed``)."""
        h = self._hash[b]
        removed.append((h, self._root[b]))
        self._drop_hash(b)
        del self._table[h]
        self._evicted_at[h] = time.monotonic()
        self._evicted_at.move_to_end(h)
        if len(self._evicted_at) > self.num_blocks:
            self._evicted_at.popitem(last=False)

    def _drop_hash(self, b: int) -> None:
        if self._ref[b] == 0:
            self._num_cached_free -= 1
        siblings = self._children.get(self._parent[b])
        if siblings is not None:
            siblings.discard(b)
            if not siblings:
                del self._children[self._parent[b]]
        self._hash[b] = self._parent[b] = self._tokens[b] = self._root[b] = None

    def _emit_stored(self, run: list[int], parent: int | None, root: int) -> None:
        if run and self.enable_events:
            self._events.append(BlockStored(tuple(run), parent, self.block_size, root))

    def _emit_removed(self, removed: list[tuple[int, int]]) -> None:
        if removed and self.enable_events:
            hashes, roots = zip(*removed, strict=True)
            self._events.append(BlockRemoved(hashes, roots))
