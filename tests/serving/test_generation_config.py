"""Sampling defaults from generation_config.json and the max_tokens rule, as the router and
the replicas apply them (serving.generation_config, serving.admission)."""

import json

import pytest

from kvmesh.protos import pb
from kvmesh.serving.admission import admit
from kvmesh.serving.errors import InvalidRequest
from kvmesh.serving.generation_config import GenerationDefaults
from kvmesh.serving.model_info import ModelInfo

MODEL = ModelInfo("m", 16, 1000, 512, 7)


def folder_with(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def chat(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
        sampling=pb.SamplingParams(**sampling),
    )


def text(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))


def test_auto_reads_the_models_sampling_values_but_not_transformers_own_defaults(tmp_path):
    folder = folder_with(
        tmp_path,
        {
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 50,
            "repetition_penalty": 1.0,
            "min_p": 0.05,
            "eos_token_id": 2,
        },
    )
    defaults = GenerationDefaults.load("auto", folder)
    # top_k 50 and repetition_penalty 1.0 are transformers' defaults: the file did not choose them.
    assert defaults.values == {"temperature": 0.6, "top_p": 0.95, "min_p": 0.05}
    resolved = defaults.resolve(text(top_p=0.5), 10, 1000)
    assert resolved.temperature == pytest.approx(0.6) and resolved.min_p == pytest.approx(0.05)
    assert resolved.top_p == pytest.approx(0.5)  # the request's own value wins
    assert not resolved.HasField("top_k")


def test_vllm_ignores_the_file_and_a_folder_source_reads_that_folder(tmp_path):
    folder = folder_with(tmp_path, {"temperature": 0.3})
    assert GenerationDefaults.load("vllm", folder).values == {}
    assert GenerationDefaults.load(str(folder), "/elsewhere").values == {"temperature": 0.3}
    assert GenerationDefaults.load("auto", tmp_path / "no-such-model").values == {}
    with pytest.raises(ValueError, match="does not exist"):
        GenerationDefaults.load(str(tmp_path / "missing"), folder)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        GenerationDefaults.load("auto", folder)


def test_unset_max_tokens_chat_gets_the_rest_of_the_context_text_gets_16():
    defaults = GenerationDefaults()
    assert defaults.resolve(chat(), 100, 1000).max_tokens == 900
    assert defaults.resolve(text(), 100, 1000).max_tokens == 16
    assert defaults.resolve(text(), 995, 1000).max_tokens == 5  # a default is clamped, never refused
    assert defaults.resolve(chat(), 100, 1000, max_tokens_limit=300).max_tokens == 300
    assert defaults.resolve(chat(max_tokens=950), 100, 1000).max_tokens == 950  # explicit: left to the checks


def test_max_new_tokens_lowers_the_default(tmp_path):
    defaults = GenerationDefaults.load("auto", folder_with(tmp_path, {"max_new_tokens": 64}))
    assert defaults.resolve(chat(), 100, 1000).max_tokens == 64
    assert defaults.resolve(text(), 100, 1000).max_tokens == 16
    assert defaults.resolve(chat(max_tokens=200), 100, 1000).max_tokens == 200


def test_admit_checks_explicit_values_and_fills_defaults():
    defaults = GenerationDefaults({"temperature": 0.0})
    sampling, params = admit(chat(), 100, MODEL, defaults)
    assert params.greedy and params.max_tokens == 900 and sampling.max_tokens == 900
    with pytest.raises(InvalidRequest, match="exceeds max_model_len"):
        admit(text(max_tokens=950), 100, MODEL, defaults)
    with pytest.raises(InvalidRequest, match="above the limit 200"):
        admit(text(max_tokens=300), 10, MODEL, defaults, max_tokens_limit=200)
    with pytest.raises(InvalidRequest, match="prompt has 999 tokens, the limit is 500"):
        admit(text(), 999, MODEL, defaults, max_prompt_tokens=500)
    with pytest.raises(InvalidRequest, match="logit_bias: token id 600 is outside the vocabulary"):
        admit(text(logit_bias={600: 1.0}), 10, MODEL, defaults)
    with pytest.raises(InvalidRequest, match="n must be in"):
        admit(text(n=17), 10, MODEL, defaults)


def test_the_routers_load_estimate_caps_decode_per_choice():
    """An open-ended chat (max_tokens = the rest of a long context) counts as at most
    DECODE_ESTIMATE_CAP_TOKENS of decode per choice, not as tens of thousands."""
    from kvmesh.router.decision import DECODE_ESTIMATE_CAP_TOKENS, Decision

    def decision(**sampling) -> Decision:
        return Decision("r", [1] * 40, [], pb.SamplingParams(**sampling), [], {}, "prefix", 0.0)

    assert decision(max_tokens=100).decode_estimate == 100
    assert decision(max_tokens=30_000).decode_estimate == DECODE_ESTIMATE_CAP_TOKENS
    assert decision(max_tokens=30_000, n=3).decode_estimate == 3 * DECODE_ESTIMATE_CAP_TOKENS
    assert decision(max_tokens=10, n=4).decode_estimate == 40
