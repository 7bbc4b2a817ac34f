"""Log-probabilities, penalties, min_p, min_tokens and logit bias, against references
computed with ``transformers`` on the tiny model (fp32, CPU): log-probabilities equal the
log-softmax of its logits, and every adjustment changes the logits as its formula says."""

import pytest
import torch
from reference import _hf_model, hf_log_softmax, prompts_of_lengths

from kvmesh.engine import LLMEngine, SamplingParams
from kvmesh.engine.request import Request
from kvmesh.engine.sampler import adjust_logits, row_adjustments

PROMPT = prompts_of_lengths([45], salt=3)[0]


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    # a 24-token budget: the 45-token prompt is computed in chunks
    return LLMEngine(qwen3_dir, num_kv_blocks=128, block_size=16, max_num_batched_tokens=24)


def hf_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = _hf_model(model_dir)(torch.tensor([ids])).logits[0, -1].float()
    return logits.clone()  # out of inference mode: the formulas edit it


def test_logprobs_are_the_raw_log_softmax_of_the_model(engine, qwen3_dir):
    params = SamplingParams(
        temperature=0.7, seed=3, max_tokens=6, ignore_eos=True, logprobs=4, repetition_penalty=1.4
    )
    [out] = engine.generate([PROMPT], params)
    ref = hf_log_softmax(str(qwen3_dir), tuple(PROMPT + out.token_ids))
    assert len(out.logprobs) == 6
    for i, (token, scored) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(PROMPT) - 1 + i]  # raw: before temperature and penalties (vLLM V1's default)
        assert scored.token_id == token and abs(scored.logprob - row[token].item()) < 1e-4
        values, ids = row.topk(4)
        assert [t for t, _ in scored.top] == ids.tolist()
        assert all(abs(v - r) < 1e-4 for (_, v), r in zip(scored.top, values.tolist(), strict=True))


def test_prompt_logprobs_cover_the_prompt_and_bypass_the_cache(engine, qwen3_dir):
    engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))  # the prompt is cached now
    [out] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    assert out.num_cached_tokens == 0  # every prompt position was computed (as in vLLM)
    ref = hf_log_softmax(str(qwen3_dir), tuple(PROMPT))
    assert len(out.prompt_logprobs) == len(PROMPT) - 1
    for pos, scored in enumerate(out.prompt_logprobs, start=1):
        assert (
            scored.token_id == PROMPT[pos] and abs(scored.logprob - ref[pos - 1][PROMPT[pos]].item()) < 1e-4
        )
        assert [t for t, _ in scored.top] == ref[pos - 1].topk(2).indices.tolist()
        assert scored.rank == 1 + int((ref[pos - 1] > ref[pos - 1][PROMPT[pos]]).sum())
    [plain] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None


def reference_greedy(model_dir, prompt, n, adjust) -> list[int]:
    """Greedy decoding with transformers, ``adjust(logits, output)`` applied to each step."""
    out: list[int] = []
    for _ in range(n):
        logits = adjust(hf_logits(str(model_dir), prompt + out), out)
        out.append(int(logits.argmax()))
    return out


def repetition(p):
    def adjust(logits, out):
        seen = torch.tensor(sorted(set(PROMPT + out)))
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p, values * p)
        return logits

    return adjust


def frequency_presence(freq, pres):
    def adjust(logits, out):
        for token in set(out):
            logits[token] -= freq * out.count(token) + pres
        return logits

    return adjust


def bias(table):
    def adjust(logits, out):
        for token, value in table.items():
            logits[token] += value
        return logits

    return adjust


@pytest.mark.parametrize(
    "params, adjust",
    [
        ({"repetition_penalty": 1.5}, repetition(1.5)),
        ({"repetition_penalty": 0.7}, repetition(0.7)),
        # negative: repeats are encouraged, so a short greedy output changes
        ({"frequency_penalty": -2.0}, frequency_presence(-2.0, 0.0)),
        ({"presence_penalty": -2.0}, frequency_presence(0.0, -2.0)),
        ({"frequency_penalty": -2.0, "presence_penalty": 0.5}, frequency_presence(-2.0, 0.5)),
        ({"logit_bias": {7: 30.0, 11: 29.0}}, bias({7: 30.0, 11: 29.0})),
    ],
    ids=["repetition", "repetition<1", "frequency", "presence", "both", "logit-bias"],
)
def test_penalties_and_bias_follow_their_formulas(engine, qwen3_dir, params, adjust):
    n = 12
    [out] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **params))
    assert out.token_ids == reference_greedy(qwen3_dir, PROMPT, n, adjust)
    [plain] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert plain.token_ids != out.token_ids  # the adjustment mattered


