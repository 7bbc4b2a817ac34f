"""BlockManager: the nano-vllm article's worked examples, events, counters and misuse."""

import pytest

from kvmesh.kvcache import (
    AllBlocksCleared,
    BlockManager,
    BlockRemoved,
    BlockStored,
    KVCacheError,
    Sequence,
    block_hashes,
    fragmentation_report,
    namespace_seed,
    replay,
)

SEED = namespace_seed("test-model", 4)


def admit(bm: BlockManager, tokens, block_size=None) -> Sequence:
    """Allocate a sequence and compute its whole prompt, as one engine prefill would."""
    seq = Sequence(tokens, block_size or bm.block_size)
    n = bm.can_allocate(seq)
    assert n >= 0, "test setup: sequence does not fit"
    bm.allocate(seq, n)
    seq.num_computed_tokens = len(seq)
    bm.hash_blocks(seq)
    return seq


def decode(bm: BlockManager, seq: Sequence, token: int) -> None:
    seq.append_token(token)
    bm.may_append(seq)
    seq.num_computed_tokens = len(seq)
    bm.hash_blocks(seq)


L0, L1, L2 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def test_article_example_in_use_hit_freed_hit_and_fresh_last_block():
    bm = BlockManager(16, 4, seed=SEED)
    a = admit(bm, L0 + L1 + L2)
    b = admit(bm, L0 + [99, 98])  # shares L0 with a, keeps it in use
    l0_block, l1_block, l2_block = a.block_table
    assert b.block_table[0] == l0_block and b.num_cached_tokens == 4
    bm.deallocate(a)  # L1, L2 become free but stay hittable; L0 is still held by b
    assert bm.ref_count(l0_block) == 1 and bm.ref_count(l1_block) == 0
    free_before = bm.num_free_blocks

    c = Sequence(L0 + L1 + L2, 4)
    assert bm.can_allocate(c) == 2  # the last block (L2) is never looked up
    bm.allocate(c, 2)
    assert c.num_cached_tokens == 8
    assert c.block_table[0] == l0_block and bm.ref_count(l0_block) == 2  # in-use hit
    assert c.block_table[1] == l1_block and bm.ref_count(l1_block) == 1  # freed-block hit
    assert c.block_table[2] != l2_block  # fresh
    assert bm.num_free_blocks == free_before - 2


def test_article_example_600_token_shared_prefix_reuses_512_tokens():
    bm = BlockManager(32, 256, seed=namespace_seed("m", 256))
    prefix = list(range(1000, 1600))
    admit(bm, prefix + [1] * 200)
    b = Sequence(prefix + [2] * 300, 256)
    n = bm.can_allocate(b)
    bm.allocate(b, n)
    assert n == 2 and b.num_cached_tokens == 512


def test_article_example_preempted_sequence_rehits_its_own_blocks():
    bm = BlockManager(16, 4, seed=SEED)
    seq = admit(bm, L0 + L1 + [13, 14])
    for t in range(20, 23):  # decode 3 tokens: 13 tokens in, 3 full blocks
        decode(bm, seq, t)
    table = list(seq.block_table)
    bm.deallocate(seq)  # preempted: blocks go back, hashes stay
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    n = bm.can_allocate(seq)
    assert n == (len(seq) - 1) // 4 == 3
    bm.allocate(seq, n)
    assert seq.block_table[:3] == table[:3]
    assert seq.num_cached_tokens == 12


