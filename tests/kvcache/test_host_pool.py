"""The host tier's ledger: LRU within its slots, one copy per hash, closure under parents."""

import pytest

from kvmesh.kvcache import replay
from kvmesh.kvcache.events import HOST
from kvmesh.kvcache.host_pool import HostBlock, HostPool

SEED = 7


def block(h: int, parent: int = SEED) -> HostBlock:
    return HostBlock(h, parent, h if parent == SEED else 1, bytes([h % 256]) * 4)


def test_a_stored_block_is_found_by_hash_parent_and_tokens_only():
    pool = HostPool(4, 1)
    slot = pool.store(block(1))
    assert pool.find(1, SEED, bytes([1]) * 4) == slot
    assert pool.find(1, 99, bytes([1]) * 4) is None  # another parent: a collision, not a hit
    assert pool.find(1, SEED, bytes([2]) * 4) is None  # other tokens
    assert pool.store(block(1)) is None and pool.stores == 1  # there already: not copied again


def test_the_least_recently_used_block_leaves_first_and_a_restore_counts_as_use():
    pool = HostPool(2, 1)
    a, b = pool.store(block(1)), pool.store(block(2))
    pool.restored(a)  # 1 is now the most recently used
    pool.store(block(3))
    assert pool.cached_hashes() == {1, 3} and pool.evictions == 1
    assert replay(pool.drain_events(), medium=HOST) == {1, 3}
    assert pool.find(3, SEED, bytes([3]) * 4) == b  # 3 took the slot 2 left


def test_a_block_that_leaves_both_tiers_takes_its_host_descendants():
    on_device: set[int] = set()
    pool = HostPool(3, 1, on_device=on_device.__contains__)
    pool.store(block(1))  # a chain 1 <- 2 <- 3, its head stored first (the least recently used)
    pool.store(block(2, parent=1))
    pool.store(block(3, parent=2))
    pool.store(block(9))  # room for 9: 1 goes, and 2 and 3 could never be reached without it
    assert pool.cached_hashes() == {9} and pool.num_used_blocks == 1
    assert replay(pool.drain_events(), medium=HOST) == {9}


def test_a_block_still_on_the_device_keeps_its_host_descendants():
    on_device = {1}
    pool = HostPool(3, 1, on_device=on_device.__contains__)
    for b in (block(1), block(2, parent=1), block(3, parent=2)):
        pool.store(b)
    pool.store(block(9))
    assert pool.cached_hashes() == {2, 3, 9}


def test_room_for_a_block_is_never_made_by_evicting_its_parent():
    pool = HostPool(2, 1)
    pool.store(block(1))  # the least recently used: LRU alone would evict it for 2
    pool.store(block(5))
    pool.store(block(2, parent=1))
    assert pool.cached_hashes() == {1, 2}
    one = HostPool(1, 1)
    one.store(block(1))
    assert one.store(block(2, parent=1)) is None and one.cached_hashes() == {1}  # no room but its parent's
    two = HostPool(2, 1)  # a chain 1 <- 2 whose head is the least recently used: making room for 3
    two.store(block(1))  # evicts 1, which takes 2 with it, and 3 could never be reached
    two.store(block(2, parent=1))
    assert two.store(block(3, parent=2)) is None and two.cached_hashes() == set()


def test_pinned_slots_are_never_evicted():
    pool = HostPool(2, 1)
    a, b = pool.store(block(1)), pool.store(block(2))
    pool.pin([a, b])
    assert pool.store(block(3)) is None and pool.cached_hashes() == {1, 2}
    pool.unpin()
    assert pool.store(block(3)) == a


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="num_blocks"):
        HostPool(0, 16)
