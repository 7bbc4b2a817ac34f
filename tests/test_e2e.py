"""End to end: real Ray, real valkey-server, real gRPC and HTTP, 3 tiny-model replicas."""

import asyncio
import collections

import grpc
import openai
import pytest
import pytest_asyncio
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import eventually, local_router_config
from reference import hf_greedy, prompts_of_lengths

from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.cluster.launcher import LocalCluster
from kvmesh.cluster.node_drain import drain_sockets
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.drain_socket import local_sockets, pid_of
from kvmesh.router.policies import PrefixAware
from kvmesh.router.process import RouterServer
from kvmesh.serving.auth import bearer_metadata
from kvmesh.serving.metrics import read_samples

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.servers]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(ray_cluster, qwen3_dir):
    config = ClusterConfig.for_model(
        str(qwen3_dir),
        3,
        engine={"num_kv_blocks": 512, "max_num_seqs": 16},
        router={"port": 0, "http_port": 0},
        # the product's TTL (a 1.5 s one lapsed on 2 cores under the full suite's load)
        replica={"heartbeat_s": 0.2, "ttl_s": 3.0},
    )
    async with LocalCluster(config) as c:
        yield c


def greedy(ids, max_tokens=8, policy="", request_id="", affinity=""):
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=ids),
        sampling=sampling,
        policy=policy,
        affinity_key=affinity,
    )


async def call(cluster, request) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        return [r async for r in pb_grpc.RouterStub(channel).Generate(request, timeout=60)]


def complete(responses) -> pb.Complete:
    return next(r.complete for r in responses if r.WhichOneof("kind") == "complete")


async def test_router_streams_the_engines_greedy_tokens(cluster, qwen3_dir):
    prompt = prompts_of_lengths([45], salt=1)[0]
    responses = await call(cluster, greedy(prompt, max_tokens=12, request_id="e2e-1"))
    tokens = [t for r in responses if r.WhichOneof("kind") == "chunk" for t in r.chunk.token_ids]
    assert tokens == hf_greedy(qwen3_dir, prompt, 12)
    done = complete(responses)
    assert done.finish_reason == "length" and done.replica_id.startswith("replica-")
    assert done.usage.prompt_tokens == 45 and all(r.request_id == "e2e-1" for r in responses)


async def test_shared_prefix_lands_together_under_prefix_and_spreads_under_round_robin(cluster):
    shared = prompts_of_lengths([200], salt=2)[0]
    replicas, cached, predicted = set(), [], []
    for i in range(6):  # one after another, as a conversation would
        done = complete(await call(cluster, greedy(shared + [10 + i, 20 + i], policy="prefix")))
        replicas.add(done.replica_id)
        cached.append(done.usage.cached_tokens)
        predicted.append(done.predicted_cached_tokens)
    assert len(replicas) == 1
    assert cached[0] == 0 and all(c >= 192 for c in cached[1:])
    assert predicted[1:] == cached[1:]  # the index predicted exactly what the engine reused
    other = prompts_of_lengths([200], salt=3)[0]
    spread = {
        complete(await call(cluster, greedy(other + [i], policy="round_robin"))).replica_id for i in range(6)
    }
    assert len(spread) == 3


async def test_the_simulator_replays_a_real_run_with_the_costs_its_replicas_measured(cluster):
    """``kvmesh experiments --fidelity`` at the smallest scale: a real run, the replicas' step
    costs from their heartbeats as the simulator's model, the same requests simulated."""
    from kvmesh.bench.experiments import fidelity

    for i in range(12):  # every replica measures its costs (>= 32 steps each)
        complete(await call(cluster, greedy(prompts_of_lengths([40], salt=100 + i)[0], policy="round_robin")))
    (row,) = await fidelity.measure(cluster, ("shared_prefix",), (6.0,), 16, log=lambda _: None)
    assert row["errors"] == 0 and row["requests"] == 16
    assert row["cost_model"]["base_s"] != 0.006  # measured, not the prior
    assert row["cost_model"]["kv_tokens_per_replica"] == 512 * 16
    assert row["real"]["ttft_p90_ms"] > 0 and row["simulated"]["ttft_p90_ms"] > 0
    assert abs(row["hit_rate_error"]) <= 0.15, row  # 16 requests: only gross errors are real
    assert "shared_prefix 6/s" in fidelity.section([row], 60.0)


