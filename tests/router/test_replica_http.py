"""Replicas speak OpenAI HTTP beside gRPC, so any OpenAI-compatible router can front them:
same engine, same tokenization as the router, usage with cached prompt tokens, vLLM-style
/tokenize, Prometheus /metrics, and the HTTP address registered in the index."""

import itertools
import json
import socket

import grpc
import httpx
import pytest
import pytest_asyncio

from kvmesh.cli import status
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine.config import EngineConfig
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.serving.metrics import read_samples
from kvmesh.serving.tokenizer import PromptTokenizer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.servers]

PROMPT = "the quick brown fox jumps over the lazy dog " * 6


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replica(qwen3_dir):
    redis = EmbeddedRedis().start()
    server = ReplicaServer(
        ReplicaConfig(str(qwen3_dir), "http-0", redis.url, engine=EngineConfig(num_kv_blocks=128))
    )
    await server.start()
    async with httpx.AsyncClient(base_url=server.http_address, timeout=60) as http:
        yield server, http, redis
    await server.stop(grace=0.5)
    redis.close()


async def grpc_text(address: str, prompt: str, max_tokens: int) -> str:
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ReplicaStub(channel)
        responses = [r async for r in stub.Generate(pb.GenerateRequest(text=prompt, sampling=sampling))]
    return "".join(r.chunk.text for r in responses if r.WhichOneof("kind") == "chunk")


async def test_http_connections_send_without_nagle(replica):
    """Accepted connections have TCP_NODELAY: with Nagle on, a response written in two parts
    (headers, body) waited out the client's delayed ACK, 40 ms per request on Linux."""
    server, http, _ = replica
    assert (await http.get("/health")).status_code == 200  # a keep-alive connection is open now
    connections = server.http.server.server_state.connections
    sockets = [c.transport.get_extra_info("socket") for c in connections]
    assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)


async def test_health_models_and_tokenize_match_the_router_tokenizer(replica, qwen3_dir):
    server, http, _ = replica
    assert (await http.get("/health")).json() == {"status": "ok", "replica_id": "http-0"}
    card = (await http.get("/v1/models")).json()["data"][0]
    assert card["id"] == server.engine.engine.model_id
    assert card["max_model_len"] == server.engine.engine.max_model_len
    tokenizer = PromptTokenizer(qwen3_dir)
    reply = (await http.post("/tokenize", json={"model": card["id"], "prompt": PROMPT})).json()
    assert reply["tokens"] == tokenizer.encode(PROMPT)
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == card["max_model_len"]
    messages = [{"role": "user", "content": "hello there"}]
    chat = (await http.post("/tokenize", json={"messages": messages})).json()
    assert chat["tokens"] == tokenizer.render_chat(messages)


async def test_completion_matches_grpc_and_reports_cached_tokens(replica):
    server, http, _ = replica
    expected = await grpc_text(server.address, PROMPT, 8)  # also warms the prefix cache
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = (await http.post("/v1/completions", json=body)).json()
    assert reply["choices"][0]["text"] == expected
    usage = reply["usage"]
    assert usage["completion_tokens"] == 8
    prompt_tokens = usage["prompt_tokens"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    block = server.engine.engine.block_size
    assert cached == (prompt_tokens - 1) // block * block > 0  # every full block but the last token's
    assert reply["kvmesh"]["replica_id"] == "http-0"


async def test_streaming_chat_and_completion(replica):
    _, http, _ = replica
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["usage"]["completion_tokens"] == 5
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    body = {"prompt": "abc", "max_tokens": 4, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        text_events = [line async for line in response.aiter_lines() if line.startswith("data: {")]
    assert len(text_events) >= 2  # tokens as they come, then the finish


async def test_chat_content_parts_are_the_same_as_a_string(replica):
    """guidellm's chat mode (and the OpenAI SDK) send content as a list of text parts."""
    _, http, _ = replica
    common = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = [{"role": "user", "content": "hello there friend"}]
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there friend"}],
        }
    ]
    a = (await http.post("/v1/chat/completions", json={"messages": plain, **common})).json()
    b = (await http.post("/v1/chat/completions", json={"messages": parts, **common})).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]


