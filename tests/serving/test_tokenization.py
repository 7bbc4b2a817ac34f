"""The router's torch-free tokenizer gives exactly what transformers' AutoTokenizer gives."""

from pathlib import Path

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


def with_template(pair, template: str) -> PromptTokenizer:
    """The pair's tokenizer folder read again, with another chat template."""
    return PromptTokenizer(pair[1].name_or_path, chat_template=template)


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


TOOLS_TEMPLATE = (Path(__file__).resolve().parents[1] / "data" / "tools_chat_template.jinja").read_text()
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?", "name": "ana"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
]


@pytest.mark.parametrize(
    "options",
    [
        {"tools": [WEATHER_TOOL]},
        {"documents": [{"title": "doc", "text": "kvmesh routes by prefix"}]},
        {"template_kwargs": {"enable_thinking": False}},
        {"add_generation_prompt": False},
    ],
    ids=["tools", "documents", "template-kwargs", "no-generation-prompt"],
)
def test_rich_templates_render_as_transformers_renders_them(pair, options):
    """Tools, tool calls and results, documents, names, the {% generation %} tag and template
    kwargs: the router's renderer is transformers' own, so it matches apply_chat_template."""
    _, hf = pair
    rich = with_template(pair, TOOLS_TEMPLATE)
    kwargs = dict(options)
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    extra = kwargs.pop("template_kwargs", {})
    expected = hf.apply_chat_template(
        TOOL_CONVERSATION,
        tokenize=False,
        chat_template=TOOLS_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
        **extra,
    )
    assert rich.render_chat_text(TOOL_CONVERSATION, **options) == expected
    assert rich.render_chat(TOOL_CONVERSATION, **options) == hf.encode(expected, add_special_tokens=False)
    if "tools" in options:
        assert '"get_weather"' in expected and '<tool_call>get_weather {"city": "Paris"}' in expected


def test_continue_final_message_ends_inside_the_last_message(pair):
    _, hf = pair
    rich = with_template(pair, TOOLS_TEMPLATE)
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}]
    ours_text = rich.render_chat_text(messages, add_generation_prompt=False, continue_final_message=True)
    expected = hf.apply_chat_template(
        messages, tokenize=False, chat_template=TOOLS_TEMPLATE, continue_final_message=True
    )
    assert ours_text == expected and ours_text.endswith("one, two,")
    with pytest.raises(ValueError, match="cannot both be true"):
        rich.render_chat(messages, add_generation_prompt=True, continue_final_message=True)


def test_template_errors_are_value_errors_with_the_reason(pair):
    rich = with_template(pair, TOOLS_TEMPLATE)
    with pytest.raises(ValueError, match="must start with a system or user message"):
        rich.render_chat([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="may not set messages"):
        rich.render_chat([{"role": "user", "content": "hi"}], template_kwargs={"messages": []})
    broken = with_template(pair, "{% for %}")
    with pytest.raises(ValueError, match="chat template"):
        broken.render_chat([{"role": "user", "content": "hi"}])


def test_decode_and_token_strings(pair):
    ours, hf = pair
    ids = ours.encode("hello ünïcødé world")
    assert ours.decode(ids) == hf.decode(ids)
    assert ours.token_strings(ids) == [hf.decode([i]) for i in ids]


def test_token_strings_are_remembered_within_the_vocabulary(pair, monkeypatch):
    ours, hf = pair
    vocab = ours.tokenizer.get_vocab_size(with_added_tokens=True)
    ids = [*ours.encode("hello ünïcødé world"), 0, vocab - 1]
    expected = [hf.decode([i]) for i in ids]
    assert ours.token_strings(ids) == expected
    decoded = []
    monkeypatch.setattr(ours, "tokenizer", _Counting(ours.tokenizer, decoded))
    assert ours.token_strings([*ids, *ids]) == expected * 2
    assert decoded == []  # known: not decoded again
    for start in range(0, vocab + 512, 256):  # ids past the vocabulary too
        assert ours.token_strings(list(range(start, start + 256)))[0] == hf.decode([start])
    assert len(ours._token_strings) <= vocab


class _Counting:
    def __init__(self, tokenizer, calls: list):
        self._tokenizer, self._calls = tokenizer, calls

    def decode_batch(self, batch, **kwargs):
        self._calls.append(batch)
        return self._tokenizer.decode_batch(batch, **kwargs)
