"""The official ``openai`` client against the router and a replica, for every request field
(``openai_protocol.FIELD_RULES``): honoured, or refused with a 400 naming the field.

One router and one replica run in this process (real gRPC, real HTTP, a real valkey), both
started the way a user starts them with ``--served-model-name``, ``--tokenizer`` (the model
folder has no tokenizer files), ``--chat-template`` (a template with tools, documents and
kwargs) and ``--generation-config`` (a folder whose file makes greedy the default).
"""

import asyncio
import json
import logging
import shutil
from importlib.metadata import version
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import pytest_asyncio
from reference import hf_greedy, hf_log_softmax
from transformers import AutoTokenizer

from kvmesh.cluster.embedded_redis import EmbeddedRedis, free_port
from kvmesh.engine.config import EngineConfig
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.config import RouterConfig
from kvmesh.router.process import RouterServer
from kvmesh.serving.api_config import APIConfig
from kvmesh.serving.openai.protocol import FIELD_RULES

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.servers]

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "tools_chat_template.jinja"
SERVED = "tiny-chat"
MAX_MODEL_LEN = 512
BLOCK = 16
PROMPT = "the quick brown fox jumps over the lazy dog and the cache " * 2
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(qwen3_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    model, tokenizer, gen = root / "weights", root / "tokenizer", root / "gen"
    for folder in (model, tokenizer, gen):
        folder.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(qwen3_dir / name, model / name)  # weights only: no tokenizer files
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_dir / name, tokenizer / name)
    (gen / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))  # greedy unless asked
    api = APIConfig(
        served_model_name=SERVED,
        tokenizer=str(tokenizer),
        chat_template=str(TEMPLATE),
        generation_config=str(gen),
    )
    redis = EmbeddedRedis().start()
    replica = ReplicaServer(
        ReplicaConfig(
            str(model),
            "compat-0",
            redis.url,
            engine=EngineConfig(num_kv_blocks=256, block_size=BLOCK, max_model_len=MAX_MODEL_LEN),
            api=api,
        )
    )
    await replica.start()
    router = RouterServer(
        RouterConfig(
            str(model),
            redis.url,
            block_size=BLOCK,
            max_model_len=MAX_MODEL_LEN,
            port=free_port(),
            http_port=free_port(),
            api=api,
        )
    )
    await router.start()
    while not router.registry.live():
        await asyncio.sleep(0.05)
    urls = {"router": f"http://127.0.0.1:{router.http_port}", "replica": replica.http_address}
    yield {"urls": urls, "router": router, "replica": replica, "tokenizer": tokenizer}
    await router.stop(grace=0.5)
    await replica.stop(grace=0.5)
    redis.close()


async def reference(compute, *args):
    """transformers' answer, computed off the event loop: the replica and router serve from
    this loop, and a reference that loads the model under load would hold it past the
    replica's heartbeat TTL (the router then answers 503, no live replica)."""
    return await asyncio.to_thread(compute, *args)


@pytest.fixture(params=["router", "replica"])
def base_url(request, servers) -> str:
    return servers["urls"][request.param]


@pytest_asyncio.fixture(loop_scope="module")
async def client(base_url):
    async with openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer(servers):
    return AutoTokenizer.from_pretrained(servers["tokenizer"], local_files_only=True)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def tokenize(base_url: str, prompt: str) -> list[int]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        return (await http.post("/tokenize", json={"prompt": prompt})).json()["tokens"]


# ---------------------------------------------------------------- names, defaults, limits


async def test_served_model_name_is_the_api_name(client, base_url):
    models = await client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    for name in (SERVED, "weights"):  # the served name, or the model id (the folder's name)
        reply = await client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert reply.model == SERVED
    with pytest.raises(openai.NotFoundError) as err:
        await client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert "not served here" in err.value.body["message"]


