"""The committed gRPC stubs match the .proto; the fixed fields (docs/design.md#the-wire-contract) exist."""

from pathlib import Path

import pytest

from kvmesh.protos import pb, pb_grpc

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_match_the_proto(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "protos"))
    try:
        from generate import generate
    finally:
        sys.path.pop(0)
    fresh = {p.relative_to(tmp_path): p.read_text() for p in generate(tmp_path)}
    assert fresh, "nothing generated"
    for rel, text in fresh.items():
        committed = ROOT / "protos" / rel
        assert committed.is_file(), f"{rel} is not committed: run make protos"
        assert committed.read_text() == text, f"{rel} is stale: run make protos"


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        (
            "SamplingParams",
            {
                "temperature": 1,
                "top_p": 2,
                "top_k": 3,
                "max_tokens": 4,
                "seed": 5,
                "ignore_eos": 6,
                "stop": 7,
                "stop_token_ids": 8,
            },
        ),
        ("TokenIds", {"ids": 1}),
        (
            "GenerateRequest",
            {"request_id": 1, "text": 2, "token_ids": 3, "sampling": 4, "policy": 5, "affinity_key": 6},
        ),
        ("Usage", {"prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 3, "host_cached_tokens": 4}),
        ("Chunk", {"token_ids": 1, "text": 2}),
        (
            "Complete",
            {
                "finish_reason": 1,
                "usage": 2,
                "replica_id": 3,
                "predicted_cached_tokens": 4,
                "predicted_host_cached_tokens": 11,
            },
        ),
        ("GenerateResponse", {"request_id": 1, "chunk": 2, "complete": 3}),
        ("ModelInfo", {"model": 1, "block_size": 2, "max_model_len": 3, "vocab_size": 4}),
    ],
)
def test_fixed_fields(message, fields):
    descriptor = getattr(pb, message).DESCRIPTOR
    for name, number in fields.items():
        assert descriptor.fields_by_name[name].number == number, f"{message}.{name}"


def test_optional_sampling_fields_have_presence():
    params = pb.SamplingParams()
    assert not params.HasField("temperature")
    params.temperature = 0.0
    assert params.HasField("temperature")


def test_services_and_methods():
    services = pb.DESCRIPTOR.services_by_name
    assert services["Router"].full_name == "kvmesh.v1.Router"
    assert set(services["Router"].methods_by_name) == {"Generate", "Abort", "GetModelInfo", "ListReplicas"}
    assert set(services["Replica"].methods_by_name) >= {"Generate", "Abort", "GetStats"}
    assert services["Router"].methods_by_name["Generate"].server_streaming
    assert hasattr(pb_grpc, "RouterStub") and hasattr(pb_grpc, "add_ReplicaServicer_to_server")
