"""A replica that stops stepping, with real Ray replicas and a real router: its process
SIGSTOPped (its heartbeat stops), or its engine stuck in a step (its event loop runs on).
Within a few seconds it is out of the router's live set, the requests queued on it (no first
token yet) finish on the other replica, and those that had streamed from it end with a clear
error instead of hanging. Then it comes back."""

import asyncio
import os
import signal
import time

import grpc
import pytest
import pytest_asyncio
from fake_http import FakeHttpServer
from helpers import eventually
from reference import prompts_of_lengths

from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.launcher import LocalCluster
from kvmesh.engine import LLMEngine, SamplingParams
from kvmesh.engine.async_engine import AsyncLLMEngine
from kvmesh.engine.protocol import EngineDeadError
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.router.config import RouterLimits
from kvmesh.router.replica_http import ReplicaHttp

pytestmark = pytest.mark.asyncio(loop_scope="module")

STALL_S = 1.0  # the engine stall timeout these replicas run with
# Slack for a loaded 2-core machine, beyond the bound each test states.
SLACK_S = 2.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(ray_cluster, qwen3_dir):
    """Two replicas with the default heartbeat and TTL; a supervisor that checks every 3 s
    and waits 15 s for an answer, so that it replaces the stuck replica afterwards."""
    config = ClusterConfig.for_model(
        str(qwen3_dir),
        2,
        engine={"num_kv_blocks": 512, "max_num_seqs": 16},
        # Streams that had begun end with an error here, as with migration off: moving them
        # is tests/test_faults.py's.
        router={"port": 0, "http_port": -1, "limits": RouterLimits(migration_limit=0)},
        replica={"engine_stall_s": STALL_S},
    )
    async with LocalCluster(config) as c:
        c.supervisor.check_s = 3.0
        yield c


def request(salt: int, max_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = prompts_of_lengths([32], salt=salt)[0]
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sampling, policy="round_robin")


async def tracked(channel, req: pb.GenerateRequest, first: asyncio.Event | None = None) -> dict:
    """One request's fate: ok (and where it finished), or its error; and whether it streamed."""
    chunks, replica = 0, ""
    try:
        async for r in pb_grpc.RouterStub(channel).Generate(req, timeout=60):
            if r.WhichOneof("kind") == "chunk":
                chunks += 1
                if first is not None:
                    first.set()
            else:
                replica = r.complete.replica_id
        return {"code": "OK", "chunks": chunks, "replica": replica, "at": time.monotonic()}
    except grpc.aio.AioRpcError as exc:
        return {"code": exc.code().name, "chunks": chunks, "details": exc.details(), "at": time.monotonic()}


def live_ids(cluster) -> set[str]:
    return {e.record.replica_id for e in cluster.router.registry.live()}


async def both_live(cluster) -> bool:
    await cluster.router.registry.refresh()
    return len(live_ids(cluster)) == 2


def on_replica(cluster, replica_id: str) -> int:
    """Requests this router has in flight on ``replica_id`` now."""
    return sum(r == replica_id for r in cluster.router.core.relay.inflight.values())


async def hang_with_work(cluster, channel, victim: str, hang) -> tuple[float, list[dict], list[dict]]:
    """Streams on both replicas, then ``hang()`` the victim and send more work at once (the
    router still lists it: some of it queues there). Returns when the hang began, the
    results of the streams and of the queued requests."""
    firsts = [asyncio.Event() for _ in range(4)]
    streams = [
        asyncio.create_task(tracked(channel, request(100 + i, max_tokens=3000), firsts[i])) for i in range(4)
    ]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 30)
    assert on_replica(cluster, victim) == 2  # round robin: two streams on each replica
    hung_at = time.monotonic()
    await hang()
    queued = [asyncio.create_task(tracked(channel, request(200 + i, max_tokens=8))) for i in range(4)]
    await eventually(lambda: asyncio.sleep(0, result=on_replica(cluster, victim) >= 3), timeout=2)
    assert on_replica(cluster, victim) >= 3  # some of the new ones wait on the hung replica
    return hung_at, streams, queued


async def check_outcome(cluster, victim: str, hung_at: float, bound: float, streams, queued, cause: str):
    """Queued requests finish elsewhere, the victim's streams end with an error naming the
    cause, all within ``bound`` (plus slack); the other replica's streams go on."""
    done = await asyncio.wait_for(asyncio.gather(*queued), bound + SLACK_S + 5)
    assert all(r["code"] == "OK" and r["replica"] != victim for r in done), done  # moved, not lost
    assert max(r["at"] for r in done) - hung_at < bound + SLACK_S, [r["at"] - hung_at for r in done]
    await eventually(lambda: asyncio.sleep(0, result=sum(t.done() for t in streams) >= 2), timeout=bound + 5)
    cut = [t.result() for t in streams if t.done()]
    assert len(cut) == 2, cut  # the victim's two, not the survivor's
    assert all(r["code"] == "UNAVAILABLE" and r["chunks"] > 0 and cause in r["details"] for r in cut), cut
    assert max(r["at"] for r in cut) - hung_at < bound + SLACK_S, [r["at"] - hung_at for r in cut]
    for t in streams:
        t.cancel()
    await asyncio.gather(*streams, return_exceptions=True)


