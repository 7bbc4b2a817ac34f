"""How a vLLM replica reads vLLM's streamed completions: logprobs (tokens named token_id:N)."""

from kvmesh.replica.vllm.engine import _Progress


def chunk(ids, logprobs=None, finish=None):
    return {"choices": [{"text": "x", "token_ids": ids, "finish_reason": finish, "logprobs": logprobs}]}


def test_logprobs_come_back_best_first_with_a_rank_only_where_it_is_known():
    progress = _Progress("r", prompt_tokens=3, top_logprobs=2)
    # vLLM lists the sampled token first, then the best ones; token 7 is not among the best 2
    logprobs = {
        "tokens": ["token_id:5", "token_id:7"],
        "token_logprobs": [-0.5, -3.0],
        "top_logprobs": [
            {"token_id:5": -0.5, "token_id:9": -0.25},
            {"token_id:7": -3.0, "token_id:1": -0.1, "token_id:2": -1.5},
        ],
        "text_offset": [0, 1],
    }
    out = progress.read(chunk([5, 7], logprobs))
    first, second = out.logprobs
    assert (first.token_id, first.logprob, first.rank) == (5, -0.5, 2)
    assert first.top == ((9, -0.25), (5, -0.5))
    assert (second.token_id, second.rank) == (7, 0) and second.top == ((1, -0.1), (2, -1.5))


def test_without_logprobs_asked_none_are_made():
    out = _Progress("r", prompt_tokens=3).read(chunk([5]))
    assert out.new_token_ids == [5] and out.logprobs is None