async def test_peer_router_metadata_and_render(replica, qwen3_dir):
    """What sglang-router (/server_info) and vllm-router's cache_aware (render) ask workers for."""
    server, http, _ = replica
    for path in ("/server_info", "/get_server_info"):
        info = (await http.get(path)).json()
        assert info["served_model_name"] == server.engine.engine.model_id
        assert info["page_size"] == server.engine.engine.block_size
    tokenizer = PromptTokenizer(qwen3_dir)
    rendered = (await http.post("/v1/completions/render", json={"prompt": PROMPT})).json()
    assert rendered == [{"token_ids": tokenizer.encode(PROMPT)}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = (await http.post("/v1/chat/completions/render", json={"messages": messages})).json()
    assert rendered == [{"token_ids": tokenizer.render_chat(messages)}]


@pytest.mark.parametrize(
    ("path", "body", "status_code", "needle"),
    [
        ("/v1/completions", {"prompt": [10**6], "max_tokens": 2}, 400, "outside the vocabulary"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "above the limit"),
        ("/v1/completions", {"prompt": "x", "model": "other"}, 404, "not served here"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/tokenize", {"model": "x"}, 404, "not served here"),
        ("/tokenize", {}, 400, "prompt or messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "only text content parts",
        ),
        ("/v1/completions/render", {"prompt": [10**6]}, 400, "outside the vocabulary"),
    ],
)
async def test_bad_input_is_a_clean_http_error(replica, path, body, status_code, needle):
    _, http, _ = replica
    reply = await http.post(path, json=body)
    assert reply.status_code == status_code, reply.text
    assert needle in reply.json()["error"]["message"]


async def scrape(http) -> dict[str, float]:
    """Sample name (labels but model_name) -> value."""
    samples = read_samples((await http.get("/metrics")).text)
    return {
        name + "".join(f'{{{k}="{v}"}}' for k, v in labels): value
        for (name, labels), value in samples.items()
    }


async def test_metrics_count_requests_cached_tokens_and_engine_state(replica):
    """Counted from this test's own requests (the module's other tests may run elsewhere):
    the same prompt twice (the second one cached) and one refused."""
    _, http, _ = replica
    await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert (await http.post("/v1/completions", json={"prompt": [10**6], "max_tokens": 2})).status_code == 400
    before = await scrape(http)
    usage = (await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})).json()["usage"]
    samples = await scrape(http)
    for name, expected in (
        ("kvmesh_replica_finished_prompt_tokens_total", usage["prompt_tokens"]),
        ("kvmesh_replica_cached_prompt_tokens_total", usage["prompt_tokens_details"]["cached_tokens"]),
    ):
        assert samples[name] - before.get(name, 0) == expected, name  # what bench peers relies on
    assert samples['kvmesh_replica_requests_total{outcome="ok"}'] >= 2
    assert samples['kvmesh_replica_requests_total{outcome="invalid_argument"}'] >= 1
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert samples["kvmesh_replica_kv_blocks"] == 128
    # vLLM's names and semantics, so vLLM's dashboards and autoscalers read a kvmesh replica
    assert samples["vllm:prefix_cache_hits_total"] > 0
    assert samples["vllm:prefix_cache_queries_total"] >= samples["vllm:prefix_cache_hits_total"]
    assert samples["vllm:time_to_first_token_seconds_count"] >= 2
    assert samples['vllm:request_success_total{finished_reason="length"}'] >= 1
    assert (
        samples["vllm:request_generation_tokens_sum"] - before.get("vllm:request_generation_tokens_sum", 0)
        == 2
    )
    assert (
        samples["vllm:inter_token_latency_seconds_count"]
        - before.get("vllm:inter_token_latency_seconds_count", 0)
        == 1
    )
    assert 0 <= samples["vllm:kv_cache_usage_perc"] <= 1
    assert samples["vllm:num_requests_running"] == 0
    assert samples["process_resident_memory_bytes"] > 0
    text = (await http.get("/metrics")).text
    assert 'model_name="' in text and 'le="2560.0"' in text  # vLLM's TTFT buckets


async def test_http_address_is_registered_and_shown_by_status(replica):
    server, _, redis = replica
    models = await status.from_index(redis.url)
    (record,) = models[0]["replicas"]
    assert record["http_address"] == server.http_address
    table = status.render(models)
    assert server.address in table and server.http_address in table


async def test_closed_loop_conversations_resend_what_the_server_answered(replica, qwen3_dir):
    """Multi-turn chat as the peers sweep drives it: each turn's prompt carries the answer the
    server gave, so from turn 2 on the replica reuses the previous turn's prompt and answer."""
    from kvmesh.bench.measure import workloads as wl
    from kvmesh.bench.measure.loadgen import run_http_conversations
    from kvmesh.bench.measure.text_workload import segment_text, word_table

    server, http, _ = replica
    model = (await http.get("/v1/models")).json()["data"][0]["id"]
    chats = wl.conversations(
        wl.multi_turn(num_sessions=3, turns=3, system_prompt_len=48, user_len=16, answer_len=8, seed=4)
    )
    words = word_table(qwen3_dir)
    records = await run_http_conversations(
        server.http_address, chats, lambda segment: segment_text(segment, words), "chat", model, concurrency=2
    )
    assert len(records) == 9 and not [r.error for r in records if r.error]
    assert all(r.completion_tokens == 8 for r in records)
    for session in ("s0", "s1", "s2"):
        turns = sorted((r for r in records if r.group == session), key=lambda r: r.sent_s)
        assert len(turns) == 3
        for before, after in itertools.pairwise(turns):
            assert after.prompt_tokens > before.prompt_tokens + 8 + 16 - 1  # it carries the answer
            assert after.cached_tokens >= before.prompt_tokens // 16 * 16  # and reuses the last turn
