"""Engines outlive their controller: replicas are named, detached actors; a new supervisor
re-attaches to live ones with its settings (no model reload) and replaces the rest; a failed
start is retried with backoff and shown in the index; a replica whose engine broke is
replaced (replacements run in parallel, and the watch survives its own errors); a
controller process killed and restarted under load costs no request."""

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import ray
from helpers import eventually, live_replicas_are, local_router_config
from reference import prompts_of_lengths

from kvmesh.cluster.supervisor import RAY_NAMESPACE, ReplicaStartError, Supervisor
from kvmesh.engine.config import EngineConfig
from kvmesh.kvcache import namespace_seed
from kvmesh.kvcache.index.redis import RedisPrefixIndex
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.router.process import RouterServer

pytestmark = pytest.mark.servers
KVMESH = str(Path(sys.executable).with_name("kvmesh"))


def template(qwen3_dir, redis_url: str, model_id: str, **engine) -> ReplicaConfig:
    engine = EngineConfig(num_kv_blocks=64, block_size=16, **engine)
    return ReplicaConfig(
        str(qwen3_dir), redis_url=redis_url, model_id=model_id, heartbeat_s=0.2, engine=engine
    )


def index_for(redis_url: str, model_id: str) -> RedisPrefixIndex:
    return RedisPrefixIndex.from_url(redis_url, model_id, 16, namespace_seed(model_id, 16))


@pytest.mark.heavy  # the supervisor over real Ray actors: a deployment's worth of set-up
async def test_a_new_supervisor_reattaches_and_replaces_only_what_changed(
    ray_cluster, qwen3_dir, valkey_server
):
    index = index_for(valkey_server.url, "reattach")
    first = Supervisor(template(qwen3_dir, valkey_server.url, "reattach"), 1, False, index, check_s=0.2)
    await first.start()
    pid = await first.actors["replica-0"].pid.remote()
    await first.stop(grace=1, keep_replicas=True)  # the controller goes; the engine stays

    second = Supervisor(template(qwen3_dir, valkey_server.url, "reattach"), 1, False, index, check_s=0.2)
    await second.start()
    assert second.reattached == 1 and await second.actors["replica-0"].pid.remote() == pid
    await second.stop(grace=1, keep_replicas=True)

    changed = Supervisor(
        template(qwen3_dir, valkey_server.url, "reattach", max_num_seqs=3), 1, False, index, check_s=0.2
    )
    await changed.start()  # other settings: the old engine is replaced
    assert changed.reattached == 0 and await changed.actors["replica-0"].pid.remote() != pid
    await changed.stop(grace=1)
    assert not any(a["name"].startswith("reattach/") for a in ray.util.list_named_actors(all_namespaces=True))
    await index.close()


@pytest.mark.heavy  # the supervisor over real Ray actors: a deployment's worth of set-up
async def test_a_models_replicas_run_only_where_its_ray_resource_is(ray_cluster, qwen3_dir, valkey_server):
    """Each model's worker group offers a Ray resource of its own (the chart): its replicas
    take one each, so they land on its nodes (the only ones with its model folder) or wait."""
    index = index_for(valkey_server.url, "placed")
    placed = Supervisor(
        template(qwen3_dir, valkey_server.url, "placed"), 1, False, index, ray_resource="kvmesh-model-test"
    )
    await placed.start()
    assert ray.available_resources().get("kvmesh-model-test", 0) == 0  # it holds the node's one
    elsewhere = Supervisor(
        template(qwen3_dir, valkey_server.url, "elsewhere"),
        1,
        False,
        index_for(valkey_server.url, "elsewhere"),
        start_timeout_s=3,
        ray_resource="kvmesh-model-absent",
    )
    with pytest.raises(ReplicaStartError, match="replica-0"):
        await elsewhere.start()  # no node offers it: the actor waits, unplaced
    Supervisor._kill(elsewhere.slots["replica-0"].actor)
    await placed.stop(grace=1)

    async def freed() -> bool:
        return ray.available_resources().get("kvmesh-model-test", 0) == 1

    assert await eventually(freed)
    await index.close()


