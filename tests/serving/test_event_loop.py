"""The servers' event loop: uvloop where it is installed (a dependency on Linux and macOS),
asyncio's own otherwise, with gRPC's asyncio API working on either."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.serving import event_loop
from kvmesh.serving.grpc_server import start_grpc_server


async def _health_round_trip() -> str:
    """A gRPC server and a client on the running loop: one health check between them."""
    server = await start_grpc_server([], "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
    return event_loop.loop_name()


@pytest.mark.servers
def test_servers_run_on_uvloop_where_it_is_installed():
    pytest.importorskip("uvloop", reason="uvloop is a dependency on Linux and macOS only")
    assert event_loop.run(_health_round_trip()) == "uvloop"


@pytest.mark.servers
def test_without_uvloop_the_loop_is_asyncios_own(monkeypatch):
    monkeypatch.setattr(event_loop, "loop_factory", lambda: None)
    assert event_loop.run(_health_round_trip()) == "asyncio"
