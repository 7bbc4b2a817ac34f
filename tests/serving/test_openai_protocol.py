"""The OpenAI field rules, the body -> kvmesh.v1 mapping of every honoured field, and the
error shapes, without servers (a fake backend injects the mid-stream failure)."""

import json
from pathlib import Path

import httpx
import pytest
from fake_backend import FakeBackend

from kvmesh.protos import pb
from kvmesh.serving.admission import admit
from kvmesh.serving.errors import InvalidRequest, Unavailable
from kvmesh.serving.generation_config import GenerationDefaults
from kvmesh.serving.limits import InputLimits
from kvmesh.serving.openai.app import OneModel, build_app
from kvmesh.serving.openai.protocol import FIELD_RULES, ChatRequest, CompletionRequest, field_table
from kvmesh.serving.openai.requests import chat_plan, completion_plan, session_key_of
from kvmesh.serving.sampling_params import SamplingParams, sampling_from_proto

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"completions": CompletionRequest, "chat": ChatRequest}


def test_api_docs_field_table_is_the_codes():
    api_docs = (ROOT / "docs" / "api.md").read_text()
    assert field_table() in api_docs, (
        "docs/api.md's OpenAI field table is stale: paste field_table()'s output"
    )


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_declared_field_has_a_rule_and_every_rule_a_field(endpoint):
    """A field cannot be added to a request body, or to the table, without the other."""
    ruled = {r.name for r in FIELD_RULES if r.endpoints in ("both", endpoint)}
    declared = set(MODELS[endpoint].model_fields)
    assert declared == ruled


ALL_SAMPLING = {
    "max_tokens": 7,
    "temperature": 0.5,
    "top_p": 0.75,
    "top_k": 40,
    "min_p": 0.125,
    "presence_penalty": 0.25,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.25,
    "min_tokens": 2,
    "logit_bias": {"5": 3.0, "9": -100.0},
    "seed": 123,
    "stop": ["END", "STOP"],
    "stop_token_ids": [4, 8],
    "ignore_eos": True,
    "n": 3,
    "prompt_logprobs": 2,
    "user": "session-1",
    "policy": "least_loaded",
}
EXPECTED = SamplingParams(
    max_tokens=7,
    temperature=0.5,
    top_p=0.75,
    top_k=40,
    min_p=0.125,
    presence_penalty=0.25,
    frequency_penalty=-0.5,
    repetition_penalty=1.25,
    min_tokens=2,
    logit_bias={5: 3.0, 9: -100.0},
    seed=123,
    stop=["END", "STOP"],
    stop_token_ids=[4, 8],
    ignore_eos=True,
    n=3,
    prompt_logprobs=2,
)


def test_every_completions_field_reaches_the_engine():
    body = CompletionRequest(prompt="hi", logprobs=4, **ALL_SAMPLING)
    (request,) = completion_plan(body, None, session_key_of({}, body, InputLimits())).requests
    assert request.text == "hi" and request.affinity_key == "session-1" and request.policy == "least_loaded"
    params = sampling_from_proto(request.sampling)
    assert params == SamplingParams(**{**EXPECTED.__dict__, "logprobs": 4})


def test_every_chat_field_reaches_the_engine():
    body = ChatRequest(
        messages=[
            {"role": "user", "content": "hi", "name": "ana"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
            {"role": "tool", "content": "ok", "tool_call_id": "c"},
        ],
        max_completion_tokens=9,
        logprobs=True,
        top_logprobs=3,
        tools=[{"type": "function", "function": {"name": "f"}}],
        documents=[{"title": "t", "text": "x"}],
        chat_template_kwargs={"enable_thinking": False},
        add_generation_prompt=False,
        continue_final_message=True,
        **{k: v for k, v in ALL_SAMPLING.items() if k != "prompt_logprobs"},
    )
    (request,) = chat_plan(body).requests
    params = sampling_from_proto(request.sampling)
    assert params.max_tokens == 9 and params.logprobs == 3 and params.repetition_penalty == 1.25
    chat = request.chat
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.messages[0].name == "ana" and chat.messages[2].tool_call_id == "c"
    assert json.loads(chat.messages[1].tool_calls_json)[0]["function"]["name"] == "f"
    assert json.loads(chat.tools_json)[0]["function"]["name"] == "f"
    assert json.loads(chat.documents_json) == [{"title": "t", "text": "x"}]
    assert json.loads(chat.template_kwargs_json) == {"enable_thinking": False}
    assert chat.HasField("add_generation_prompt") and not chat.add_generation_prompt
    assert chat.continue_final_message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "top_k": -2}, None),  # SamplingParams: "top_k must be >= 0"
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": [], "max_tokens": 2}, "prompt"),
    ],
)
def test_out_of_range_values_name_their_field(body, param):
    with pytest.raises(InvalidRequest) as err:
        request = CompletionRequest(**body)
        request.check_supported()
        for r in completion_plan(request, None).requests:
            admit(r, 3, _FailingBackend.model, GenerationDefaults())
    if param is not None:
        assert err.value.param == param