def test_forced_hash_collision_never_reuses_the_wrong_block(monkeypatch):
    # Fault injection: every block of every chain hashes to the same value.
    from kvmesh.kvcache import block_manager

    monkeypatch.setattr(block_manager, "hash_chain", lambda buf, bs, parent: [42] * (len(buf) // (4 * bs)))
    bm = BlockManager(16, 4, seed=SEED)
    a = admit(bm, L0 + L1 + L2)
    assert bm.cached_hashes() == {42}  # only the first block could be entered

    other = Sequence(L1 + L0 + L2, 4)  # different first block, same (forced) hash
    assert bm.can_allocate(other) == 0
    repeated = Sequence(L0 + L0 + L0 + [7], 4)  # L0 again at position 1: same tokens, other prefix
    assert bm.can_allocate(repeated) == 1
    bm.allocate(repeated, 1)
    assert repeated.block_table[0] == a.block_table[0]
    assert repeated.block_table[1] not in a.block_table
    repeated.num_computed_tokens = len(repeated)
    bm.hash_blocks(repeated)
    assert repeated.hash_collided and bm.cached_hashes() == {42}


def test_events_mirror_cached_hashes_store_remove_and_duplicates():
    bm = BlockManager(4, 4, seed=SEED)
    a = admit(bm, L0 + L1 + [50])
    h0, h1 = block_hashes(L0 + L1, 4, SEED)
    assert bm.drain_events() == [BlockStored((h0, h1), None, 4, h0)]

    dup = admit(bm, L0 + L1)  # L1 is its last block: computed again, same hash -> no event
    assert dup.num_cached_tokens == 4
    assert bm.drain_events() == []
    assert bm.cached_hashes() == {h0, h1}

    bm.deallocate(dup)  # free list, oldest first: dup's L1 copy, a's tail, a's old L1, L0
    bm.deallocate(a)
    fresh = admit(bm, [60, 61, 62])
    assert bm.drain_events() == [BlockRemoved((h1,), (h0,))]  # the one holder of L1 was overwritten
    fresh2 = admit(bm, [70, 71, 72])
    assert bm.drain_events() == []  # a's partial block never had a hash
    assert bm.cached_hashes() == {h0}
    bm.deallocate(fresh)
    bm.deallocate(fresh2)
    bm.reset()
    assert bm.drain_events() == [AllBlocksCleared()] and bm.cached_hashes() == set()


def test_event_replay_equals_cached_hashes_through_churn():
    bm = BlockManager(8, 4, seed=SEED)
    log = []
    for i in range(30):
        seq = admit(bm, [i % 5] * 4 + [i % 3] * 4 + [i])
        log += bm.drain_events()
        assert replay(log) == bm.cached_hashes()
        bm.deallocate(seq)


def test_stored_event_names_parent_of_an_extended_chain():
    bm = BlockManager(8, 4, seed=SEED)
    seq = admit(bm, L0 + [5, 6])
    bm.drain_events()
    decode(bm, seq, 7)
    decode(bm, seq, 8)  # second block full now
    h0, h1 = block_hashes(L0 + [5, 6, 7, 8], 4, SEED)
    assert bm.drain_events() == [BlockStored((h1,), h0, 4, h0)]  # its root: the chain's first


def test_reverse_order_free_evicts_the_tail_first():
    bm = BlockManager(4, 4, seed=SEED)
    a = admit(bm, L0 + L1 + L2 + [0])
    bm.deallocate(a)
    bm.drain_events()
    admit(bm, [30, 31])  # takes the oldest free block: a's partial last block (freed first)
    admit(bm, [40, 41])  # next: L2's block (tail before head)
    h0, _, h2 = block_hashes(L0 + L1 + L2, 4, SEED)
    assert bm.drain_events() == [BlockRemoved((h2,), (h0,))]
    assert bm.cached_hashes() == set(block_hashes(L0 + L1, 4, SEED))


def test_stats_counters():
    bm = BlockManager(10, 4, seed=SEED)
    a = admit(bm, L0 + L1 + [1])
    b = admit(bm, L0 + L1 + [2])
    s = bm.stats()
    assert (s.num_used_blocks, s.num_free_blocks, s.num_cached_free_blocks) == (4, 6, 0)
    assert s.prefix_query_tokens == 18 and s.prefix_hit_tokens == 8
    assert s.prefix_hit_rate == pytest.approx(8 / 18)
    bm.deallocate(a)
    bm.deallocate(b)
    s = bm.stats()
    assert (s.num_used_blocks, s.num_cached_free_blocks, s.num_cached_hashes) == (0, 2, 2)
    for i in range(3):  # 9 fresh blocks out of 10: only the least recently freed (L1) is evicted
        admit(bm, [100 + i] * 9)
    s = bm.stats()
    assert s.evictions == 1 and s.num_cached_hashes == 1 + 3 * 2


def test_nanollmserve_fragmentation_example():
    lengths = [9, 17, 33, 5, 41, 12]
    report = fragmentation_report(lengths, 16)
    assert (report.allocated_tokens, report.reserved_tokens, report.fragmented_tokens) == (117, 176, 59)
    assert report.utilization == pytest.approx(0.6648, abs=1e-4)
    assert report.fixed_slot_tokens == 246

    bm = BlockManager(64, 16)
    for n, start in zip(lengths, range(0, 6000, 1000), strict=True):
        admit(bm, range(start, start + n))
    assert bm.fragmentation() == report


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(16, 0)
    with pytest.raises(ValueError, match="block_size"):
        Sequence([1, 2], 0)
    with pytest.raises(ValueError, match="at least one token"):
        Sequence([], 4)
    with pytest.raises(ValueError, match="block_size"):
        fragmentation_report([1], -1)


def test_misuse_fails_loudly():
    bm = BlockManager(2, 4, seed=SEED)
    seq = admit(bm, [1, 2, 3])
    with pytest.raises(KVCacheError, match="already has a block table"):
        bm.allocate(seq, 0)
    with pytest.raises(KVCacheError, match="already has a block table"):
        bm.can_allocate(seq)
    with pytest.raises(KVCacheError, match="cannot reset"):
        bm.reset()
    big = Sequence(range(100, 112), 4)
    assert bm.can_allocate(big) == -1
    with pytest.raises(KVCacheError, match="free blocks"):
        bm.allocate(big, 0)
    bm.deallocate(seq)
    with pytest.raises(KVCacheError, match="freed twice"):
        bm.deallocate(seq)
    with pytest.raises(KVCacheError, match="allocate it first"):
        bm.may_append(seq)


def test_appending_without_a_free_block_raises():
    bm = BlockManager(2, 4, seed=SEED)
    seq = admit(bm, range(8))  # both blocks used
    seq.append_token(9)  # len % block_size == 1: needs a new block
    assert not bm.can_append(seq)
    with pytest.raises(KVCacheError, match="none are free"):
        bm.may_append(seq)


def test_allocate_rejects_more_cached_blocks_than_match():
    bm = BlockManager(8, 4, seed=SEED)
    admit(bm, L0 + L1 + [1])
    seq = Sequence(L0 + [9, 9, 9, 9, 9], 4)
    assert bm.can_allocate(seq) == 1
    with pytest.raises(KVCacheError, match="only 1 match"):
        bm.allocate(seq, 2)
    bm.allocate(seq, 0)  # fewer than the match is allowed (a caller may decline hits)
    assert seq.num_cached_tokens == 0


def test_allocate_rechecks_after_the_ledger_changed():
    bm = BlockManager(3, 4, seed=SEED)
    a = admit(bm, L0 + [1])
    seq = Sequence(L0 + [2], 4)
    assert bm.can_allocate(seq) == 1
    bm.deallocate(a)
    admit(bm, [7] * 9)  # evicts L0's block between can_allocate and allocate
    with pytest.raises(KVCacheError, match="only 0 match"):
        bm.allocate(seq, 1)


def test_chunked_prefill_hashes_blocks_as_they_are_computed():
    bm = BlockManager(8, 4, seed=SEED)
    seq = Sequence(L0 + L1 + L2 + [1], 4)
    bm.allocate(seq, bm.can_allocate(seq))
    seq.num_computed_tokens = 6  # first chunk: one full block done
    bm.hash_blocks(seq)
    h = block_hashes(L0 + L1 + L2, 4, SEED)
    assert bm.cached_hashes() == {h[0]}
    seq.num_computed_tokens = 13
    bm.hash_blocks(seq)
    assert bm.cached_hashes() == set(h)
    assert [e.hashes for e in bm.drain_events()] == [(h[0],), (h[1], h[2])]


def test_sequence_views():
    seq = Sequence([1, 2, 3, 4, 5], 2)
    assert (seq.num_blocks, seq.num_full_blocks, seq.last_block_num_tokens) == (3, 2, 1)
    assert seq.block(2) == [5]
    seq.append_token(6)
    assert seq.prompt_token_ids == [1, 2, 3, 4, 5] and seq.completion_token_ids == [6]
    assert seq.num_completion_tokens == 1 and seq.last_token == 6
    with pytest.raises(IndexError):
        seq.block(3)


def _busy_ledger() -> tuple[BlockManager, Sequence]:
    bm = BlockManager(8, 2, seed=1)
    seq = Sequence([1, 2, 3, 4, 5], 2)
    bm.allocate(seq, bm.can_allocate(seq))
    seq.num_computed_tokens = 5
    bm.hash_blocks(seq)
    other = Sequence([9, 9, 9], 2)
    bm.allocate(other, bm.can_allocate(other))
    other.num_computed_tokens = 3
    bm.hash_blocks(other)
    bm.deallocate(other)  # its hashed block stays cached while free
    bm.check_invariants()
    return bm, seq


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda bm, seq: bm._ref.__setitem__(seq.block_table[0], 2), "ref count 2 but 1 block tables"),
        (lambda bm, seq: bm._free.pop(next(iter(bm._free))), "differs from the unreferenced blocks"),
        (lambda bm, seq: bm._table.__setitem__(next(iter(bm._table)), 7), "table maps hash"),
        (lambda bm, seq: bm._hash.__setitem__(7, 12345), "block 7 holds hash 12345"),
        (lambda bm, seq: setattr(bm, "_num_cached_free", 0), "cached-free count is 0"),
    ],
    ids=["ref-count", "free-list", "table-to-block", "block-to-table", "cached-free"],
)
def test_check_invariants_names_what_is_broken(corrupt, message):
    """Fault injection into the ledger's state: every invariant is checked, and named."""
    bm, seq = _busy_ledger()
    corrupt(bm, seq)
    with pytest.raises(KVCacheError, match=message):
        bm.check_invariants()
