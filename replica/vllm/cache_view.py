"""vLLM's KV events, turned into kvmesh's: what a vLLM replica publishes to the index.

vLLM announces each block it caches with the block's token ids (``BlockStored``), each
block it evicts (``BlockRemoved``) and a reset (``AllBlocksCleared``), keyed by its own
block hashes. kvmesh's index and router key blocks by kvmesh's chained xxhash
(``kvcache/hashing.py``), so ``CacheView`` re-hashes every stored block from its tokens,
chained onto its parent's kvmesh hash, and remembers vLLM's hash -> kvmesh's for removals.
One index then serves kvmesh and vLLM replicas of a model alike.

vLLM may cache two copies of one block (two requests computed it at once) and evicts them
one at a time, each with its own ``BlockRemoved``: a hash stays while any copy does.

With vLLM's own host tier (its OffloadingConnector, ``--kv-offloading-size``, self-describing
events on), events whose ``medium`` is "CPU" say what it keeps in host memory: the same
tokens, parent and block hashes, so the same re-hashing, into the view's host tier (an
offloaded chunk of several blocks announces each of them; a chunk that overlaps another
announces their shared blocks again: counted like copies). A CPU block's parent may be
held in either tier; one whose parent the view holds in neither is left out (its chain
could not be matched from its head). "GPU" (or no medium: older releases) is the device
tier; any other medium (disk), or a tier vLLM says is remote, is not indexed.
Blocks whose hash depends on more than tokens (a LoRA adapter, images, a cache salt) cannot
be matched by a token-only hash: they and their descendants are left out of the view.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvmesh.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, hash_chain, token_buffer
from kvmesh.kvcache.events import DEVICE, HOST

VllmHash = int | bytes  # vLLM's block hash (an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
_EVENT_KINDS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
_MEDIA = {None: DEVICE, "GPU": DEVICE, "CPU": HOST}  # vLLM's medium -> kvmesh's tier


class EventFormatError(ValueError):
    """A payload that is not a vLLM KV event batch as kvmesh reads it."""


class BrokenChain(Exception):
    """A stored block's parent is unknown: events were lost, so the view is not vLLM's cache."""


@dataclass(frozen=True)
class _Block:
    hash: int  # kvmesh's
    root: int  # kvmesh's hash of its chain's first block
    copies: int
    stored_at: float  # monotonic: when this view first held it


def decode_batch(payload: Any) -> list[dict[str, Any]]:
    """A decoded msgpack batch (``[ts, events, dp_rank]``) as its events, each a dict with
    ``type``. Events come as tagged maps (vLLM 0.11+); older releases sent tagged arrays
    (``["BlockStored", hashes, parent, token_ids, block_size, ...]``), read here by position."""
    if isinstance(payload, dict):
        events = payload.get("events")
    elif isinstance(payload, (list, tuple)) and len(payload) >= 2:
        events = payload[1]
    else:
        raise EventFormatError(f"not an event batch: {type(payload).__name__}")
    if not isinstance(events, (list, tuple)):
        raise EventFormatError("an event batch's events are not a list")
    return [_event(e) for e in events]


_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _event(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        kind = raw.get("type")
        event = raw
    elif isinstance(raw, (list, tuple)) and raw:
        kind = raw[0]
        event = {"type": kind, **dict(zip(_ARRAY_FIELDS.get(kind, ()), raw[1:], strict=False))}
    else:
        raise EventFormatError(f"not a KV event: {type(raw).__name__}")
    if kind not in _EVENT_KINDS:
        raise EventFormatError(f"unknown KV event type {kind!r}")
    return event


class CacheView:
    """The kvmesh hashes of what one vLLM engine holds, kept by applying its events in order."""

    def __init__(self, block_size: int, seed: int, clock=time.monotonic):
        """``block_size`` and ``seed``: the index's for this model (vLLM must cache blocks of
        the same size: a prediction finer than vLLM's blocks would claim hits it cannot make)."""
        self.block_size = block_size
        self.seed = seed
        self.clock = clock
        self._blocks: dict[VllmHash, _Block] = {}  # the device tier's
        self._host: dict[VllmHash, _Block] = {}  # the host tier's
        self._foreign: set[VllmHash] = set()  # cached under keys beyond tokens: never indexed
        self._by_hash: dict[int, VllmHash] = {}  # kvmesh hash -> vLLM's
        self._evicted_at: dict[int, float] = {}  # kvmesh hash -> when it left, lately
        self.blocks_stored = 0  # kvmesh blocks stored, all time (for checks against vLLM)

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_blocks(self) -> dict[int, int]:
        """kvmesh hash -> its chain's root, for every block vLLM holds on the device: what a
        sync publishes."""
        return {b.hash: b.root for b in self._blocks.values()}

    def host_blocks(self) -> dict[int, int]:
        """The same for its host tier."""
        return {b.hash: b.root for b in self._host.values()}

    def stored_at(self, kvmesh_hash: int) -> float | None:
        """When this view learned of a block it holds (None: it does not hold it)."""
        key = self._by_hash.get(kvmesh_hash)
        return None if key is None else self._blocks[key].stored_at

    def evicted_at(self, kvmesh_hash: int) -> float | None:
        """When a block this view no longer holds was evicted, if it was lately."""
        return self._evicted_at.get(kvmesh_hash)

    def clear(self) -> None:
        self._blocks.clear()
        self._host.clear()
        self._foreign.clear()
        self._by_hash.clear()
        self._evicted_at.clear()

    def apply(self, events: Iterable[dict[str, Any]]) -> list[KVEvent]:
        """Apply vLLM's events in order; returns the kvmesh events that say the same.
        ``BrokenChain`` when a stored block's parent is unknown (events were lost)."""
        out: list[KVEvent] = []
        for event in events:
            kind = event["type"]
            medium = _MEDIA.get(event.get("medium"))
            if kind != "AllBlocksCleared" and (medium is None or event.get("locality") == "REMOTE"):
                continue  # a tier kvmesh does not index (vLLM's disk tier, another node's)
            if kind == "BlockStored":
                out.extend(self._stored(event) if medium == DEVICE else self._host_stored(event))
            elif kind == "BlockRemoved":
                removed = self._removed(event, medium)
                if removed is not None:
                    out.append(removed)
            else:
                self.clear()
                out.append(AllBlocksCleared())
        return out

    def _stored(self, event: dict[str, Any]) -> list[BlockStored]:
        """One kvmesh event per run of blocks new to the device tier (a copy of a held block
        adds a copy, not a hash)."""
        parent = event.get("parent_block_hash")
        if parent is not None and parent not in self._foreign and parent not in self._blocks:
            raise BrokenChain(f"block {parent!r} was never stored: events were lost")
        out = self._enter(event, self._blocks, DEVICE)
        for stored in out:
            for h in stored.hashes:
                self._evicted_at.pop(h, None)
        self.blocks_stored += sum(len(e.hashes) for e in out)
        return out

    def _host_stored(self, event: dict[str, Any]) -> list[BlockStored]:
        """The same for the host tier, whose blocks may continue a chain held in either tier.
        A placeholder (no tokens: a block shape vLLM does not describe) is left out."""
        if not event.get("block_size") or not event.get("token_ids"):
            return []
        parent = event.get("parent_block_hash")
        if parent is not None and parent not in self._blocks and parent not in self._host:
            return []  # its parent left both tiers (or was never kvmesh's to match)
        return self._enter(event, self._host, HOST)

    def _enter(self, event: dict[str, Any], tier: dict[VllmHash, _Block], medium: str) -> list[BlockStored]:
        keys = list(event.get("block_hashes") or ())
        parent = event.get("parent_block_hash")
        size = event.get("block_size")
        if size != self.block_size:
            raise EventFormatError(
                f"vLLM caches blocks of {size} tokens, the index {self.block_size}: they must agree"
            )
        if parent in self._foreign or _beyond_tokens(event):
            self._foreign.update(keys)
            return []
        if parent is None:
            previous, root = None, None
        else:
            held = self._blocks.get(parent) or self._host[parent]
            previous, root = held.hash, held.root
        tokens = event.get("token_ids") or ()
        if len(tokens) != len(keys) * size:
            raise EventFormatError(f"{len(tokens)} token ids for {len(keys)} blocks of {size}")
        hashes = hash_chain(token_buffer(tokens), size, self.seed if previous is None else previous)
        now = self.clock()
        out: list[BlockStored] = []
        run: list[int] = []
        run_parent = previous
        for key, h in zip(keys, hashes, strict=True):
            root = h if root is None else root
            held = tier.get(key)
            if held is not None:
                tier[key] = _Block(held.hash, held.root, held.copies + 1, held.stored_at)
                if run:
                    out.append(BlockStored(tuple(run), run_parent, size, root, medium))
                    run = []
                run_parent = h
                continue
            tier[key] = _Block(h, root, 1, now)
            if medium == DEVICE:
                self._by_hash[h] = key
            run.append(h)
        if run:
            out.append(BlockStored(tuple(run), run_parent, size, root, medium))
        return out

    def _removed(self, event: dict[str, Any], medium: str) -> BlockRemoved | None:
        """Copies of blocks gone from one tier; a block whose last copy went leaves it."""
        tier = self._blocks if medium == DEVICE else self._host
        hashes: list[int] = []
        roots: list[int] = []
        now = self.clock()
        for key in event.get("block_hashes") or ():
            if medium == DEVICE:
                self._foreign.discard(key)
            held = tier.get(key)
            if held is None:
                continue  # a foreign block or a placeholder's, or a copy already gone
            if held.copies > 1:
                tier[key] = _Block(held.hash, held.root, held.copies - 1, held.stored_at)
                continue
            del tier[key]
            if medium == DEVICE:
                self._by_hash.pop(held.hash, None)
                self._remember_eviction(held.hash, now)
            hashes.append(held.hash)
            roots.append(held.root)
        return BlockRemoved(tuple(hashes), tuple(roots), medium) if hashes else None

    def _remember_eviction(self, kvmesh_hash: int, now: float, keep: int = 4096) -> None:
        """Recent evictions (the router tells an eviction in flight from a lie by them):
        the oldest go first, so this stays small however long the replica runs."""
        self._evicted_at[kvmesh_hash] = now
        if len(self._evicted_at) > keep:
            for old in list(self._evicted_at)[: keep // 2]:
                del self._evicted_at[old]


def _beyond_tokens(event: dict[str, Any]) -> bool:
    """Whether vLLM's hash of these blocks covers more than their tokens."""
    extra = event.get("extra_keys")
    return bool(event.get("lora_id") or event.get("lora_name") or (extra and any(extra)))
