"""Engine behaviour beyond greedy parity: abort, sampling, stops, streaming, bad input."""

import asyncio
import random
import threading

import pytest
from conftest import tiny_model_dir

from kvmesh.engine import AsyncLLMEngine, LLMEngine, SamplingParams
from kvmesh.engine.protocol import EngineOverloadedError
from kvmesh.kvcache import BlockStored, KVCacheError, block_hashes

PROMPT = [(11 * j) % 900 + 3 for j in range(40)]


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return LLMEngine(qwen3_dir, num_kv_blocks=128, block_size=16, max_num_seqs=8)


def test_abort_frees_every_block_at_once(engine):
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    other = engine.add_request(PROMPT[:20], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    request = engine.requests[rid]
    assert request.block_table and engine.block_manager.num_used_blocks > 0
    assert engine.abort(rid)
    assert request.block_table == []  # freed now, not at the next step
    assert engine.abort(other)
    assert engine.block_manager.num_used_blocks == 0
    finals = {o.request_id: o for o in engine.step()}
    assert finals[rid].finished and finals[rid].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.abort(rid) is False  # unknown / already finished


def test_waiting_request_can_be_aborted(engine):
    rid = engine.add_request(PROMPT)
    assert engine.abort(rid)
    [out] = engine.step()
    assert out.finish_reason == "abort" and out.completion_tokens == 0


def test_seed_reproduces_sampled_output(engine):
    params = dict(temperature=1.0, max_tokens=20, ignore_eos=True)
    a = engine.generate([PROMPT], SamplingParams(seed=123, **params))[0].token_ids
    b = engine.generate([PROMPT, PROMPT[:7]], SamplingParams(seed=123, **params))[0].token_ids  # other batch
    c = engine.generate([PROMPT], SamplingParams(seed=124, **params))[0].token_ids
    assert a == b
    assert a != c


def test_top_k_1_equals_greedy(engine):
    greedy = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    top1 = engine.generate(
        [PROMPT], SamplingParams(temperature=1.5, top_k=1, max_tokens=20, ignore_eos=True)
    )[0]
    assert top1.token_ids == greedy.token_ids


def test_top_p_tiny_equals_greedy_and_sampling_differs(engine):
    greedy = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    nucleus = engine.generate(
        [PROMPT], SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=20, ignore_eos=True)
    )[0]
    free = engine.generate([PROMPT], SamplingParams(temperature=2.0, seed=5, max_tokens=20, ignore_eos=True))[
        0
    ]
    assert nucleus.token_ids == greedy.token_ids
    assert free.token_ids != greedy.token_ids


def test_stop_token_ids_end_generation(engine):
    free = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    out = engine.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at])
    )[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop"


def test_stop_string_ends_generation_and_is_not_returned(engine):
    free = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    text = free.text
    stop = text[10:14]
    assert len(stop) == 4 and "\ufffd" not in stop
    out = engine.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text
    assert len(out.token_ids) < len(free.token_ids)


def test_streamed_text_equals_final_text(engine):
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True))
    deltas, ids = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            deltas.append(out.new_text)
            ids += out.new_token_ids
    full = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=25, ignore_eos=True))[0]
    assert "".join(deltas) == full.text and ids == full.token_ids
    assert full.text == engine.tokenizer.decode(full.token_ids, skip_special_tokens=True)


