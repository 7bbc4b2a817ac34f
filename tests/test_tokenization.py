"""The router's torch-free tokenizer gives exactly what transformers' AutoTokenizer gives."""

import pytest
from transformers import AutoTokenizer

from kvmesh.serving.tokenizer import PromptTokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing ",
    "the cache block prefix token router replica index 12345!",
    "ünïcødé, 日本語, emoji 🙂 and tabs\tnew\nlines",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "a" * 500,
]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request):
    path = request.getfixturevalue(f"{request.param}_dir")
    return PromptTokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_auto_tokenizer(pair, text):
    ours, hf = pair
    assert ours.encode(text) == hf.encode(text)


def test_chat_template_matches_auto_tokenizer(pair):
    ours, hf = pair
    messages = [
        {"role": "system", "content": "You route requests."},
        {"role": "user", "content": "Where is my prefix cached?"},
        {"role": "assistant", "content": "On replica 2."},
        {"role": "user", "content": "ünïcødé follow-up"},
    ]
    expected = hf.encode(
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    assert ours.render_chat(messages) == expected


def test_chat_errors(pair, tmp_path):
    ours, _ = pair
    with pytest.raises(ValueError, match="no messages"):
        ours.render_chat([])
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        PromptTokenizer(tmp_path)
