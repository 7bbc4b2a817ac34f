"""The hash contract shared by replicas, router, index and simulator (docs/design.md#the-hash-contract).

A prompt is cut into full blocks of ``block_size`` tokens. Each block's hash is
``xxh3_64(tokens of the block as little-endian uint32, seed=hash of the previous block)``
and the first block is seeded with a namespace seed, so two equal hashes mean "the same
tokens from the very first one, under the same model/block size/salt". A trailing partial
block never gets a hash.

Everything here avoids per-token Python work: the tokens become one ``<u4`` buffer and
the chain walks memoryview slices of it.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

__all__ = [
    "block_hashes",
    "hash_block",
    "hash_chain",
    "namespace_seed",
    "token_buffer",
]

_NAMESPACE_PREFIX = b"kvmesh/v1|"
_UINT32_MAX = 2**32 - 1
_NATIVE_LITTLE = sys.byteorder == "little"
_xxh3_64 = xxhash.xxh3_64_intdigest

if array.array("I").itemsize != 4:  # pragma: no cover - no mainstream platform does this
    raise ImportError("kvmesh needs a 4-byte C unsigned int for token buffers")


def namespace_seed(model_id: str, block_size: int, salt: str = "") -> int:
    """Seed of the hash chain: different models, block sizes or salts never share hashes."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    key = b"|".join((model_id.encode(), str(block_size).encode(), salt.encode()))
    return _xxh3_64(_NAMESPACE_PREFIX + key)


def token_buffer(token_ids: Iterable[int] | np.ndarray) -> memoryview:
    """Token ids as one contiguous little-endian uint32 byte buffer.

    Accepts a list/tuple of ints, a numpy integer array or a protobuf repeated field.
    Raises ``ValueError`` for ids outside ``[0, 2**32)``.
    """
    if isinstance(token_ids, np.ndarray):
        return _numpy_buffer(token_ids)
    if isinstance(token_ids, (bytes, bytearray, memoryview, str)):
        raise ValueError(f"token ids must be a sequence of integers, not {type(token_ids).__name__}")
    try:
        arr = array.array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if not _NATIVE_LITTLE:  # pragma: no cover - big-endian hosts only
        arr.byteswap()
    return memoryview(arr).cast("B")


def _numpy_buffer(token_ids: np.ndarray) -> memoryview:
    if token_ids.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {token_ids.shape}")
    if token_ids.dtype != np.dtype("<u4"):
        if token_ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {token_ids.dtype}")
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > _UINT32_MAX):
            raise ValueError("token ids must be integers in [0, 2**32)")
        token_ids = token_ids.astype("<u4")
    return memoryview(np.ascontiguousarray(token_ids)).cast("B")


def block_hashes(token_ids: Iterable[int] | np.ndarray, block_size: int, seed: int) -> list[int]:
    """Chained hashes of every FULL block of ``token_ids``.

    ``seed`` is the namespace seed for a whole prompt, or the hash of the last block
    already hashed to extend an existing chain (the incremental form the engine uses).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return hash_chain(token_buffer(token_ids), block_size, seed)


def hash_chain(buf: memoryview, block_size: int, seed: int) -> list[int]:
    """``block_hashes`` over a buffer already made by ``token_buffer``."""
    step = block_size * 4
    out: list[int] = []
    h = seed
    for start in range(0, len(buf) - step + 1, step):
        h = _xxh3_64(buf[start : start + step], h)
        out.append(h)
    return out


def hash_block(block_token_ids: Sequence[int] | np.ndarray, parent_hash: int) -> int:
    """Hash of one full block chained onto ``parent_hash`` (the seed for the first block)."""
    return _xxh3_64(token_buffer(block_token_ids), parent_hash)