async def test_a_burst_sharing_one_new_prefix_is_not_piled_on_one_replica(cluster):
    shared = prompts_of_lengths([300], salt=4)[0]
    router = cluster.router
    assert await eventually(lambda: asyncio.sleep(0, result=len(router.registry.live()) == 3))
    burst = asyncio.gather(*(call(cluster, greedy(shared + [i, i + 1], max_tokens=24)) for i in range(30)))
    live = 3
    while not burst.done():  # on 2 busy cores a heartbeat can be late past the TTL
        live = min(live, len(router.registry.live()))
        await asyncio.sleep(0.01)
    placed = collections.Counter(complete(r).replica_id for r in await burst)
    assert sum(placed.values()) == 30 and len(placed) >= 2
    cap = PrefixAware().cap_of(29, live)  # the guard's cap for the last of 30: 18 of 30 on 3 replicas
    assert max(placed.values()) <= cap, (placed, live)


async def test_client_cancellation_frees_blocks_on_the_replica(cluster):
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stream = pb_grpc.RouterStub(channel).Generate(
            greedy(prompts_of_lengths([30], salt=5)[0], max_tokens=3000)
        )
        first = await stream.read()
        assert first.WhichOneof("kind") == "chunk"
        stream.cancel()
    assert await eventually(lambda: replicas_idle(cluster))


async def replica_stats(cluster, replica_id: str) -> pb.ReplicaStats:
    auth = bearer_metadata(cluster.config.replica.token())  # kvmesh up gave its replicas a token
    async with grpc.aio.insecure_channel(cluster.supervisor.addresses[replica_id]) as channel:
        return await pb_grpc.ReplicaStub(channel).GetStats(pb.GetStatsRequest(), metadata=auth)


async def replicas_idle(cluster) -> bool:
    """No replica runs anything or holds a block."""
    for replica_id in cluster.supervisor.addresses:
        s = await replica_stats(cluster, replica_id)
        if s.num_running or s.num_free_blocks != s.num_blocks:
            return False
    return True