async def test_generation_config_defaults_apply_unless_the_request_sets_the_field(client):
    """The --generation-config folder's file says temperature 0: greedy by default."""
    common = {"model": SERVED, "prompt": PROMPT, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    defaults = [(await client.completions.create(**common)).choices[0].text for _ in range(2)]
    greedy = (await client.completions.create(temperature=0, **common)).choices[0].text
    sampled = [
        (await client.completions.create(temperature=1.5, seed=s, **common)).choices[0].text for s in (1, 2)
    ]
    assert defaults == [greedy, greedy]
    assert greedy not in sampled and sampled[0] != sampled[1]


async def test_chat_without_max_tokens_gets_the_rest_of_the_context(client):
    reply = await client.chat.completions.create(
        model=SERVED, messages=user("hi"), extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as err:  # an explicit value is checked, not changed
        await client.chat.completions.create(model=SERVED, messages=user("hi"), max_tokens=MAX_MODEL_LEN)
    assert err.value.body["param"] == "max_tokens"


# ---------------------------------------------------------------- sampling fields


async def test_logit_bias_repetition_penalty_min_tokens_stop_and_seed(
    client, base_url, qwen3_dir, hf_tokenizer
):
    ids = await tokenize(base_url, PROMPT)
    greedy_ids = await reference(hf_greedy, qwen3_dir, ids, 8)
    base = {"model": SERVED, "prompt": PROMPT, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    plain = (await client.completions.create(**base)).choices[0].text
    assert plain == hf_tokenizer.decode(greedy_ids)
    favourite = ids[5]
    biased = await client.completions.create(**base, logit_bias={str(favourite): 100}, logprobs=0)
    assert biased.choices[0].logprobs.tokens == [hf_tokenizer.decode([favourite])] * 8
    penalty = {"ignore_eos": True, "repetition_penalty": 50.0, "return_tokens_as_token_ids": True}
    penalised = await client.completions.create(**{**base, "extra_body": penalty}, logprobs=0)
    tokens = penalised.choices[0].logprobs.tokens
    assert tokens[0].startswith("token_id:") and len(set(tokens)) == len(
        tokens
    )  # seen tokens sink: no repeats
    assert not {int(t.split(":")[1]) for t in tokens} & set(ids)
    stop_on_first = {"stop_token_ids": [greedy_ids[0]]}
    stopped = await client.completions.create(**{**base, "extra_body": stop_on_first})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = await client.completions.create(**{**base, "extra_body": {**stop_on_first, "min_tokens": 5}})
    assert held.usage.completion_tokens >= 5
    stop = hf_tokenizer.decode([greedy_ids[3]])
    by_text = await client.completions.create(**base, stop=[stop])
    assert (
        by_text.choices[0].text == plain[: plain.index(stop)] and by_text.choices[0].finish_reason == "stop"
    )
    sampled = {
        **base,
        "temperature": 1.0,
        "top_p": 0.9,
        "seed": 11,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "extra_body": {"ignore_eos": True, "top_k": 50, "min_p": 0.01},
    }
    seeded = [(await client.completions.create(**sampled)).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


async def test_completion_logprobs_are_the_models_log_softmax(client, base_url, qwen3_dir, hf_tokenizer):
    reply = await client.completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=5, logprobs=3, temperature=0
    )
    ids = await tokenize(base_url, PROMPT)
    out_ids = await reference(hf_greedy, qwen3_dir, ids, 5)
    lp = reply.choices[0].logprobs
    assert lp.tokens == [hf_tokenizer.decode([t]) for t in out_ids]
    ref = await reference(hf_log_softmax, str(qwen3_dir), tuple(ids + out_ids))
    for i, (token, value, top) in enumerate(zip(out_ids, lp.token_logprobs, lp.top_logprobs, strict=True)):
        row = ref[len(ids) - 1 + i]
        assert abs(value - row[token].item()) < 1e-3
        assert len(top) == 3 and sorted(top.values(), reverse=True) == pytest.approx(
            row.topk(3).values.tolist(), abs=1e-3
        )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


async def test_echo_with_logprobs_and_no_generation_scores_the_prompt(client, base_url, qwen3_dir):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0."""
    reply = await client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    ids = await tokenize(base_url, PROMPT)
    choice = reply.choices[0]
    assert choice.text == PROMPT and reply.usage.completion_tokens == 0
    ref = await reference(hf_log_softmax, str(qwen3_dir), tuple(ids))
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(ids)
    for pos in range(1, len(ids)):
        assert abs(choice.logprobs.token_logprobs[pos] - ref[pos - 1][ids[pos]].item()) < 1e-3
    echoed = await client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith(PROMPT) and len(echoed.choices[0].text) > len(PROMPT)


async def test_prompt_logprobs_in_vllms_shape(client):
    reply = await client.completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    scored = reply.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == reply.usage.prompt_tokens
    for position in scored[1:]:
        assert 2 <= len(position) <= 3 and all(
            {"logprob", "rank", "decoded_token"} <= set(v) for v in position.values()
        )
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(
            model=SERVED, prompt=PROMPT, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 2}
        )
    assert err.value.body["param"] == "prompt_logprobs"


async def test_chat_logprobs_streamed_and_not(client):
    common = {
        "model": SERVED,
        "messages": user("hello"),
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 2,
    }
    reply = await client.chat.completions.create(**common, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert "".join(c.token for c in content) == reply.choices[0].message.content
    stream = await client.chat.completions.create(**common, stream=True, extra_body={"ignore_eos": True})
    streamed = [
        c
        async for chunk in stream
        for choice in chunk.choices
        if choice.logprobs
        for c in choice.logprobs.content
    ]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=SERVED, messages=user("hi"), top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"


# ---------------------------------------------------------------- choices and batches


async def test_n_choices_and_batch_prompts(client):
    reply = await client.completions.create(
        model=SERVED,
        prompt=PROMPT,
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) > 1  # seed + i per choice: not three copies
    assert reply.usage.completion_tokens == 18
    single = await client.completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    for prompts in (["one two three", "four five"], [[5, 6, 7, 8], [9, 10]]):  # texts, or token-id lists
        batch = await client.completions.create(
            model=SERVED, prompt=prompts, n=2, max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        for i, prompt in enumerate(prompts):
            alone = await client.completions.create(
                model=SERVED, prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True}
            )
            assert (
                batch.choices[2 * i].text == batch.choices[2 * i + 1].text == alone.choices[0].text
            )  # greedy
    stream = await client.chat.completions.create(
        model=SERVED, messages=user("hi"), n=2, max_tokens=3, stream=True, extra_body={"ignore_eos": True}
    )
    finished = [c.index async for chunk in stream for c in chunk.choices if c.finish_reason]
    assert sorted(finished) == [0, 1]


async def test_stream_options_usage_at_the_end_and_on_every_chunk(client):
    stream = await client.completions.create(
        model=SERVED,
        prompt=PROMPT,
        max_tokens=4,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    running = [c.usage.completion_tokens for c in chunks[:-1]]
    assert running == sorted(running) and running[-1] == 4 and all(c.usage for c in chunks)
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model=SERVED, prompt="x", stream_options={"include_usage": True})
    assert err.value.body["param"] == "stream_options"


# ---------------------------------------------------------------- chat templates


async def test_tools_documents_and_template_kwargs_reach_the_template(client, hf_tokenizer):
    messages = [
        {"role": "user", "content": "Weather in Paris?", "name": "ana"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ]
    documents = [{"title": "note", "text": "kvmesh routes by prefix"}]
    reply = await client.chat.completions.create(
        model=SERVED,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        parallel_tool_calls=True,
        max_tokens=1,
        extra_body={"documents": documents, "chat_template_kwargs": {"enable_thinking": False}},
    )
    hf_messages = [
        messages[0],
        {
            **messages[1],
            "content": "",
            "tool_calls": [
                {
                    **messages[1]["tool_calls"][0],
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        messages[2],
    ]
    expected = hf_tokenizer.apply_chat_template(
        hf_messages,
        tools=[WEATHER_TOOL],
        documents=documents,
        enable_thinking=False,
        chat_template=TEMPLATE.read_text(),
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<think>" in expected and "get_weather" in expected
    assert reply.usage.prompt_tokens == len(hf_tokenizer.encode(expected, add_special_tokens=False))
    plain = await client.chat.completions.create(model=SERVED, messages=messages, max_tokens=1)
    assert plain.usage.prompt_tokens < reply.usage.prompt_tokens


async def test_continue_final_message_with_echo(client):
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}]
    reply = await client.chat.completions.create(
        model=SERVED,
        messages=messages,
        max_tokens=3,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "echo": True,
            "ignore_eos": True,
        },
    )
    assert reply.choices[0].message.content.startswith("one, two,")
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model=SERVED, messages=messages, max_tokens=3, extra_body={"continue_final_message": True}
        )
    assert "cannot both be true" in err.value.body["message"]


async def test_template_errors_are_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=SERVED, messages=[{"role": "assistant", "content": "hi"}])
    assert "must start with a system or user message" in err.value.body["message"]


# ---------------------------------------------------------------- refusals and errors


REFUSALS = [
    (rule, endpoint)
    for rule in FIELD_RULES
    if rule.refused_example is not None
    for endpoint in ("completions", "chat")
    if rule.endpoints in ("both", endpoint)
]


@pytest.mark.parametrize(("rule", "endpoint"), REFUSALS, ids=[f"{r.name}-{e}" for r, e in REFUSALS])
async def test_unsupported_values_are_a_400_naming_the_field(client, rule, endpoint):
    body = {rule.name: rule.refused_example, "max_tokens": 1}
    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "chat":
            await client.chat.completions.create(model=SERVED, messages=user("hi"), extra_body=body)
        else:
            await client.completions.create(model=SERVED, prompt="hi", extra_body=body)
    assert err.value.body["param"] == rule.name and err.value.body["type"] == "invalid_request_error"
    assert err.value.body["code"] == 400


async def test_unknown_fields_are_accepted_and_logged_once(client, caplog):
    field = f"frobnicate_{id(client)}"
    with caplog.at_level(logging.WARNING, logger="kvmesh.serving.openai.protocol"):
        for _ in range(2):
            await client.completions.create(model=SERVED, prompt="hi", max_tokens=1, extra_body={field: 1})
    assert [r.field for r in caplog.records if getattr(r, "field", None) == field] == [field]


async def test_error_bodies_are_openais_shape(base_url):
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        bad_role = await http.post(
            "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}
        )
        not_utf8 = await http.post(
            "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"}
        )
        huge = await http.post(  # over the router's 4 MiB and the replica's 16 MiB
            "/v1/completions", content=b"x" * (17 << 20), headers={"content-type": "application/json"}
        )
        no_route = await http.get("/v1/nothing")
    for reply, status in ((bad_role, 400), (not_utf8, 400), (huge, 413), (no_route, 404)):
        assert reply.status_code == status, reply.text
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert bad_role.json()["error"]["param"] == "messages" and "role must be one of" in bad_role.text
    assert "UTF-8" in not_utf8.json()["error"]["message"]


@pytest.mark.parametrize("name", ["router", "replica"])
async def test_generation_routes_do_not_take_fastapis_way(servers, name):
    """The two routes every generation takes are served before FastAPI's routing: with
    FastAPI's own routes for them gone, they answer as before; its other routes still work."""
    app = servers[name].http.server.config.app.app  # inside the stalled-client guard
    hot = {"/v1/completions", "/v1/chat/completions"}
    taken = [route for route in app.router.routes if getattr(route, "path", None) in hot]
    assert len(taken) == 2
    app.router.routes[:] = [route for route in app.router.routes if route not in taken]
    try:
        async with httpx.AsyncClient(base_url=servers["urls"][name], timeout=60) as http:
            for stream in (False, True):
                text = await http.post(
                    "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": stream}
                )
                chat = await http.post(
                    "/v1/chat/completions",
                    json={"messages": user("hi"), "max_tokens": 2, "stream": stream},
                )
                assert text.status_code == chat.status_code == 200, (text.text, chat.text)
                assert ("data: [DONE]" in text.text) is stream and ("data: [DONE]" in chat.text) is stream
            unknown = await http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == 404
            assert (await http.get("/v1/models")).status_code == 200
    finally:
        app.router.routes.extend(taken)


async def test_tokenize_detokenize_and_version(base_url, hf_tokenizer):
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        tokens = (await http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True})).json()
        text = (await http.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
        chat = (await http.post("/tokenize", json={"messages": user("hi"), "tools": [WEATHER_TOOL]})).json()
        bare = (await http.post("/tokenize", json={"messages": user("hi")})).json()
        bad = await http.post("/detokenize", json={"tokens": [10**7]})
        served = (await http.get("/version")).json()
    assert text == {"prompt": hf_tokenizer.decode(tokens["tokens"])}
    assert tokens["token_strs"] == [hf_tokenizer.decode([t]) for t in tokens["tokens"]]
    assert chat["count"] > bare["count"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert served == {"version": version("kvmesh")}


# ---------------------------------------------------------------- gRPC


async def test_grpc_n_choices_logprobs_and_prefix_reuse(servers):
    """kvmesh.v1: choice indices, one Complete per choice, logprobs in the stream; the other
    choices reuse the first one's prefill (its full blocks are prefix hits)."""
    ids = list(range(10, 10 + 3 * BLOCK + 5))
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=9, logprobs=2, ignore_eos=True),
    )
    async with grpc.aio.insecure_channel(servers["router"].address) as channel:
        responses = [r async for r in pb_grpc.RouterStub(channel).Generate(request)]
    chunks = [r.chunk for r in responses if r.WhichOneof("kind") == "chunk"]
    completes = {r.complete.index: r.complete for r in responses if r.WhichOneof("kind") == "complete"}
    assert sorted(completes) == [0, 1, 2] and responses[-1].WhichOneof("kind") == "complete"
    for index in range(3):
        mine = [c for c in chunks if c.index == index]
        assert sum(len(c.token_ids) for c in mine) == 4 == completes[index].usage.completion_tokens
        assert all(
            len(c.logprobs) == len(c.token_ids) and all(len(e.top) == 2 for e in c.logprobs) for c in mine
        )
        assert mine[0].prompt_tokens == len(ids)
    full_blocks = (len(ids) - 1) // BLOCK * BLOCK
    assert completes[1].usage.cached_tokens >= full_blocks and completes[2].usage.cached_tokens >= full_blocks


async def test_grpc_chat_with_tools_is_tokenized_like_http(servers):
    chat = pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="weather?", name="ana")],
        tools_json=json.dumps([WEATHER_TOOL]),
        template_kwargs_json=json.dumps({"enable_thinking": False}),
    )
    request = pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_tokens=1))
    async with grpc.aio.insecure_channel(servers["router"].address) as channel:
        responses = [r async for r in pb_grpc.RouterStub(channel).Generate(request)]
    async with httpx.AsyncClient(base_url=servers["urls"]["replica"], timeout=60) as http:
        body = {
            "messages": [{"role": "user", "content": "weather?", "name": "ana"}],
            "tools": [WEATHER_TOOL],
            "chat_template_kwargs": {"enable_thinking": False},
        }
        tokens = (await http.post("/tokenize", json=body)).json()
    assert responses[-1].complete.usage.prompt_tokens == tokens["count"]
