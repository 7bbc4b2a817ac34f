"""Every door of a replica tried without credentials, as an attacker inside the cluster
would: each gRPC method and each HTTP route refuses, health and the metrics ports stay open
(probes and scrapers hold no inference token), the router gets through with the token it
presents, and a replica will not listen beyond loopback without one."""

import grpc
import httpx
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import local_router_config, started_router

from kvmesh.cluster.embedded_redis import free_port
from kvmesh.engine.config import EngineConfig
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.process import RouterServer

pytestmark = pytest.mark.servers
module_loop = pytest.mark.asyncio(loop_scope="module")  # the servers live for the module
REPLICA_TOKEN, CLIENT_TOKEN = "replica-t0ken-1", "client-t0ken-2"
REPLICA_METHODS = pb.DESCRIPTOR.services_by_name["Replica"].methods


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def doors(qwen3_dir, valkey_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokens")
    (folder / "replica").write_text(REPLICA_TOKEN)
    (folder / "client").write_text(CLIENT_TOKEN)
    replica = ReplicaServer(
        ReplicaConfig(
            str(qwen3_dir),
            "door-0",
            valkey_server.url,
            deployment="doors",
            heartbeat_s=0.2,
            api_key_file=str(folder / "replica"),
            pod_metrics_port=free_port(),
            max_message_bytes=1 << 20,
            engine=EngineConfig(num_kv_blocks=64),
        )
    )
    await replica.start()
    router = RouterServer(
        local_router_config(
            qwen3_dir,
            valkey_server.url,
            deployment="doors",
            metrics_port=0,
            api_key_file=str(folder / "client"),
            replica_api_key_file=str(folder / "replica"),
        )
    )
    await started_router(router)
    yield router, replica
    await router.stop(grace=0.5)
    await replica.stop(grace=0.5)


async def call(stub, name: str, metadata) -> grpc.StatusCode:
    request = getattr(pb, REPLICA_METHODS[[m.name for m in REPLICA_METHODS].index(name)].input_type.name)()
    if name == "Generate":
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_tokens=1)
        )
    try:
        reply = getattr(stub, name)(request, metadata=metadata, timeout=30)
        if isinstance(reply, grpc.aio.UnaryStreamCall):
            [r async for r in reply]
        else:
            await reply
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("name", [m.name for m in REPLICA_METHODS])
@module_loop
async def test_every_replica_method_refuses_without_the_token(doors, name):
    _, replica = doors
    async with grpc.aio.insecure_channel(replica.address) as channel:
        stub = pb_grpc.ReplicaStub(channel)
        assert await call(stub, name, ()) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            await call(stub, name, (("authorization", f"Bearer {CLIENT_TOKEN}"),))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        assert await call(stub, name, (("authorization", f"Bearer {REPLICA_TOKEN}"),)) == grpc.StatusCode.OK
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token


@module_loop
async def test_every_replica_http_route_refuses_without_the_token(doors):
    _, replica = doors
    app = replica.http.server.config.app.app  # inside the stalled-client guard
    routes = [
        (method, route.path) for route in app.routes for method in sorted(getattr(route, "methods", ()) or ())
    ]
    assert len(routes) >= 8  # completions, chat, models, tokenize, ... and health, metrics
    async with httpx.AsyncClient(base_url=replica.http_address, timeout=30) as http:
        for method, path in routes:
            response = await http.request(method, path.replace("{", "").replace("}", ""), json={})
            expected = 200 if path == "/health" else 401
            assert response.status_code == expected, (method, path, response.status_code)
        authorized = await http.get("/v1/models", headers={"Authorization": f"Bearer {REPLICA_TOKEN}"})
        assert authorized.status_code == 200


@module_loop
async def test_scrapers_and_probes_need_no_token_and_get_nothing_else(doors):
    router, replica = doors
    async with httpx.AsyncClient(timeout=30) as http:
        pod = await http.get(f"http://127.0.0.1:{replica.config.pod_metrics_port}/metrics")
        assert pod.status_code == 200 and 'replica_id="door-0"' in pod.text
        base = f"http://127.0.0.1:{router.metrics_port}"
        metrics = await http.get(f"{base}/metrics")
        assert metrics.status_code == 200 and "kvmesh_router" in metrics.text
        health = await http.get(f"{base}/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert (await http.get(f"{base}/v1/models")).status_code == 404
        assert (await http.post(f"{base}/metrics")).status_code == 404
        inference = await http.get(f"http://127.0.0.1:{router.http_port}/metrics")
        assert inference.status_code == 401  # the inference port's metrics stay behind the token


@module_loop
async def test_the_router_presents_the_replicas_token(doors):
    router, _ = doors
    request = pb.GenerateRequest(
        text="the cache block", sampling=pb.SamplingParams(temperature=0, max_tokens=3)
    )
    async with grpc.aio.insecure_channel(router.address) as channel:
        metadata = (("authorization", f"Bearer {CLIENT_TOKEN}"),)
        responses = [
            r async for r in pb_grpc.RouterStub(channel).Generate(request, metadata=metadata, timeout=60)
        ]
    assert responses[-1].complete.replica_id == "door-0"


@module_loop
async def test_a_replica_bounds_what_one_message_may_carry(doors):
    _, replica = doors
    huge = pb.GenerateRequest(text="x" * (2 << 20), sampling=pb.SamplingParams(max_tokens=1))
    async with grpc.aio.insecure_channel(replica.address) as channel:
        call = pb_grpc.ReplicaStub(channel).Generate(
            huge, metadata=(("authorization", f"Bearer {REPLICA_TOKEN}"),), timeout=30
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in call]
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@module_loop
async def test_a_replica_listens_beyond_loopback_only_behind_a_token(qwen3_dir, valkey_server):
    open_door = ReplicaServer(ReplicaConfig(str(qwen3_dir), "door-1", valkey_server.url, host="0.0.0.0"))
    with pytest.raises(ValueError, match="--replica-api-key-file"):
        await open_door.start()


PROBE_RAY = "import ray, sys; ray.init(address=sys.argv[1]); print('connected')"


def test_ray_refuses_a_client_without_the_clusters_token(ray_cluster, tmp_path):
    """Ray's own door (GCS, which every Ray client and node dials) takes Ray's token: a
    local Ray, as kvmesh up starts one, has token auth on by default."""
    import os
    import subprocess
    import sys

    gcs = ray_cluster.get_runtime_context().gcs_address

    def probe(env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", PROBE_RAY, gcs], capture_output=True, text=True, timeout=120, env=env
        )

    member = probe(dict(os.environ))  # with the cluster's token (~/.ray/auth_token)
    assert member.returncode == 0 and "connected" in member.stdout, member.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    stranger = {**env, "HOME": str(tmp_path), "RAY_AUTH_MODE": "token"}  # no ~/.ray/auth_token
    for extra in ({}, {"RAY_AUTH_TOKEN": "not-the-clusters-token"}):
        out = probe({**stranger, **extra})
        assert out.returncode != 0 and "connected" not in out.stdout
        assert "AuthenticationError" in out.stderr or "InvalidAuthToken" in out.stderr