def test_min_tokens_holds_back_eos(engine):
    eos = min(engine.eos_token_ids)
    eager = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    [now] = engine.generate([PROMPT], eager)
    assert now.token_ids == [eos] and now.finish_reason == "stop"
    [later] = engine.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0}, min_tokens=4)
    )
    assert len(later.token_ids) == 5 and later.token_ids[-1] == eos and eos not in later.token_ids[:4]


def test_min_p_keeps_only_tokens_near_the_best(engine, qwen3_dir):
    [greedy] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    [only_best] = engine.generate(
        [PROMPT], SamplingParams(temperature=1.0, seed=5, min_p=1.0, max_tokens=8, ignore_eos=True)
    )
    assert only_best.token_ids == greedy.token_ids
    [some] = engine.generate(
        [PROMPT], SamplingParams(temperature=1.0, seed=5, min_p=0.3, max_tokens=8, ignore_eos=True)
    )
    ids = PROMPT + some.token_ids
    probs = hf_log_softmax(str(qwen3_dir), tuple(ids)).exp()
    for i, token in enumerate(some.token_ids):
        row = probs[len(PROMPT) - 1 + i]
        assert row[token] >= 0.3 * row.max() - 1e-6


def test_adjust_logits_is_exactly_the_formula():
    params = SamplingParams(
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias={3: 1.0},
        min_tokens=3,
        max_tokens=8,
    )
    request = Request("r", [1, 2], 16, params, None, frozenset({4}), None)
    request.add_token(2, None)
    request.add_token(5, None)
    logits = torch.tensor([[1.0, 2.0, -2.0, 0.5, 3.0, 4.0, 1.0]])
    adjust_logits(logits, {0: row_adjustments(request, logits.device)})
    logits = logits[0]
    expected = [1.0, 2.0 / 2.0, -2.0 * 2.0 - 0.5 - 0.25, 1.5, float("-inf"), 4.0 / 2.0 - 0.5 - 0.25, 1.0]
    assert logits.tolist() == expected


def test_rows_drawn_at_once_follow_their_filtered_distribution():
    """``draw`` samples every row in one race: over many rows the frequencies are the
    distribution's (within five standard errors), a token filtered out never comes, and
    a seeded row draws the same token whatever its neighbours are."""
    from types import SimpleNamespace

    from kvmesh.engine.sampler import draw

    rows = 20_000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(rows, -1).clone()
    plain = SimpleNamespace(params=SamplingParams(temperature=1.0, top_k=3), generator=None)
    tokens = draw(logits, [plain] * rows, torch.Generator().manual_seed(7)).tokens
    counts = torch.bincount(tokens, minlength=4).double() / rows
    kept = probs[:3] / probs[:3].sum()  # top_k=3 rules out the last token
    assert counts[3] == 0
    assert ((counts[:3] - kept).abs() <= 5 * (kept * (1 - kept) / rows).sqrt()).all(), counts

    def seeded():
        return SimpleNamespace(
            params=SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(11)
        )

    alone = draw(logits[:1], [seeded()], torch.Generator().manual_seed(1)).tokens
    crowded = draw(
        logits[:64], [plain] * 40 + [seeded()] + [plain] * 23, torch.Generator().manual_seed(2)
    ).tokens
    assert crowded[40] == alone[0] and len(set(crowded.tolist())) > 1


