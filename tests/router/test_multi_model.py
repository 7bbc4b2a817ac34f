"""One router, two models: a tiny Qwen3 and a tiny Llama with a tokenizer of its own, each with
its own replica, block size and index, behind the same gRPC and OpenAI ports."""

import asyncio

import grpc
import httpx
import pytest
import pytest_asyncio
from conftest import tiny_model_dir
from helpers import eventually, local_router_config

from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine.config import EngineConfig
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.process import RouterServer
from kvmesh.serving.metrics import read_samples

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.servers]

TEXT = "a system prompt both models are sent, word for word, and then some more of it " * 3


def llama_replica(llama_dir, redis_url: str, name: str = "llama-0") -> ReplicaServer:
    engine = EngineConfig(num_kv_blocks=128, block_size=32)  # its own block size, learned by the router
    return ReplicaServer(
        ReplicaConfig(str(llama_dir), name, redis_url, model_id="llama", http_port=-1, engine=engine)
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two_models(qwen3_dir):
    llama_dir = tiny_model_dir("llama", vocab_size=640, seed=1)  # another tokenizer than Qwen3's
    redis = EmbeddedRedis().start()
    qwen = ReplicaServer(
        ReplicaConfig(
            str(qwen3_dir), "qwen3-0", redis.url, http_port=-1, engine=EngineConfig(num_kv_blocks=128)
        )
    )
    llama = llama_replica(llama_dir, redis.url)
    await asyncio.gather(qwen.start(), llama.start())
    router = RouterServer(
        [
            local_router_config(qwen3_dir, redis.url),
            local_router_config(llama_dir, redis.url, model_id="llama", block_size=None),
        ]
    )
    await router.start()
    for route in router.models.routes:
        assert await eventually(lambda r=route: _live(r, 1), timeout=30)
    state = {"router": router, "redis": redis, "llama_dir": llama_dir, "replicas": [qwen, llama]}
    yield state
    await router.stop(grace=0.5)
    for replica in state["replicas"]:
        await replica.stop(grace=0.5)
    redis.close()


async def _live(route, n: int) -> bool:
    if route.core is None:
        return False
    await route.registry.refresh()
    return len(route.registry.live()) == n


async def _generate(router: RouterServer, model: str, text: str = TEXT) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(router.address) as channel:
        request = pb.GenerateRequest(
            text=text, model=model, sampling=pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        )
        return [r async for r in pb_grpc.RouterStub(channel).Generate(request, timeout=60)]


def _http(router: RouterServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=60)


async def test_models_lists_both_and_each_request_goes_to_its_models_replica(two_models):
    router = two_models["router"]
    async with _http(router) as http:
        cards = (await http.get("/v1/models")).json()["data"]
        assert {c["id"]: (c["owned_by"], c["max_model_len"]) for c in cards} == {
            "qwen3": ("kvmesh", 4096),
            "llama": ("kvmesh", 4096),
        }
        for model in ("qwen3", "llama"):
            body = {"model": model, "prompt": "hello there", "max_tokens": 2, "temperature": 0}
            reply = await http.post("/v1/completions", json=body)
            assert reply.status_code == 200 and reply.json()["model"] == model
    for model in ("qwen3", "llama"):
        assert (await _generate(router, model))[-1].complete.replica_id == f"{model}-0"
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = pb_grpc.RouterStub(channel)
        llama = await stub.GetModelInfo(pb.GetModelInfoRequest(model="llama"), timeout=10)
        qwen = await stub.GetModelInfo(pb.GetModelInfoRequest(model="qwen3"), timeout=10)
        listed = await stub.ListReplicas(pb.ListReplicasRequest(), timeout=10)
        only = await stub.ListReplicas(pb.ListReplicasRequest(model="llama"), timeout=10)
    assert (llama.block_size, qwen.block_size) == (32, 16)  # each model's own, llama's learned
    assert llama.vocab_size != qwen.vocab_size
    assert {(r.replica_id, r.model) for r in listed.replicas} == {("qwen3-0", "qwen3"), ("llama-0", "llama")}
    assert [r.replica_id for r in only.replicas] == ["llama-0"]


async def test_a_prefix_shared_in_text_never_crosses_models(two_models):
    router = two_models["router"]
    async with _http(router) as http:
        ids = {
            m: (await http.post("/tokenize", json={"model": m, "prompt": TEXT})).json()["tokens"]
            for m in ("qwen3", "llama")
        }
    assert ids["qwen3"] != ids["llama"]  # two tokenizers
    text = "never before seen, " + TEXT
    await _generate(router, "qwen3", text)
    again = (await _generate(router, "qwen3", text))[-1].complete
    assert again.usage.cached_tokens >= 32  # qwen3 holds the prefix now
    other = (await _generate(router, "llama", text))[-1].complete
    assert other.usage.cached_tokens == 0 and other.predicted_cached_tokens == 0


async def test_unknown_or_unnamed_models_are_refused_with_the_names_served(two_models):
    router = two_models["router"]
    async with _http(router) as http:
        unknown = await http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x", "max_tokens": 1})
        unnamed = await http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert "qwen3, llama" in unknown.json()["error"]["message"]
    assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "model"
    for model, code in (("gpt-9", grpc.StatusCode.NOT_FOUND), ("", grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _generate(router, model)
        assert refused.value.code() == code


async def test_metrics_are_per_model(two_models):
    router = two_models["router"]
    before = read_samples(router.models.render_metrics().decode())
    await _generate(router, "llama")
    text = router.models.render_metrics().decode()
    assert text.count("# TYPE kvmesh_router_requests_total counter") == 1  # one family, two models
    after = read_samples(text)
    key = ("kvmesh_router_routing_decisions_total", (("replica", "llama-0"),))
    assert after[key] == before.get(key, 0) + 1
    assert 'kvmesh_router_live_replicas{model_name="llama"} 1.0' in text
    assert 'kvmesh_router_live_replicas{model_name="qwen3"} 1.0' in text
    assert 'kvmesh_router_requests_total{model_name="llama",outcome="ok",policy="prefix"}' in text


async def test_a_model_whose_replicas_leave_and_return_leaves_and_rejoins_the_list(two_models):
    """A worker group scaled to zero, then up again: /v1/models follows, no router restart."""
    router, redis = two_models["router"], two_models["redis"]
    llama_route = router.models.route("llama")
    old = two_models["replicas"].pop()
    await old.stop(grace=0.5)  # it deregisters as it stops
    assert await eventually(lambda: _live(llama_route, 0), timeout=15)
    async with _http(router) as http:
        assert [c["id"] for c in (await http.get("/v1/models")).json()["data"]] == ["qwen3"]
        gone = await http.post("/v1/completions", json={"model": "llama", "prompt": "x", "max_tokens": 1})
        assert gone.status_code == 503
        assert (await http.get("/health")).json()["models"] == {"qwen3": 1, "llama": 0}
        back = llama_replica(two_models["llama_dir"], redis.url, "llama-1")
        two_models["replicas"].append(back)
        await back.start()
        assert await eventually(lambda: _live(llama_route, 1), timeout=15)
        assert {c["id"] for c in (await http.get("/v1/models")).json()["data"]} == {"qwen3", "llama"}
    assert (await _generate(router, "llama"))[-1].complete.replica_id == "llama-1"
