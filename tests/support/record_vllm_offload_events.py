"""Writes tests/data/vllm_offload_events.msgpack: KV event batches of a vLLM replica with a host
tier, built from vLLM's own event classes and encoded by its publisher's encoder (msgspec),
in the order its OffloadingConnector emits them with self-describing events on. vLLM cannot
offload on its CPU platform, so the batches are built here rather than captured from a run.

Run with the vLLM venv's Python: ``.venv-vllm/bin/python tests/support/record_vllm_offload_events.py``.
Block size 4; tokens ``A`` (16 tokens, 4 blocks, vLLM hashes 1-4), offloaded in chunks of two
blocks.
"""

import sys
from pathlib import Path

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

A = list(range(100, 116))


def stored(keys, tokens, parent=None, medium="GPU", **fields):
    return BlockStored(keys, parent, tokens, 4, None, medium, None, **fields)


def cpu(keys, tokens, parent=None, **fields):
    """What the connector's tracker sends for a chunk it stored in host memory."""
    return stored(keys, tokens, parent, "CPU", group_idx=0, kv_cache_spec_kind="full_attention", **fields)


BATCHES = [
    # a prefill: four blocks on the GPU, then its two chunks offloaded
    [stored([1, 2, 3, 4], A)],
    [cpu([1, 2], A[:8]), cpu([3, 4], A[8:], parent=2)],
    # another request over the same prefix: its first chunk announced again (one more copy)
    [cpu([1, 2], A[:8])],
    # the GPU evicts the tail while the host keeps it
    [BlockRemoved([4, 3], "GPU")],
    # shapes kvmesh does not index: a placeholder (no tokens), the disk tier, a remote tier
    [
        BlockStored([77], None, [], 0, None, "CPU", None),
        stored([5, 6], A[:8], medium="STORAGE"),
        cpu([8, 9], list(range(200, 208)), locality="REMOTE"),
    ],
    # a chunk whose parent neither tier holds: left out
    [cpu([11, 12], list(range(300, 308)), parent=10)],
    # the host evicts the tail chunk; then the first chunk's two copies, one at a time
    [BlockRemoved([3, 4], "CPU", group_idx=0)],
    [BlockRemoved([1, 2], "CPU", group_idx=0)],
    [BlockRemoved([1, 2], "CPU", group_idx=0)],
    # stored again on both tiers, then a reset clears both
    [stored([1, 2], A[:8]), cpu([1, 2], A[:8])],
    [AllBlocksCleared()],
]


def main(out: Path) -> None:
    encode = msgspec.msgpack.Encoder().encode
    payloads = [encode(KVEventBatch(ts=1.0 + i, events=batch)) for i, batch in enumerate(BATCHES)]
    out.write_bytes(msgspec.msgpack.encode(payloads))
    print(f"wrote {len(payloads)} batches to {out}")


if __name__ == "__main__":
    main(
        Path(sys.argv[1])
        if len(sys.argv) > 1
        else Path(__file__).parents[1] / "data" / "vllm_offload_events.msgpack"
    )
