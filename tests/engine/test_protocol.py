"""Both engines keep the face a replica codes against (``kvmesh.engine.protocol``): every
member, called the same way (sync, async or a stream) with the same parameters."""

import inspect
from types import SimpleNamespace

import pytest

from kvmesh.engine.async_engine import AsyncLLMEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.protocol import ServingEngine
from kvmesh.replica.vllm.engine import VllmEngine

METHODS = sorted(n for n, v in vars(ServingEngine).items() if callable(v) and not n.startswith("_"))


def kind(fn) -> str:
    if inspect.isasyncgenfunction(fn) or str(inspect.signature(fn).return_annotation).startswith(
        "AsyncIterator"
    ):
        return "stream"
    return "async" if inspect.iscoroutinefunction(fn) else "sync"


def vllm_engine() -> VllmEngine:
    server = SimpleNamespace(events_endpoint="tcp://127.0.0.1:9", replay_endpoint="tcp://127.0.0.1:10")
    return VllmEngine(server, EngineConfig(), block_size=16, hash_seed=0)


def test_the_face_names_what_a_replica_calls():
    assert {"generate", "abort", "stats", "health", "drain_kv_events", "snapshot_cached_blocks"} <= set(
        METHODS
    )
    assert "config" in ServingEngine.__annotations__


def drift(engine) -> list[str]:
    """Where ``engine`` departs from the face: a member missing, called another way, or with
    other parameters."""
    wrong = []
    for name in METHODS:
        face, own = getattr(ServingEngine, name), getattr(engine, name, None)
        if own is None or kind(own) != kind(face):
            wrong.append(f"{name}: {own and kind(own)} instead of {kind(face)}")
        elif list(inspect.signature(own).parameters) != list(inspect.signature(face).parameters):
            wrong.append(f"{name}{inspect.signature(own)} instead of {name}{inspect.signature(face)}")
    return wrong


@pytest.mark.parametrize("engine", [AsyncLLMEngine, VllmEngine], ids=["kvmesh", "vllm"])
def test_each_engine_keeps_every_member_of_the_face(engine):
    assert drift(engine) == []


def test_each_engine_has_the_config_a_replica_sizes_admission_by():
    assert isinstance(inspect.getattr_static(AsyncLLMEngine, "config"), property)
    engine = vllm_engine()
    try:
        assert isinstance(engine.config, EngineConfig)
    finally:
        engine.subscriber.close()  # its socket: a context collected with one open never ends


def test_the_check_sees_an_engine_that_drifts_from_the_face():
    class Drifted(AsyncLLMEngine):
        def abort(self, request_id: str, why: str) -> bool:  # one parameter too many
            return False

        def stop(self) -> None:  # sync where the face awaits
            pass

    assert [w.split("(")[0].split(":")[0] for w in drift(Drifted)] == ["abort", "stop"]
