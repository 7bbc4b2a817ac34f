"""kvmesh.kvcache: the paged KV block ledger, the hash contract, KV events, and the shared prefix
index that mirrors them in Redis (``kvmesh.kvcache.index.redis``, imported on its own). No torch, no grpc."""

from kvmesh.kvcache.block_manager import BlockManager, KVCacheError, KVCacheStats
from kvmesh.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, replay
from kvmesh.kvcache.fragmentation import FragmentationReport, fragmentation_report
from kvmesh.kvcache.hashing import block_hashes, hash_block, hash_chain, namespace_seed, token_buffer
from kvmesh.kvcache.sequence import Sequence

__all__ = [
    "AllBlocksCleared",
    "BlockManager",
    "BlockRemoved",
    "BlockStored",
    "FragmentationReport",
    "KVCacheError",
    "KVCacheStats",
    "KVEvent",
    "Sequence",
    "block_hashes",
    "fragmentation_report",
    "hash_block",
    "hash_chain",
    "namespace_seed",
    "replay",
    "token_buffer",
]