def one_row_formula(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """The adjustments of one row, written out plainly: the reference for the batched ones."""
    p = request.params
    if p.min_tokens and request.num_completion_tokens < p.min_tokens:
        logits[sorted(request.stop_ids)] = float("-inf")
    for token, value in p.logit_bias.items():
        logits[token] += value
    for token in set(request.token_ids) if p.repetition_penalty != 1.0 else ():
        value = logits[token]
        logits[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token in set(request.completion_token_ids):
        count = request.completion_token_ids.count(token)
        logits[token] -= p.frequency_penalty * count + p.presence_penalty
    return logits


def test_rows_adjusted_at_once_equal_each_row_adjusted_alone():
    """Mixed rows (every adjustment alone and together, none, below and past min_tokens),
    adjusted in one batch over two steps (the output tallies carried between them)."""
    vocab, rng = 50, torch.Generator().manual_seed(3)
    kinds = [
        {"repetition_penalty": 1.7},
        {"repetition_penalty": 0.6, "frequency_penalty": 0.4},
        {"presence_penalty": -0.8, "logit_bias": {3: 2.0, 49: -1.5}},
        {"min_tokens": 5, "logit_bias": {1: 0.5}},
        {"min_tokens": 1, "frequency_penalty": 1.1, "presence_penalty": 0.2, "repetition_penalty": 1.2},
        {},
    ]
    requests = []
    for i, kind in enumerate(kinds):
        prompt = torch.randint(0, vocab, (8 + i,), generator=rng).tolist()
        request = Request(
            f"r{i}", prompt, 16, SamplingParams(max_tokens=9, **kind), None, frozenset({0, 7}), None
        )
        requests.append(request)
    for _ in range(2):
        for request in requests:
            for token in torch.randint(0, vocab, (2,), generator=rng).tolist():
                request.add_token(token, None)
        logits = torch.randn(len(requests), vocab, generator=rng)
        expected = torch.stack(
            [one_row_formula(row.clone(), r) for row, r in zip(logits, requests, strict=True)]
        )
        got = adjust_logits(
            logits.clone(), {i: row_adjustments(r, logits.device) for i, r in enumerate(requests)}
        )
        torch.testing.assert_close(got, expected)
        some = adjust_logits(logits.clone(), {i: row_adjustments(requests[i], logits.device) for i in (1, 3)})
        torch.testing.assert_close(some[[1, 3]], expected[[1, 3]])
        torch.testing.assert_close(some[[0, 2, 4, 5]], logits[[0, 2, 4, 5]])  # rows not named: as they were


def test_a_pending_token_counts_as_output_on_the_device():
    """A row whose last token a launched step is still sampling (async scheduling) is
    adjusted as if that token had landed, whether it is new to its row, repeated from its
    output, or seen only in its prompt; and once it lands it is tallied once."""
    vocab, rng = 50, torch.Generator().manual_seed(5)
    kinds = [
        {"repetition_penalty": 1.7},
        {"repetition_penalty": 0.6, "frequency_penalty": 0.4},
        {"presence_penalty": -0.8, "frequency_penalty": 0.3, "repetition_penalty": 1.3},
        {"presence_penalty": 0.5, "logit_bias": {21: 1.0}},
        {"min_tokens": 3, "frequency_penalty": 0.2},  # the pending token reaches min_tokens
        {"min_tokens": 4, "presence_penalty": 0.1},  # it does not
    ]
    pending_tokens = [30, 20, 3, 21, 7, 0]  # new, in output, prompt only, in output, stop ids
    landed, waiting = [], []
    for kind in kinds:
        pair = [
            Request(
                "r", [1, 2, 3, 4, 5], 16, SamplingParams(max_tokens=9, **kind), None, frozenset({0, 7}), None
            )
            for _ in range(2)
        ]
        for request in pair:
            request.add_token(20, None)
            request.add_token(21, None)
        landed.append(pair[0])
        waiting.append(pair[1])
    for request in waiting:  # tallied once before the pending token: the tally carries over
        row_adjustments(request, torch.device("cpu"))
    for row, (a, b, token) in enumerate(zip(landed, waiting, pending_tokens, strict=True)):
        a.add_token(token, None)
        b.expect_token(row)
    previous = torch.tensor(pending_tokens)
    for _ in range(2):  # the token pending, then landed
        logits = torch.randn(len(kinds), vocab, generator=rng)
        expected = torch.stack(
            [one_row_formula(row.clone(), r) for row, r in zip(logits, landed, strict=True)]
        )
        pending = [row for row, r in enumerate(waiting) if r.pending_row is not None]
        got = adjust_logits(
            logits.clone(),
            {i: row_adjustments(r, logits.device) for i, r in enumerate(waiting)},
            (pending, previous[pending]),
        )
        torch.testing.assert_close(got, expected)
        for request, token in zip(waiting, pending_tokens, strict=True):
            request.add_token(token, None)
