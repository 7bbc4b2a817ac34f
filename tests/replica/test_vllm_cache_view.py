"""vLLM's KV events read into kvmesh's hashes (replica/vllm/cache_view.py), on payloads in
vLLM's wire format (msgpack ``[ts, events, dp_rank]``; the real stream is checked against a
running vLLM in test_vllm_replica.py)."""

from pathlib import Path

import msgpack
import pytest

from kvmesh.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, block_hashes, namespace_seed, replay
from kvmesh.kvcache.events import HOST
from kvmesh.replica.vllm.cache_view import BrokenChain, CacheView, EventFormatError, decode_batch

BS = 4
SEED = namespace_seed("m", BS)


def stored(keys, tokens, parent=None, **extra):
    return {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", **extra}  # fmt: skip


def removed(keys):
    return {"type": "BlockRemoved", "block_hashes": keys, "medium": "GPU"}


def wire(*events):
    """A batch as vLLM's publisher encodes it, decoded as the subscriber decodes it."""
    payload = msgpack.packb([1.5, list(events), 0])
    return decode_batch(msgpack.unpackb(payload, raw=False, strict_map_key=False))


def test_stored_blocks_are_rehashed_by_kvmeshs_chain_across_events():
    view = CacheView(BS, SEED)
    tokens = list(range(100, 124))  # six blocks, stored in two events (a prefill in two chunks)
    first = view.apply(wire(stored([11, 12], tokens[:8])))
    second = view.apply(wire(stored([13, 14, 15, 16], tokens[8:], parent=12)))
    expected = block_hashes(tokens, BS, SEED)
    assert first == [BlockStored(tuple(expected[:2]), None, BS, expected[0])]
    assert second == [BlockStored(tuple(expected[2:]), expected[1], BS, expected[0])]
    assert view.cached_blocks() == dict.fromkeys(expected, expected[0])


def test_a_hash_stays_while_any_copy_of_its_block_does():
    view = CacheView(BS, SEED)
    tokens = list(range(8))
    h = block_hashes(tokens, BS, SEED)
    view.apply(wire(stored([1, 2], tokens)))
    assert view.apply(wire(stored([1, 2], tokens))) == []  # a second copy: nothing new to publish
    assert view.apply(wire(removed([2]))) == []
    assert view.apply(wire(removed([2]))) == [BlockRemoved((h[1],), (h[0],))]
    assert set(view.cached_blocks()) == {h[0]}
    assert view.evicted_at(h[1]) is not None and view.stored_at(h[1]) is None


def test_events_replayed_give_exactly_the_view():
    view = CacheView(BS, SEED)
    a, b = list(range(12)), list(range(50, 58))
    out = []
    for batch in (
        wire(stored([1, 2, 3], a)),
        wire(stored([7, 8], b), removed([3])),
        wire(stored([4], list(range(60, 64)), parent=2)),
    ):
        out += view.apply(batch)
    assert replay(out) == set(view.cached_blocks())
    out += view.apply(wire({"type": "AllBlocksCleared"}))
    assert isinstance(out[-1], AllBlocksCleared) and replay(out) == set() and len(view) == 0


def test_blocks_keyed_beyond_tokens_and_their_descendants_stay_out():
    view = CacheView(BS, SEED)
    assert view.apply(wire(stored([1], list(range(4)), lora_name="adapter", lora_id=3))) == []
    assert view.apply(wire(stored([2], list(range(4, 8)), parent=1))) == []  # a child of a LoRA block
    assert view.apply(wire(stored([3], list(range(4)), extra_keys=[["salt"]]))) == []
    assert len(view) == 0
    assert view.apply(wire(removed([1, 2, 3]))) == []


def test_a_parent_never_stored_is_a_broken_chain():
    view = CacheView(BS, SEED)
    with pytest.raises(BrokenChain, match="never stored"):
        view.apply(wire(stored([5], list(range(4)), parent=99)))


def test_a_block_size_unlike_the_index_is_refused():
    view = CacheView(BS, SEED)
    with pytest.raises(EventFormatError, match="must agree"):
        view.apply(wire({**stored([1], list(range(8))), "block_size": 8}))


def test_older_vllms_tagged_arrays_decode_by_position():
    events = decode_batch(
        [0.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU"], ["BlockRemoved", [1], "GPU"]]]
    )
    assert events[0]["token_ids"] == [1, 2, 3, 4] and events[0]["parent_block_hash"] is None
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}


@pytest.mark.parametrize("payload", [None, 3, [1.0, "x"], [1.0, [{"type": "Nope"}]], [1.0, [42]]])
def test_payloads_that_are_not_event_batches_are_refused(payload):
    with pytest.raises(EventFormatError):
        decode_batch(payload)


RECORDED = Path(__file__).parents[1] / "data" / "vllm_offload_events.msgpack"


def recorded_batches() -> list[list[dict]]:
    """vLLM's batches with a host tier (tests/support/record_vllm_offload_events.py wrote them
    with vLLM's own event classes and encoder)."""
    payloads = msgpack.unpackb(RECORDED.read_bytes())
    return [decode_batch(msgpack.unpackb(p, raw=False, strict_map_key=False)) for p in payloads]


def test_vllms_cpu_events_land_in_the_host_tier_as_recorded():
    view = CacheView(BS, SEED)
    tokens = list(range(100, 116))  # the recording's prompt: vLLM hashes 1-4
    h = block_hashes(tokens, BS, SEED)
    steps = [
        (view.apply(batch), set(view.cached_blocks()), set(view.host_blocks()))
        for batch in recorded_batches()
    ]
    both = set(h)
    # stored on the GPU, offloaded in two chunks: the host tier holds the same kvmesh hashes
    assert steps[0][1:] == (both, set())
    assert steps[1][0] == [
        BlockStored(tuple(h[:2]), None, BS, h[0], HOST),
        BlockStored(tuple(h[2:]), h[1], BS, h[0], HOST),
    ]
    assert steps[1][1:] == (both, both)
    assert steps[2][0] == []  # a chunk announced again: one more copy, nothing new
    assert steps[3][0] == [BlockRemoved((h[3], h[2]), (h[0], h[0]))]  # evicted from the GPU...
    assert steps[3][1:] == (set(h[:2]), both)  # ...kept on the host
    assert steps[4][0] == [] and steps[5][0] == []  # placeholder, disk, remote, orphan: left out
    assert steps[6][0] == [BlockRemoved((h[2], h[3]), (h[0], h[0]), HOST)]
    assert steps[7][0] == [] and steps[7][2] == set(h[:2])  # one copy of two gone
    assert steps[8][0] == [BlockRemoved((h[0], h[1]), (h[0], h[0]), HOST)] and steps[8][2] == set()
    assert steps[9][0] == [BlockStored(tuple(h[:2]), None, BS, h[0], HOST)]  # a GPU copy, a new host block
    assert steps[9][1:] == (set(h[:2]), set(h[:2]))
    assert steps[10] == ([AllBlocksCleared()], set(), set())  # a reset clears both tiers
    for i in range(len(steps)):  # the events say, tier by tier, exactly what the view holds
        upto = [e for out, _, _ in steps[: i + 1] for e in out]
        assert (replay(upto), replay(upto, medium=HOST)) == steps[i][1:]
