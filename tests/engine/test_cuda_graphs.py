"""Decode graphs: the bucketing, the padding rows (no KV slot written, nothing sampled), the
static buffers' refills, and replay equivalence. Without a GPU the replays go through
``EagerReplay``, which runs the captured forward again on the same static buffers, and the
engine runs Triton's kernels in Triton's interpreter; on a GPU (`make gpu-check`) the same
tests run on the graphs the engine captured at start."""

import pytest
import torch

from kvmesh.engine import LLMEngine, SamplingParams
from kvmesh.engine.cuda_graphs import EagerReplay, graph_buckets

OPTIONS = dict(
    num_kv_blocks=48,
    block_size=16,
    max_num_seqs=6,
    max_num_batched_tokens=64,
    attention_backend="triton",
    dtype="float32",
)


def test_buckets_are_nano_vllms_and_a_batch_takes_the_smallest_that_holds_it():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(1) == [1]


@pytest.fixture(scope="module")
def graphed(qwen3_dir):
    engine = LLMEngine(qwen3_dir, **OPTIONS)  # on CUDA it captures its graphs itself
    report = engine.runner.graph_capture or engine.runner.capture_decode_graphs(EagerReplay())
    assert report.buckets == [1, 2, 4, 6] and engine.runner.graphs.bucket(3) == 4
    assert engine.runner.graphs.bucket(7) is None
    return engine


@pytest.mark.slow
def test_replayed_decode_gives_the_eager_engines_tokens(graphed, qwen3_dir):
    """Three requests of different lengths: the batch shrinks 3 -> 2 -> 1 as they end, each
    step in a bucket with padding rows, and the tokens are the eager engine's."""
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([5, 19, 33])]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9)]
    expected = [
        o.token_ids
        for o in LLMEngine(qwen3_dir, **{**OPTIONS, "attention_backend": "torch"}).generate(prompts, params)
    ]
    before = graphed.runner.graphs.replays
    assert [o.token_ids for o in graphed.generate(prompts, params)] == expected
    assert graphed.runner.graphs.replays - before == 8  # every decode step replayed: 9 tokens, 1 from prefill
    assert graphed.stats().graph_replays == graphed.runner.graphs.replays


@torch.inference_mode()  # as the engine steps
def test_padding_rows_write_no_live_slot_and_buffers_are_refilled(graphed):
    runner, graphs = graphed.runner, graphed.runner.graphs
    kv_before = runner.kv_cache.clone()
    hidden = graphs.run(
        [5, 6, 7, 8], [3, 20, 0, 9], [[1], [2, 3], [4], [5]], [1 * 16 + 3, 3 * 16 + 4, 4 * 16, 5 * 16 + 9]
    )
    assert hidden.shape[0] == 4
    hidden = graphs.run([9, 10, 11], [4, 21, 1], [[1], [2, 3], [4]], [1 * 16 + 4, 3 * 16 + 5, 4 * 16 + 1])
    assert hidden.shape[0] == 3  # bucket 4: one padding row, whose output nobody reads
    # The previous step's fourth row is gone from every buffer: it is padding now.
    assert graphs.slots[:4].tolist() == [20, 53, 65, -1]
    assert graphs.context_lens[:4].tolist() == [5, 22, 2, 1]
    assert graphs.token_ids[:4].tolist() == [9, 10, 11, 0] and graphs.block_tables[3, 0] == 0
    changed = (runner.kv_cache != kv_before).flatten(4).any(-1)  # [2, layers, blocks, block_size]
    written = {(int(b), int(o)) for b, o in changed.any(0).any(0).nonzero()}
    assert written == {(1, 3), (3, 4), (4, 0), (5, 9), (1, 4), (3, 5), (4, 1)}  # the real rows' slots only


@torch.inference_mode()
def test_the_replayed_rows_equal_an_eager_forward(graphed):
    runner, graphs = graphed.runner, graphed.runner.graphs
    args = ([5, 6], [3, 20], [[1], [2, 3]], [1 * 16 + 3, 3 * 16 + 4])
    replayed = graphs.run(*args).clone()
    graphs_off, runner.graphs = runner.graphs, None
    try:
        eager = runner._forward_layout([[5], [6]], [3, 20], args[2], [[0], [0]])
    finally:
        runner.graphs = graphs_off
    torch.testing.assert_close(runner.model.compute_logits(replayed), eager, rtol=1e-5, atol=1e-5)