async def test_http_client_that_goes_away_frees_the_replica_and_the_routers_load(cluster):
    import httpx

    body = {
        "prompt": prompts_of_lengths([30], salt=6)[0],
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    async with (
        httpx.AsyncClient(base_url=cluster.http_url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.aiter_lines()
        while not (await anext(lines)).startswith("data:"):
            pass  # the first event: the request is generating on a replica

    async def router_idle():
        return all(e.load.requests == 0 for e in cluster.router.registry.entries.values())

    assert await eventually(router_idle) and await eventually(lambda: replicas_idle(cluster))


async def test_abort_through_the_router(cluster):
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = pb_grpc.RouterStub(channel)
        stream = stub.Generate(
            greedy(prompts_of_lengths([30], salt=6)[0], max_tokens=3000, request_id="to-abort")
        )
        await stream.read()
        assert (await stub.Abort(pb.AbortRequest(request_id="to-abort"))).found
        rest = []
        while (r := await stream.read()) is not grpc.aio.EOF:
            rest.append(r)
        assert rest[-1].complete.finish_reason == "abort"
        assert not (await stub.Abort(pb.AbortRequest(request_id="unknown"))).found


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.GenerateRequest(), "no input"),
        (pb.GenerateRequest(text=""), "prompt is empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 10**6])), "outside the vocabulary"),
        (
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5] * 4090), sampling=pb.SamplingParams(max_tokens=16)
            ),
            "exceeds max_model_len",
        ),
        (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-2)), "temperature"),
        (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0)), "top_p"),
        (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
        (pb.GenerateRequest(text="hi", policy="fastest"), "unknown policy 'fastest'"),
        (pb.GenerateRequest(chat=pb.ChatMessages()), "chat has no messages"),
    ],
    ids=[
        "no-input",
        "empty",
        "vocab",
        "too-long",
        "temperature",
        "top-p",
        "max-tokens",
        "policy",
        "empty-chat",
    ],
)
async def test_bad_input_is_invalid_argument(cluster, request_, message):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(cluster, request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


async def test_model_info_replicas_health(cluster, qwen3_dir):
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = pb_grpc.RouterStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert (info.model, info.block_size, info.max_model_len, info.vocab_size) == ("qwen3", 16, 4096, 1024)
        listed = await stub.ListReplicas(pb.ListReplicasRequest())
        assert sorted(r.replica_id for r in listed.replicas) == ["replica-0", "replica-1", "replica-2"]
        assert all(r.address and r.num_blocks == 512 for r in listed.replicas)
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvmesh.v1.Router")
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_request_names_its_model_and_another_models_is_not_found(cluster):
    """gRPC names the model as OpenAI does: its served name, its id, or nothing; any other
    name is NOT_FOUND (OpenAI's 404) at the router and at a replica alike."""
    ids = prompts_of_lengths([20], salt=90)[0]
    named = greedy(ids)
    named.model = "qwen3"
    assert complete(await call(cluster, named)).finish_reason == "length"
    named.model = "llama-70b"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(cluster, named)
    assert (
        err.value.code() == grpc.StatusCode.NOT_FOUND
        and "'llama-70b' is not served here" in err.value.details()
    )
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.RouterStub(channel).GetModelInfo(pb.GetModelInfoRequest(model="llama-70b"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    replica = cluster.supervisor.addresses["replica-0"]
    async with grpc.aio.insecure_channel(replica) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            auth = bearer_metadata(cluster.config.replica.token())
            [r async for r in pb_grpc.ReplicaStub(channel).Generate(named, timeout=30, metadata=auth)]
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_openai_client_streams_through_http(cluster):
    client = openai.AsyncOpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["qwen3"]
    stream = await client.completions.create(
        model="qwen3",
        prompt="the cache block prefix",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert finish == "length" and usage.completion_tokens == 8 and "".join(texts)
    whole = await client.completions.create(
        model="qwen3",
        prompt="the cache block prefix",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].text == "".join(texts)
    chat = await client.chat.completions.create(
        model="qwen3", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 5
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await client.completions.create(model="qwen3", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="gpt-9", prompt="x")
    await client.close()


async def test_http_metrics_and_health(cluster):
    import httpx

    async with httpx.AsyncClient(base_url=cluster.http_url) as http:
        assert (await http.get("/health")).json()["replicas"] == 3
        text = (await http.get("/metrics")).text
        assert "kvmesh_router_requests_total" in text and "kvmesh_router_index_lookup_seconds_bucket" in text
        bad = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"})
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]


async def test_router_and_every_replica_serve_openai_http_and_tokenize_alike(cluster):
    import httpx

    body = {"model": "qwen3", "messages": [{"role": "user", "content": "a shared prefix, tokenized twice"}]}
    replica_token = {"Authorization": f"Bearer {cluster.config.replica.token()}"}  # kvmesh up made one
    async with httpx.AsyncClient(timeout=30) as http:
        routed = (await http.post(f"{cluster.http_url}/tokenize", json=body)).json()
        addresses = [e.record.fields["http_address"] for e in cluster.router.registry.live()]
        assert len(set(addresses)) == 3
        for address in addresses:
            tokenized = await http.post(f"{address}/tokenize", json=body, headers=replica_token)
            assert tokenized.json() == routed
            done = await http.post(
                f"{address}/v1/completions",
                json={"prompt": routed["tokens"], "max_tokens": 2},
                headers=replica_token,
            )
            assert done.json()["usage"]["prompt_tokens"] == routed["count"]


async def test_requests_are_served_while_redis_is_down(cluster):
    cluster.redis.stop()
    try:
        for i in range(4):
            done = complete(await call(cluster, greedy(prompts_of_lengths([40], salt=50 + i)[0])))
            assert done.finish_reason == "length"
    finally:
        cluster.redis.start()
    assert await eventually(lambda: _registry_ok(cluster), timeout=20)


async def _registry_ok(cluster) -> bool:
    await cluster.router.registry.refresh()
    return cluster.router.registry.index_ok and len(cluster.router.registry.live()) == 3


async def test_a_killed_replica_drops_out_and_is_replaced(cluster):
    victim = "replica-1"
    old_incarnation = next(
        e.record.incarnation for e in cluster.router.registry.live() if e.record.replica_id == victim
    )
    ray.kill(cluster.supervisor.actors[victim])
    for i in range(6):  # failover: every request still succeeds
        done = complete(
            await call(cluster, greedy(prompts_of_lengths([40], salt=80 + i)[0], policy="round_robin"))
        )
        assert done.finish_reason == "length"
    samples = read_samples(cluster.router.core.render_metrics().decode())
    assert (
        samples[
            ("kvmesh_router_decision_branches_total", (("branch", "failover"), ("policy", "round_robin")))
        ]
        >= 1
    )

    async def replaced():
        await cluster.router.registry.refresh()
        live = {e.record.replica_id: e.record.incarnation for e in cluster.router.registry.live()}
        return len(live) == 3 and live.get(victim, old_incarnation) != old_incarnation

    assert await eventually(replaced, timeout=180)  # a fresh Ray worker loads torch and the model
    assert cluster.supervisor.restarts >= 1
    samples = read_samples(cluster.router.core.render_metrics().decode())
    assert samples[("kvmesh_router_replica_restarts_total", (("replica", victim),))] >= 1  # a new process


async def test_a_node_drain_loses_no_request(cluster):
    """A Ray pod's preStop (kvmesh drain-replicas) with requests streaming and arriving: the
    drained replica leaves the index, finishes what it runs, refuses what comes late (the
    router retries it elsewhere) and exits; every request completes, and the supervisor
    starts a replacement."""
    router = cluster.router
    assert await eventually(lambda: asyncio.sleep(0, result=len(router.registry.live()) == 3))
    victim, restarts = "replica-0", cluster.supervisor.restarts
    prompts = prompts_of_lengths([40] * 24, salt=21)
    prefilled = (await replica_stats(cluster, victim)).prompt_tokens
    early = [
        asyncio.ensure_future(call(cluster, greedy(p, max_tokens=30, policy="round_robin")))
        for p in prompts[:12]
    ]

    async def victim_started() -> bool:  # a request routed to it may still be on its way
        return (await replica_stats(cluster, victim)).prompt_tokens > prefilled

    assert await eventually(victim_started, timeout=30)
    # This cluster's replica-0 alone: a node drain reaches every replica on the machine, and
    # another test's cluster (a parallel test worker's) has a replica-0 too.
    pid = await cluster.supervisor.actors[victim].pid.remote()
    drain = asyncio.ensure_future(drain_sockets([p for p in local_sockets() if pid_of(p) == pid], 60))
    late = [
        asyncio.ensure_future(call(cluster, greedy(p, max_tokens=30, policy="round_robin")))
        for p in prompts[12:]
    ]
    results = await asyncio.gather(*early, *late)
    assert await drain == ([victim], [])
    finished = [complete(r) for r in results]
    assert all(done.usage.completion_tokens == 30 for done in finished)
    assert {done.replica_id for done in finished[:12]} >= {victim}  # it was serving when drained

    async def replaced() -> bool:
        return cluster.supervisor.restarts > restarts and len(router.registry.live()) == 3

    assert await eventually(replaced, timeout=120)  # the supervisor started a replacement


async def test_no_live_replica_is_unavailable(ray_cluster, qwen3_dir):
    import httpx

    with EmbeddedRedis() as redis:
        router = RouterServer(local_router_config(qwen3_dir, redis.url))
        await router.start()
        try:
            async with grpc.aio.insecure_channel(router.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [r async for r in pb_grpc.RouterStub(channel).Generate(pb.GenerateRequest(text="hi"))]
                assert (
                    err.value.code() == grpc.StatusCode.UNAVAILABLE
                    and "no live replica" in err.value.details()
                )
                health = health_pb2_grpc.HealthStub(channel)
                ready = await health.Check(health_pb2.HealthCheckRequest(service="kvmesh.v1.Router"))
                assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING  # readiness: no replica
                alive = await health.Check(health_pb2.HealthCheckRequest(service=""))
                assert alive.status == health_pb2.HealthCheckResponse.SERVING  # liveness: the process is fine
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as http:
                assert (await http.get("/health")).status_code == 503
                r = await http.post("/v1/completions", json={"prompt": "hi"})
                assert r.status_code == 503 and "no live replica" in r.json()["error"]["message"]
        finally:
            await router.stop(grace=0.1)
