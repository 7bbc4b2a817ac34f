"""Hash contract (docs/design.md#the-hash-contract): published vectors, input forms, chaining, bad input."""

import array
import struct

import numpy as np
import pytest
import xxhash
from google.protobuf import descriptor_pb2
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.kvcache import block_hashes, hash_block, namespace_seed, token_buffer

# Published test vectors: any other implementation of the contract must reproduce these.
VECTORS = [
    # (model_id, block_size, salt, seed)
    ("Qwen/Qwen3-0.6B", 16, "", 7446695430754085964),
    ("tiny", 256, "lora-a", 2999107924050635830),
]
QWEN_SEED = 7446695430754085964
CHAIN_VECTORS = [
    # (token_ids, block_size, seed, hashes)
    (list(range(40)), 16, QWEN_SEED, [584285806327601887, 11315251758938840836]),
    ([0, 1, 2**32 - 1, 7], 2, 0, [17197929579947543131, 5307357369026403380]),
]


@pytest.mark.parametrize(("model_id", "block_size", "salt", "seed"), VECTORS)
def test_namespace_seed_vectors(model_id, block_size, salt, seed):
    assert namespace_seed(model_id, block_size, salt) == seed
    by_hand = xxhash.xxh3_64(f"kvmesh/v1|{model_id}|{block_size}|{salt}".encode()).intdigest()
    assert by_hand == seed


@pytest.mark.parametrize(("tokens", "block_size", "seed", "hashes"), CHAIN_VECTORS)
def test_block_hashes_vectors(tokens, block_size, seed, hashes):
    assert block_hashes(tokens, block_size, seed) == hashes
    # The contract spelled out: little-endian uint32 bytes, each block seeded by the previous.
    h, by_hand = seed, []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        h = xxhash.xxh3_64(struct.pack(f"<{block_size}I", *block), seed=h).intdigest()
        by_hand.append(h)
    assert by_hand == hashes


def test_only_full_blocks_get_a_hash():
    seed = namespace_seed("m", 4)
    assert block_hashes([1, 2, 3], 4, seed) == []
    assert len(block_hashes(list(range(11)), 4, seed)) == 2
    assert block_hashes(list(range(11)), 4, seed) == block_hashes(list(range(8)), 4, seed)


def test_namespaces_never_share_hashes():
    tokens = list(range(64))
    seeds = {
        namespace_seed("model-a", 16),
        namespace_seed("model-b", 16),
        namespace_seed("model-a", 32),
        namespace_seed("model-a", 16, salt="adapter-1"),
    }
    assert len(seeds) == 4
    first_blocks = {block_hashes(tokens, 16, s)[0] for s in seeds}
    assert len(first_blocks) == 4


def test_chain_depends_on_every_earlier_token():
    seed = namespace_seed("m", 4)
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, seed)
    b = block_hashes([1, 2, 3, 9, 5, 6, 7, 8], 4, seed)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix


@pytest.mark.parametrize(
    "make",
    [
        list,
        tuple,
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=">u4"),  # big-endian input is converted, not misread
        lambda t: np.array(t, dtype=np.int32)[::1],
        lambda t: np.array(t, dtype=np.uint32).repeat(2)[::2],  # non-contiguous view
        lambda t: array.array("I", t),
        lambda t: descriptor_pb2.SourceCodeInfo.Location(path=t).path,  # protobuf repeated field
    ],
    ids=[
        "list",
        "tuple",
        "np-int64",
        "np-uint32",
        "np-big-endian",
        "np-int32",
        "np-strided",
        "array",
        "protobuf",
    ],
)
def test_every_input_form_hashes_the_same(make):
    tokens = [(i * 7919) % 151_000 for i in range(1000)]
    seed = namespace_seed("m", 16)
    assert block_hashes(make(tokens), 16, seed) == block_hashes(tokens, 16, seed)


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.integers(1, 32),
    split=st.integers(0, 10),
)
def test_incremental_chain_equals_whole(tokens, block_size, split):
    seed = 12345
    whole = block_hashes(tokens, block_size, seed)
    k = min(split, len(whole))
    head = block_hashes(tokens[: k * block_size], block_size, seed)
    tail = block_hashes(tokens[k * block_size :], block_size, head[-1] if head else seed)
    assert head + tail == whole
    h, stepwise = seed, []
    for i in range(len(whole)):
        h = hash_block(tokens[i * block_size : (i + 1) * block_size], h)
        stepwise.append(h)
    assert stepwise == whole


@pytest.mark.parametrize(
    "bad",
    [
        [1, -1],
        [2**32],
        [1.5],
        np.array([1, -3]),
        np.array([2**33]),
        np.array([1.0, 2.0]),
        np.zeros((2, 2), dtype=np.uint32),
        b"\x01\x00\x00\x00",
        "abc",
    ],
    ids=["negative", "too-big", "float", "np-negative", "np-too-big", "np-float", "2d", "bytes", "str"],
)
def test_bad_token_ids_raise_value_error(bad):
    with pytest.raises(ValueError, match="token ids"):
        block_hashes(bad, 4, 0)


def test_non_positive_block_size_raises():
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2, 3], 0, 0)
    with pytest.raises(ValueError, match="block_size"):
        namespace_seed("m", -16)


def test_token_buffer_is_little_endian_uint32():
    assert bytes(token_buffer([1, 256])) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
