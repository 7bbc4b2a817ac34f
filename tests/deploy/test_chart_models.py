"""The chart's two-model rendering (``helm/kvmesh/ci/multi-model-values.yaml``: a tiny Qwen3 and
a tiny Llama, each on a worker group of its own) run as processes, as
``test_chart_commands.py`` runs the one-model rendering: each model's replicas on its own
group's Ray nodes (placed by the group's Ray resource), one router for both."""

import grpc
import httpx
import pytest
from test_chart_commands import chart_as_processes, rendered, replica_hosts, wait_live

from kvmesh.protos import pb, pb_grpc

pytestmark = [pytest.mark.servers, pytest.mark.heavy]

QWEN, LLAMA = "kvmesh/tiny-qwen3", "llama"  # what clients call them (llama by its served name)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, qwen3_dir, llama_dir):
    repos = {"kvmesh/tiny-qwen3": qwen3_dir, "kvmesh/tiny-llama": llama_dir}
    yield from chart_as_processes(tmp_path_factory, rendered("multi-model-values.yaml"), repos, routers=1)


def test_each_model_is_served_from_its_own_worker_group(two_models):
    setup = two_models
    grpc_address, http_url, _ = setup["routers"][0]
    replicas = wait_live(grpc_address, 2)
    by_model = {}
    for r in replicas:
        by_model.setdefault(r.model, []).append(r.replica_id)
    assert {m: sorted(ids) for m, ids in by_model.items()} == {
        QWEN: ["kvmesh--tiny-qwen3-0"],
        LLAMA: ["kvmesh--tiny-llama-0"],
    }
    cards = httpx.get(f"{http_url}/v1/models", timeout=30).json()["data"]
    assert sorted(c["id"] for c in cards) == sorted([QWEN, LLAMA])
    with grpc.insecure_channel(grpc_address) as channel:
        stub = pb_grpc.RouterStub(channel)
        sizes = {
            m: stub.GetModelInfo(pb.GetModelInfoRequest(model=m), timeout=10).block_size
            for m in (QWEN, LLAMA)
        }
        for model in (QWEN, LLAMA):
            request = pb.GenerateRequest(
                text="the chart", model=model, sampling=pb.SamplingParams(temperature=0, max_tokens=3)
            )
            complete = list(stub.Generate(request, timeout=60))[-1].complete
            assert complete.replica_id in by_model[model] and complete.usage.completion_tokens == 3
    assert sizes == {QWEN: 16, LLAMA: 32}  # the values' per-model block size
    body = {"model": LLAMA, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{http_url}/v1/chat/completions", json=body, timeout=60).status_code == 200

    # Each replica actor runs on a Ray node of its model's worker group (ray-worker-<group>-<n>).
    groups = {
        actor: pod.removeprefix("ray-worker-").rsplit("-", 1)[0]
        for actor, pod in replica_hosts(setup).items()
    }
    assert groups == {
        "kvmesh/tiny-qwen3/kvmesh--tiny-qwen3-0": "qwen",
        "kvmesh/tiny-llama/kvmesh--tiny-llama-0": "llama",
    }