@pytest.mark.heavy  # the supervisor over real Ray actors: a deployment's worth of set-up
async def test_a_failed_restart_is_retried_with_backoff_and_reported(ray_cluster, qwen3_dir, valkey_server):
    index = index_for(valkey_server.url, "backoff")
    sup = Supervisor(
        template(qwen3_dir, valkey_server.url, "backoff"), 1, False, index, check_s=0.2, backoff_s=(0.5, 5)
    )
    await sup.start()
    launch, failures = sup._launch, []

    async def fails_once(slot):  # fault injection: the first replacement cannot start
        if not failures:
            failures.append(slot.replica_id)
            raise ray.exceptions.RaySystemError("injected: no room on the node")
        await launch(slot)

    sup._launch = fails_once
    ray.kill(sup.actors["replica-0"])

    async def reported_waiting():
        state = json.loads(await index.controller_state() or "{}").get("replica-0", {})
        return state.get("state") == "waiting" and state.get("failures") == 1 and "no room" in state["error"]

    assert await eventually(reported_waiting, timeout=30)
    assert await eventually(
        lambda: asyncio.sleep(0, result=sup.slots["replica-0"].state == "ready"), timeout=60
    )
    state = json.loads(await index.controller_state())["replica-0"]
    assert state["state"] == "ready" and state["failures"] == 0 and sup.restarts == 1
    await sup.stop(grace=1)
    await index.close()


@pytest.mark.heavy  # the supervisor over real Ray actors: a deployment's worth of set-up
async def test_a_broken_engine_is_replaced_in_parallel_and_the_watch_survives_errors(
    ray_cluster, qwen3_dir, valkey_server
):
    index = index_for(valkey_server.url, "broken")
    sup = Supervisor(template(qwen3_dir, valkey_server.url, "broken"), 2, False, index, check_s=0.2)
    await sup.start()
    old = {rid: await actor.pid.remote() for rid, actor in sup.actors.items()}
    publish, launch = sup._publish, sup._launch

    async def publish_fails_once():  # fault injection: one check hits an unexpected error
        if not sup.watch_errors:
            raise RuntimeError("injected: a bug in one check")
        await publish()

    spans = []

    async def slow_launch(slot):  # each start takes 2 s more
        began = asyncio.get_running_loop().time()
        await asyncio.sleep(2.0)
        await launch(slot)
        spans.append((began, asyncio.get_running_loop().time()))

    sup._publish, sup._launch = publish_fails_once, slow_launch
    # Both engines break: every forward fails, as on a device that stays unusable.
    for rid, actor in sup.actors.items():
        await actor.inject_forward_failure.remote()
        async with grpc.aio.insecure_channel(sup.addresses[rid]) as channel:
            for i in range(3):  # three failed steps in a row: the engine is broken
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    request = pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=[3, 4, 5 + i]), sampling=pb.SamplingParams(max_tokens=2)
                    )
                    [r async for r in pb_grpc.ReplicaStub(channel).Generate(request, timeout=30)]
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    async def both_replaced():
        return all(s.state == "ready" for s in sup.slots.values()) and sup.restarts == 2

    assert await eventually(both_replaced, timeout=60)
    assert sup.watch_errors >= 1  # the check that failed was counted, and checks went on
    new = {rid: await actor.pid.remote() for rid, actor in sup.actors.items()}
    assert all(new[rid] != old[rid] for rid in old)
    (_, first_ended), (second_began, _) = sorted(spans)
    assert second_began < first_ended  # the two starts ran at the same time, not one after the other
    for rid in sup.actors:
        assert (await sup.actors[rid].health.remote())["status"] == "ok"
    await sup.stop(grace=1)
    await index.close()