def test_text_prompt_and_usage(engine):
    text = "the cache block prefix token router replica index"
    out = engine.generate(text, SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.prompt_token_ids == engine.tokenizer.encode(text)
    assert 0 < len(out.token_ids) <= 8


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", None, "prompt is empty"),
        ([], None, "prompt is empty"),
        ([1, 99999], None, "outside the vocabulary"),
        ([-1], None, "outside the vocabulary"),
        ([1] * 4090, SamplingParams(max_tokens=16), "exceeds max_model_len"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"temperature": -0.5}, "temperature"),
        ([1, 2], {"temperature": float("nan")}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"top_k": -1}, "top_k"),
        ([1, 2], {"stop": [""]}, "stop strings"),
    ],
)
def test_bad_input_raises_value_error(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        if isinstance(params, dict):
            params = SamplingParams(**params)
        engine.add_request(prompt, params)
    assert not engine.has_unfinished_requests()


def test_request_bigger_than_the_pool_is_rejected(qwen3_dir):
    small = LLMEngine(qwen3_dir, num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        small.add_request([1] * 60, SamplingParams(max_tokens=16))


def test_unknown_engine_option_is_rejected(qwen3_dir):
    with pytest.raises(ValueError, match="unknown engine option"):
        LLMEngine(qwen3_dir, num_kv_block=4)


def test_engine_hands_out_kv_events_and_stats(engine):
    engine.drain_kv_events()
    fresh = [(13 * j + 7) % 900 + 3 for j in range(40)]  # never seen by this engine: 2 new full blocks
    engine.generate([fresh], SamplingParams(temperature=0, max_tokens=4))
    stored = [h for e in engine.drain_kv_events() if isinstance(e, BlockStored) for h in e.hashes]
    assert stored[:2] == block_hashes(fresh, 16, engine.hash_seed)
    stats = engine.stats()
    assert stats.kv.num_cached_hashes > 0 and stats.num_running == 0 and stats.generation_tokens > 0


def test_async_streaming_and_cancellation(engine):
    async def main():
        streamer = AsyncLLMEngine(engine)
        try:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            texts, ids, finals = [], [], []
            async for out in streamer.generate(PROMPT, params):
                texts.append(out.new_text)
                ids += out.new_token_ids
                if out.finished:
                    finals.append(out)
            assert len(finals) == 1 and finals[0].finish_reason == "length" and len(ids) == 12

            # Two at once, then cancel one mid-stream: its blocks are freed, the other finishes.
            async def consume(rid, limit=None):
                got = 0
                async for _ in streamer.generate(
                    PROMPT, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), rid
                ):
                    got += 1
                    if limit and got >= limit:
                        break
                return got

            done = await asyncio.gather(consume("keep"), consume("cancel", limit=3))
            assert done == [200, 3]
            for _ in range(100):
                if streamer.stats().kv.num_used_blocks == 0:
                    break
                await asyncio.sleep(0.01)
            assert streamer.stats().kv.num_used_blocks == 0
            assert streamer.drain_kv_events()

            with pytest.raises(ValueError, match="prompt is empty"):
                async for _ in streamer.generate([], params):
                    pass
        finally:
            streamer.shutdown()

    asyncio.run(main())
    assert not engine.has_unfinished_requests()


def test_admission_runs_on_the_engine_thread_and_refuses_a_full_queue(qwen3_dir):
    """Seeds, duplicate ids and the queue bound are engine state: read on its thread only."""
    engine = LLMEngine(qwen3_dir, num_kv_blocks=64, block_size=16, max_num_seqs=1, max_queued_requests=1)
    threads = []
    prepare = engine.prepare_request

    def recording(*args):
        threads.append(threading.current_thread().name)
        return prepare(*args)

    engine.prepare_request = recording

    async def main():
        streamer = AsyncLLMEngine(engine)
        try:
            long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            running = streamer.generate(PROMPT, long, "running")
            await anext(running)  # admitted and running: the queue is empty again
            queued = streamer.generate(PROMPT, long, "queued")
            queued_first = asyncio.ensure_future(anext(queued))
            for _ in range(200):  # until the engine thread has queued it
                if streamer.stats().num_waiting == 1:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(EngineOverloadedError, match="queue is full"):
                await anext(streamer.generate(PROMPT, long, "refused"))
            await running.aclose()
            await queued_first
            await queued.aclose()
        finally:
            streamer.shutdown()

    asyncio.run(main())
    assert threads and set(threads) == {"kvmesh-engine"}


def test_check_invariants_setting_checks_the_ledger_every_step(qwen3_dir):
    engine = LLMEngine(qwen3_dir, num_kv_blocks=16, block_size=16, max_num_seqs=4, check_invariants=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.generate([PROMPT, PROMPT, PROMPT[:30]], params)  # prefix hits, tight pool: all consistent
    engine.block_manager._num_cached_free += 1  # fault injection
    engine.add_request(PROMPT[:20], params)
    with pytest.raises(KVCacheError, match="cached-free count"):
        engine.step()


def test_a_vanishing_temperature_is_greedy_not_a_failed_batch(engine):
    """Found by the fuzzer: temperature 1e-40 made logits / T overflow and the step's softmax
    NaN, which failed every request in the batch. Below 1e-5 sampling is greedy (vLLM's rule)."""
    greedy = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    both = engine.generate(
        [PROMPT, PROMPT[:25]],
        [
            SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True),
            SamplingParams(max_tokens=8, seed=1),
        ],
    )
    assert both[0].token_ids == greedy.token_ids and len(both[1].token_ids) == 8


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_continued_stream_releases_exactly_the_text_the_first_attempt_had_left(engine, cut):
    """A migrated stream: the prompt plus the first ``cut`` tokens, continued. Its tokens and
    text follow the uninterrupted run's exactly, text held back for a stop string included."""
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop=["\x00never"])
    engine.add_request(PROMPT, params)
    steps = []  # (token ids, text) as each step released them
    while engine.has_unfinished_requests():
        steps += [(out.new_token_ids, out.new_text) for out in engine.step()]
    ids = [t for new, _ in steps for t in new]
    had = "".join(text for _, text in steps[:cut])  # what the client had when the replica died
    assert len(steps) == 25 and "".join(text for _, text in steps) != had
    rest = engine.generate([PROMPT + ids[:cut]], params.continued(cut))[0]
    assert rest.token_ids == ids[cut:]
    assert had + rest.text == "".join(text for _, text in steps)


def test_a_continuation_has_what_is_left_of_its_limits_and_a_new_seed():
    params = SamplingParams(temperature=0.7, max_tokens=20, min_tokens=8, seed=5)
    rest = params.continued(6)
    assert (rest.max_tokens, rest.min_tokens, rest.seed, rest.continued_tokens) == (14, 2, 11, 6)
    assert params.continued(10).min_tokens == 0
    with pytest.raises(ValueError, match="continued_tokens"):
        params.continued(20)  # nothing left
    with pytest.raises(ValueError, match="one choice"):
        SamplingParams(n=2).continued(1)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_fast_decoder_gives_transformers_text(arch):
    """The detokenizer decodes through the Rust tokenizer directly: the text must be exactly
    what transformers' decode gives, byte-level pieces and special tokens included."""
    from kvmesh.engine.detokenizer import token_decoder
    from kvmesh.engine.llm_engine import _load_tokenizer

    tokenizer = _load_tokenizer(tiny_model_dir(arch))
    decode = token_decoder(tokenizer)
    rng = random.Random(4)
    for n in (1, 2, 5, 40):
        ids = [rng.randrange(len(tokenizer)) for _ in range(n)]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    tokenizer.clean_up_tokenization_spaces = True  # then only transformers' decode is right
    assert token_decoder(tokenizer)([5, 6]) == tokenizer.decode([5, 6], skip_special_tokens=True)
