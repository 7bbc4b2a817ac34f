"""Random operation sequences against the BlockManager's invariants and a plain oracle.

Two machines share the invariant checks:
  - ``ChunkedLedger`` drives chunked prefill, decode, preemption, abort and reset;
  - ``LedgerVsArticle`` runs the article's algorithm (the benchmark's reference ledger)
    in lockstep and demands the same hits, admissions and free counts. It adds kvmesh's one
    deliberate difference to the article: a block whose parent hash is evicted stops being
    hittable too (the article keeps such orphans and can revive them when the parent is
    computed again; a shared index finds a replica's depth by bisection, which needs what is
    hittable closed under parents).
After every step: ref counts equal the number of block tables holding each block, free and
used blocks partition the pool, no block appears twice in a table, replaying every KV
event gives ``cached_hashes()``, every cached block's chain is cached up to it with the root
the ledger names (what the shared index's lookup relies on), and every reused block holds exactly the KV of the
reusing sequence's prefix (tracked by a shadow of what each block was computed for).
"""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmesh.bench.reference_ledger import ReferenceBlockManager
from kvmesh.kvcache import BlockManager, Sequence, block_hashes, replay
from kvmesh.kvcache.block_manager import OFFLOAD
from kvmesh.kvcache.events import HOST
from kvmesh.kvcache.host_pool import HostPool

# Small vocabulary and a few shared chunks: lots of sharing, duplicates and equal blocks
# at different positions, which is where ledgers go wrong.
CHUNKS = [[0, 1, 2, 3, 0, 1], [0, 1], [2, 2, 2], [3], [1, 0, 3, 2, 1]]
prompts = st.lists(st.sampled_from(range(len(CHUNKS))), min_size=1, max_size=5).map(
    lambda ids: [t for i in ids for t in CHUNKS[i]]
)


class PrefixClosedReference(ReferenceBlockManager):
    """The article's ledger, keeping what is hittable closed under parents (as kvmesh does)."""

    def _take_free_block(self):
        evicted = self.blocks[self.free_block_ids[0]]
        if evicted.hash != -1 and self.hash_to_block_id.get(evicted.hash) == evicted.block_id:
            self._forget_descendants(evicted.hash)
        return super()._take_free_block()

    def _forget_descendants(self, h: int) -> None:
        gone = [h]
        while gone:
            parent = gone.pop()
            for child in self.blocks:
                if child.parent == parent and self.hash_to_block_id.get(child.hash) == child.block_id:
                    del self.hash_to_block_id[child.hash]
                    gone.append(child.hash)

    def _register(self, block, h, token_ids, parent):
        if parent == -1 or parent in self.hash_to_block_id:
            super()._register(block, h, token_ids, parent)
        else:  # not hittable (its parent is not), but still its chain's link: the next block
            # hashes on it (left at -1, the next block would be hashed as a first block, and a
            # later prompt starting with the same tokens would "hit" KV of another position)
            block.hash, block.parent, block.token_ids = h, parent, token_ids