@pytest.mark.heavy  # the supervisor over real Ray actors: a deployment's worth of set-up
async def test_controller_killed_and_restarted_under_load_loses_no_request(
    ray_cluster, qwen3_dir, valkey_server, tmp_path
):
    gcs = ray.get_runtime_context().gcs_address
    token = tmp_path / "replica-token"  # the chart's Secret file: the same for every controller
    token.write_text("replica-t0ken\n")
    argv = [
        KVMESH,
        "up",
        "--no-router",
        "--keep-replicas",
        "--ray-address",
        gcs,
        "--redis-url",
        valkey_server.url,
        "--replica-api-key-file",
        str(token),
        "--model",
        str(qwen3_dir),
        "--model-id",
        "outlive",
        "--replicas",
        "2",
        "--num-kv-blocks",
        "64",
        "--heartbeat-interval",
        "0.2",
        "--deployment",
        "default",  # fixed, as the chart's: the router's too
    ]

    def controller() -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        text = ""
        while "Ctrl-C" not in text:
            line = proc.stdout.readline()
            assert line, text + proc.stderr.read()
            text += line
        return proc

    first = await asyncio.to_thread(controller)
    router = RouterServer(
        local_router_config(
            qwen3_dir, valkey_server.url, model_id="outlive", http_port=-1, replica_api_key_file=str(token)
        )
    )
    await router.start()
    index = index_for(valkey_server.url, "outlive")
    try:
        await eventually(lambda: live_replicas_are(router, 2), timeout=30)
        before = {r.replica_id: r.incarnation for r in await index.live_replicas()}
        results, stop = [], asyncio.Event()

        async def client(salt: int):
            async with grpc.aio.insecure_channel(router.address) as channel:
                i = 0
                while not stop.is_set():
                    request = pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=prompts_of_lengths([24], salt=salt * 1000 + i)[0]),
                        sampling=pb.SamplingParams(temperature=0, max_tokens=4),
                    )
                    try:
                        [r async for r in pb_grpc.RouterStub(channel).Generate(request, timeout=60)]
                        results.append("OK")
                    except grpc.aio.AioRpcError as exc:
                        results.append(exc.code().name)
                    i += 1

        clients = [asyncio.create_task(client(n)) for n in range(3)]
        await asyncio.sleep(1.0)
        first.send_signal(signal.SIGKILL)  # no goodbye: the driver's process is gone
        first.wait(timeout=30)
        await asyncio.sleep(1.0)
        second = await asyncio.to_thread(controller)
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*clients)
        after = {r.replica_id: r.incarnation for r in await index.live_replicas()}
        assert results and set(results) == {"OK"}, results
        assert after == before  # the same engines, never reloaded nor re-registered
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=60) == 0
    finally:
        await router.stop(grace=1)
        await index.close()
        for proc in (first, locals().get("second")):
            if proc is not None and proc.poll() is None:
                proc.kill()
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == RAY_NAMESPACE and entry["name"].startswith("outlive/"):
                ray.kill(ray.get_actor(entry["name"], namespace=RAY_NAMESPACE))


def test_placement_and_reachability_fail_in_one_line(qwen3_dir):
    from kvmesh.cluster.errors import UsageError
    from kvmesh.cluster.launcher import check_gpus

    with pytest.raises(
        UsageError, match="2 replicas need one GPU each and this machine has 1: use --replicas 1"
    ):
        check_gpus(2, 1.0, local=True, progress=print)
    seen = []
    check_gpus(2, 1.0, local=False, progress=seen.append)  # an autoscaler may add the GPU
    assert seen and "waiting for GPUs" in seen[0]
    out = subprocess.run(
        [KVMESH, "up", "--model", str(qwen3_dir), "--ray-address", "ray://kvmesh-head:10001"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "give --redis-url of a Redis they can reach" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("address, calls", [("ray://head:10001", 2), (None, 1)])
def test_a_ray_client_start_failure_is_tried_again_only_for_ray_client_addresses(
    monkeypatch, qwen3_dir, address, calls
):
    """Ray's client proxier sometimes loses the server it spawned for a new client
    ("Initialization failure from server ... ZombieProcess"); a second connection works."""
    from kvmesh.cluster import launcher
    from kvmesh.cluster.config import ClusterConfig

    tried = []
    REMOTE = "redis://10.0.0.9:6379"

    def flaky_init(**kwargs):
        tried.append(kwargs["address"])
        if len(tried) == 1:
            raise ConnectionAbortedError("Initialization failure from server: ZombieProcess")

    monkeypatch.setattr(launcher.ray, "init", flaky_init)
    no_wait = asyncio.sleep
    monkeypatch.setattr(launcher.asyncio, "sleep", lambda seconds: no_wait(0))
    config = ClusterConfig.for_model(
        str(qwen3_dir),
        1,
        ray_address=address,
        router={"redis_url": REMOTE},
        replica={"redis_url": REMOTE, "api_key_file": "/run/secrets/kvmesh/replica-token"},
    )
    cluster = launcher.LocalCluster(config)
    if calls == 1:
        with pytest.raises(ConnectionAbortedError):
            asyncio.run(cluster._init_ray())
    else:
        asyncio.run(cluster._init_ray())
    assert len(tried) == calls