class _FailingBackend(FakeBackend):
    """Streams one chunk, then fails as a replica dying mid-stream does (fault injection)."""

    async def generate(self, request, trace=None):
        yield pb.GenerateResponse(request_id="r", chunk=pb.Chunk(token_ids=[1], text="a", prompt_tokens=3))
        raise Unavailable("replica error (UNAVAILABLE): connection to the replica was closed")


async def test_a_mid_stream_failure_is_an_in_band_openai_error():
    app = build_app(OneModel(_FailingBackend()), lambda: {"status": "ok"})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        reply = await http.post("/v1/completions", json={"prompt": [1, 2, 3], "stream": True})
        whole = await http.post("/v1/completions", json={"prompt": [1, 2, 3]})
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["text"] == "a"
    error = json.loads(events[-2])["error"]
    assert error == {
        "message": "replica error (UNAVAILABLE): connection to the replica was closed",
        "type": "service_unavailable",
        "param": None,
        "code": 503,
    }
    assert whole.status_code == 503 and whole.json()["error"]["type"] == "service_unavailable"


class _Recording(FakeBackend):
    """Answers every request with one token and keeps the requests it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[pb.GenerateRequest] = []

    async def generate(self, request, trace=None):
        self.seen.append(request)
        yield pb.GenerateResponse(request_id="r", chunk=pb.Chunk(token_ids=[1], text="a", prompt_tokens=3))


SESSION_BODIES = {
    "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
}


async def post(path: str, user: str | None, header: str | None) -> tuple[httpx.Response, _Recording]:
    """A request with this ``user`` and ``x-session-id`` header (None: left out) to a fresh app
    over one recording backend (through the hot routes, as clients' requests go)."""
    body = {**SESSION_BODIES[path], **({"user": user} if user is not None else {})}
    headers = {"X-Session-Id": header} if header is not None else {}
    app = build_app(OneModel(backend := _Recording()), lambda: {"status": "ok"})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        return await http.post(path, json=body, headers=headers), backend


@pytest.mark.parametrize("path", SESSION_BODIES)
@pytest.mark.parametrize(
    ("header", "user", "key"),
    [(None, None, ""), (None, "u-1", "u-1"), ("h-1", None, "h-1"), ("h-1", "u-1", "h-1"), ("", "u-1", "u-1")],
)
async def test_the_session_key_is_the_header_else_user(path, header, user, key):
    reply, backend = await post(path, user, header)
    assert reply.status_code == 200, reply.text
    assert [r.affinity_key for r in backend.seen] == [key]


@pytest.mark.parametrize("path", SESSION_BODIES)
@pytest.mark.parametrize(
    ("header", "user", "param", "size"),
    [
        ("h" * 257, None, "x-session-id", 257),
        (None, "é" * 129, "user", 258),
        ("h" * 257, "u-1", "x-session-id", 257),
    ],
)
async def test_an_oversized_session_key_is_a_400_naming_where_it_came_from(path, header, user, param, size):
    reply, backend = await post(path, user, header)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and not backend.seen
    assert error["message"] == f"{param}: {size} bytes, the limit is 256 (--max-session-key-bytes)"


async def test_a_session_key_at_the_bound_is_taken_whole():
    reply, backend = await post("/v1/completions", None, "k" * 256)
    assert reply.status_code == 200 and backend.seen[0].affinity_key == "k" * 256