class LedgerMachine(RuleBasedStateMachine):
    """Shared state and invariants; subclasses add the rules."""

    def setup(self, num_blocks: int, block_size: int, host_blocks: int = 0) -> None:
        host = HostPool(host_blocks, block_size) if host_blocks else None
        self.bm = BlockManager(num_blocks, block_size, seed=7, host=host)
        self.live: list[Sequence] = []
        self.events = []
        self.written: dict[int, tuple[int, ...]] = {}  # block -> prefix its KV was computed for
        self.host_written: dict[int, tuple[int, ...]] = {}  # host slot -> prefix of the KV copied there

    def move_kv(self) -> None:
        """Run the copies the ledger asked for, in order, as the engine does before a step."""
        for t in self.bm.drain_transfers():
            if t.kind == OFFLOAD:
                self.host_written[t.slot] = self.written[t.block]
            else:
                self.written[t.block] = self.host_written[t.slot]

    def admit(self, tokens: list[int]) -> Sequence | None:
        seq = Sequence(tokens, self.bm.block_size)
        n = self.bm.can_allocate(seq)
        if n < 0:
            return None
        self.bm.allocate(seq, n)
        self.move_kv()
        self.check_reuse(seq, n)
        self.live.append(seq)
        return seq

    def check_reuse(self, seq: Sequence, n: int) -> None:
        bs = self.bm.block_size
        for i in range(n):
            prefix = tuple(seq.token_ids[: (i + 1) * bs])
            assert self.written[seq.block_table[i]] == prefix, "reused a block computed for another prefix"

    def compute(self, seq: Sequence, upto: int) -> None:
        self.move_kv()  # a may_append's evictions leave before the step writes
        bs = self.bm.block_size
        seq.num_computed_tokens = upto
        for i in range(upto // bs):
            if i >= seq.num_hashed_blocks:
                self.written[seq.block_table[i]] = tuple(seq.token_ids[: (i + 1) * bs])
        self.bm.hash_blocks(seq)

    @invariant()
    def ledger_checks_itself(self):
        if hasattr(self, "bm"):
            self.bm.check_invariants()

    @invariant()
    def ref_counts_and_partition(self):
        if not hasattr(self, "bm"):
            return
        holders = Counter(b for s in self.live for b in s.block_table)
        for s in self.live:
            assert len(set(s.block_table)) == len(s.block_table), "block twice in one table"
            assert len(s.block_table) == s.num_blocks
        used = {b for b in range(self.bm.num_blocks) if self.bm.ref_count(b) > 0}
        assert used == set(holders)
        assert all(self.bm.ref_count(b) == n for b, n in holders.items())
        assert self.bm.num_used_blocks == len(used)
        assert self.bm.num_free_blocks == self.bm.num_blocks - len(used)

    @invariant()
    def events_replay_to_cached_hashes(self):
        if not hasattr(self, "bm"):
            return
        self.events += self.bm.drain_events()
        assert replay(self.events) == self.bm.cached_hashes()
        stats = self.bm.stats()
        cached_free = sum(
            1
            for b in range(self.bm.num_blocks)
            if self.bm.ref_count(b) == 0 and self.bm.block_hash(b) is not None
        )
        assert stats.num_cached_free_blocks == cached_free

    @invariant()
    def cached_chains_are_prefix_closed(self):
        """The index finds a replica's depth by bisection, which needs every cached block's
        parents cached too (a chain is evicted tail first), and places a block by its root."""
        if not hasattr(self, "bm"):
            return
        cached = self.bm.cached_blocks()
        for b in range(self.bm.num_blocks):
            h = self.bm.block_hash(b)
            if h is None:
                continue
            chain = block_hashes(list(self.written[b]), self.bm.block_size, 7)
            assert chain[-1] == h
            assert set(chain) <= cached.keys(), "a cached block whose parent was evicted"
            assert cached[h] == chain[0], "a block's root is not its chain's first hash"

    @invariant()
    def the_host_tier_holds_what_its_events_say_and_the_kv_of_its_hashes(self):
        host = getattr(self, "bm", None) and self.bm.host
        if host is None:
            return
        assert replay(self.events, medium=HOST) == host.cached_hashes()
        assert host.num_used_blocks <= host.num_blocks
        device = self.bm.cached_hashes()
        for block in host._slots:  # both tiers together stay closed under parents
            if block is not None:
                assert block.parent == 7 or block.parent in device or host.find_any(block.parent) is not None
        self.move_kv()
        for h, _root in host.cached_blocks().items():
            slot = host._table[h]
            assert block_hashes(list(self.host_written[slot]), self.bm.block_size, 7)[-1] == h


class ChunkedLedger(LedgerMachine):
    @initialize(num_blocks=st.integers(1, 20), block_size=st.integers(1, 4))
    def init(self, num_blocks, block_size):
        self.setup(num_blocks, block_size)

    @rule(tokens=prompts)
    def add(self, tokens):
        self.admit(tokens)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 7))
    def prefill_chunk(self, pick, chunk):
        seq = self.live[pick % len(self.live)]
        self.compute(seq, min(len(seq), seq.num_computed_tokens + chunk))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), token=st.integers(0, 3))
    def decode(self, pick, token):
        seq = self.live[pick % len(self.live)]
        if seq.num_computed_tokens < len(seq):
            return  # still prefilling
        seq.append_token(token)
        if self.bm.can_append(seq):
            self.bm.may_append(seq)
            self.compute(seq, len(seq))
        else:  # preempt by recompute: free everything, come back later from scratch
            self.bm.deallocate(seq)
            self.live.remove(seq)
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            if (again := self.admit(seq.token_ids)) is not None:
                self.compute(again, len(again))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def finish_or_abort(self, pick):
        self.bm.deallocate(self.live.pop(pick % len(self.live)))

    @precondition(lambda self: not self.live)
    @rule()
    def reset(self):
        self.bm.reset()
        self.written.clear()
        self.host_written.clear()