@pytest.mark.servers
async def test_a_stopped_replica_leaves_and_its_queued_requests_move(cluster):
    """SIGSTOP: nothing answers, the heartbeat stops. Out of the live set within the TTL,
    its requests moved or ended within the TTL and one registry refresh; back after SIGCONT."""
    assert await eventually(lambda: both_live(cluster), timeout=60)
    victim = "replica-1"
    pid = await cluster.supervisor.actors[victim].pid.remote()
    ttl = ReplicaConfig.ttl_s  # the default: this cluster's replicas run with it
    bound = ttl + cluster.router.registry.refresh_s
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        hung_at, streams, queued = await hang_with_work(
            cluster, channel, victim, lambda: asyncio.to_thread(os.kill, pid, signal.SIGSTOP)
        )
        try:
            gone = await eventually(lambda: asyncio.sleep(0, result=victim not in live_ids(cluster)))
            out_after = time.monotonic() - hung_at
            assert gone and out_after < ttl + SLACK_S, out_after
            await check_outcome(cluster, victim, hung_at, bound, streams, queued, "heartbeat")
        finally:
            os.kill(pid, signal.SIGCONT)
    # It rejoins by itself, or, where Ray called the stopped actor unavailable to the
    # supervisor's health check (seen in CI), its replacement joins.
    assert await eventually(lambda: both_live(cluster), timeout=60)


@pytest.mark.servers
async def test_a_stuck_engine_leaves_and_its_queued_requests_move(cluster):
    """The engine thread stuck in a step while the replica's event loop runs: the replica
    finds its engine stalled, fails what it holds (queued requests move), leaves the index."""
    assert await eventually(lambda: both_live(cluster), timeout=60)
    victim = "replica-0"
    actor = cluster.supervisor.actors[victim]
    bound = STALL_S + ReplicaConfig.heartbeat_s  # the stall, seen at the next engine check
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        hung_at, streams, queued = await hang_with_work(
            cluster, channel, victim, lambda: actor.inject_step_delay.remote(60)
        )
        await check_outcome(cluster, victim, hung_at, bound, streams, queued, "stalled")
    assert await eventually(lambda: both_live(cluster), timeout=60)  # the supervisor replaced it


class _Silent(FakeHttpServer):
    """Begins the first answer with one event, then says nothing more, to anyone."""

    async def answer(self, writer) -> bool:
        if self.requests == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await asyncio.Event().wait()
        return False


async def test_closing_a_replicas_connections_ends_the_requests_on_them():
    """The relay's side of a silent replica: closing its ``ReplicaHttp`` ends a stream that
    had begun and a request still waiting for its answer, with the reason, and sends nothing
    more to it (a request waiting for its answer then moves: ``relay.py``)."""
    async with _Silent() as server:
        http = ReplicaHttp(server.url, None)
        streaming = await http.post("/x", b"{}", ())
        assert await streaming.read() == b"data: 1\n\n"
        waiting = asyncio.create_task(http.post("/x", b"{}", ()))
        await eventually(lambda: asyncio.sleep(0, result=server.requests == 2))
        http.close("r0 went silent")
        with pytest.raises(ConnectionAbortedError, match="r0 went silent"):
            await asyncio.wait_for(streaming.read(), 1)
        with pytest.raises(ConnectionAbortedError, match="r0 went silent"):
            await asyncio.wait_for(waiting, 1)
        with pytest.raises(ConnectionAbortedError, match="r0 went silent"):
            await http.post("/x", b"{}", ())
        assert server.connections == 2


async def test_a_stalled_engine_refuses_new_work_and_fails_what_it_holds(qwen3_dir):
    """The replica's side of a stuck step: new requests are refused at once and
    ``fail_streams`` ends the ones waiting, rather than both waiting on the step."""
    engine = LLMEngine(qwen3_dir, num_kv_blocks=64, block_size=16)
    runner = AsyncLLMEngine(engine, stall_s=0.2)
    release, step = asyncio.Event(), engine.step
    loop = asyncio.get_running_loop()
    engine.step = lambda: (asyncio.run_coroutine_threadsafe(release.wait(), loop).result(), step())[1]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    held = asyncio.create_task(anext(runner.generate([1, 2, 3], params)))
    await eventually(lambda: asyncio.sleep(0, result=runner.health() is not None))
    with pytest.raises(EngineDeadError, match="stalled"):
        await asyncio.wait_for(anext(runner.generate([4, 5, 6], params)), 1)
    runner.fail_streams(runner.health())
    with pytest.raises(EngineDeadError, match="stalled"):
        await asyncio.wait_for(held, 1)
    release.set()
    await asyncio.to_thread(runner.shutdown)
