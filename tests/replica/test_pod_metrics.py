"""Replica metrics scrapable on a pod: two replicas sharing one host serve both replicas'
metrics on one fixed port, labelled replica_id; when the exporting replica stops, the
other takes the port over."""

import httpx
import pytest
from helpers import eventually

from kvmesh.cluster.embedded_redis import EmbeddedRedis, free_port
from kvmesh.engine.config import EngineConfig
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.pod_metrics import merge_metrics
from kvmesh.replica.process import ReplicaServer
from kvmesh.serving.metrics import read_samples

pytestmark = pytest.mark.servers


def replica_ids_in(text: str, name: str) -> set[str]:
    return {dict(labels)["replica_id"] for (n, labels), _ in read_samples(text).items() if n == name}


def test_merge_keeps_one_family_per_name_and_labels_every_sample():
    page = '# HELP x_total X\n# TYPE x_total counter\nx_total{model_name="m"} 3.0\n'
    merged = merge_metrics({"a": page, "b": page.replace("3.0", "4.0")}).decode()
    assert merged.count("# TYPE x_total counter") == 1
    assert 'x_total{model_name="m",replica_id="a"} 3.0' in merged
    assert 'x_total{model_name="m",replica_id="b"} 4.0' in merged


async def test_one_port_per_pod_serves_every_local_replica_and_is_taken_over(qwen3_dir):
    port = free_port()
    redis = EmbeddedRedis().start()
    engine = EngineConfig(num_kv_blocks=64, block_size=16, max_model_len=256)
    configs = [
        ReplicaConfig(
            str(qwen3_dir), f"pod-{i}", redis.url, http_port=-1, pod_metrics_port=port, engine=engine
        )
        for i in range(2)
    ]
    servers = [ReplicaServer(c) for c in configs]
    for s in servers:
        await s.start()
    exporter = next(s for s in servers if s.pod_metrics.serving)
    other = next(s for s in servers if s is not exporter)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        async with httpx.AsyncClient(timeout=10) as http:

            async def ids() -> set[str]:
                reply = await http.get(url)
                return (
                    replica_ids_in(reply.text, "kvmesh_replica_kv_blocks")
                    if reply.status_code == 200
                    else set()
                )

            assert await eventually(lambda: _eq(ids, {"pod-0", "pod-1"}))
            text = (await http.get(url)).text
            assert text.count("# TYPE vllm:num_requests_running gauge") == 1
            assert (await http.get(f"http://127.0.0.1:{port}/other")).status_code == 404
            await exporter.stop(grace=0.2)
            assert await eventually(
                lambda: _eq(ids, {other.config.replica_id})
            )  # taken over, the gone one left out
            assert other.pod_metrics.serving
    finally:
        for s in servers:
            await s.stop(grace=0.2)
        redis.close()


async def _eq(ids, wanted: set[str]) -> bool:
    try:
        return await ids() == wanted
    except httpx.HTTPError:
        return False