class TieredLedger(ChunkedLedger):
    """The same histories with a host tier: blocks leaving the device land in the host pool
    and come back from it, and every block a prefix reuses, from either tier, holds the KV of
    exactly that prefix."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), host_blocks=st.integers(1, 12))
    def init(self, num_blocks, block_size, host_blocks):
        self.setup(num_blocks, block_size, host_blocks)
        self.seen: list[list[int]] = []

    @rule(tokens=prompts)
    def add(self, tokens):
        self.seen.append(tokens)
        if (seq := self.admit(tokens)) is not None:
            self.compute(seq, len(seq))

    @precondition(lambda self: self.seen)
    @rule(pick=st.integers(0, 99))
    def again(self, pick):
        """A prompt seen before comes back: its prefix, evicted from the device meanwhile, is
        in the host tier (a restore), or still on the device."""
        if (seq := self.admit(self.seen[pick % len(self.seen)])) is not None:
            self.compute(seq, len(seq))


class LedgerVsArticle(LedgerMachine):
    """Whole-prompt prefill (what the article's eager hashing assumes), in lockstep.

    Block size 1 is left out: the article's ``len % block_size == 1`` append rule never
    fires there (kvmesh's ledger counts missing blocks instead, covered above).
    """

    @initialize(num_blocks=st.integers(1, 20), block_size=st.integers(2, 4))
    def init(self, num_blocks, block_size):
        self.setup(num_blocks, block_size)
        self.ref = PrefixClosedReference(num_blocks, block_size)
        self.ref_live: list[Sequence] = []

    @rule(tokens=prompts)
    def add(self, tokens):
        ref_seq = Sequence(tokens, self.bm.block_size)
        ref_n = self.ref.can_allocate(ref_seq)
        seq = self.admit(tokens)
        assert (seq is None) == (ref_n < 0)
        if seq is None:
            return
        self.ref.allocate(ref_seq, ref_n)
        self.ref_live.append(ref_seq)
        assert seq.num_cached_tokens == ref_seq.num_cached_tokens
        self.compute(seq, len(seq))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), token=st.integers(0, 3))
    def decode(self, pick, token):
        i = pick % len(self.live)
        seq, ref_seq = self.live[i], self.ref_live[i]
        seq.append_token(token)
        ref_seq.append_token(token)
        assert self.bm.can_append(seq) == self.ref.can_append(ref_seq)
        if self.bm.can_append(seq):
            self.bm.may_append(seq)
            self.ref.may_append(ref_seq)
            self.compute(seq, len(seq))
        else:
            self.bm.deallocate(self.live.pop(i))
            self.ref.deallocate(self.ref_live.pop(i))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def finish(self, pick):
        i = pick % len(self.live)
        self.bm.deallocate(self.live.pop(i))
        self.ref.deallocate(self.ref_live.pop(i))

    @invariant()
    def same_pool_as_article(self):
        if hasattr(self, "ref"):
            assert self.bm.num_free_blocks == len(self.ref.free_block_ids)


settings_ = settings(max_examples=150, stateful_step_count=40, deadline=None)
pytestmark = pytest.mark.slow  # hundreds of generated histories: seconds (make test runs them)
TestChunkedLedger = ChunkedLedger.TestCase
TestChunkedLedger.settings = settings_
TestLedgerVsArticle = LedgerVsArticle.TestCase
TestLedgerVsArticle.settings = settings_
TestTieredLedger = TieredLedger.TestCase
TestTieredLedger.settings = settings_
