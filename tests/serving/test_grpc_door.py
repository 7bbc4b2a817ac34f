"""A kvmesh gRPC server's door: a burst beyond a connection's stream bound is served or
refused unprocessed (docs/api.md), and a request that does not decode is INVALID_ARGUMENT
naming what was wrong, never UNKNOWN."""

import asyncio

import grpc
import pytest

from kvmesh.protos import pb
from kvmesh.serving.connections import ConnectionLimits
from kvmesh.serving.grpc_decode import why_undecodable
from kvmesh.serving.grpc_server import start_grpc_server

MAX_STREAMS = 4
METHOD = "/test.Door/Generate"


async def _hold(request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
    """Keeps its stream a while, so a burst of calls outnumbers the streams."""
    await asyncio.sleep(0.05)
    await context.write(pb.GenerateResponse(request_id=request.request_id))


def _add_door(servicer, server) -> None:
    handler = grpc.unary_stream_rpc_method_handler(
        servicer,
        request_deserializer=pb.GenerateRequest.FromString,
        response_serializer=pb.GenerateResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Door", {"Generate": handler}),)
    )


@pytest.fixture
async def door():
    server = await start_grpc_server(
        [(_add_door, _hold, "test.Door")],
        "127.0.0.1",
        0,
        connections=ConnectionLimits(grpc_max_streams=MAX_STREAMS),
    )
    yield f"127.0.0.1:{server.port}"
    await server.stop(0)


async def _code(call) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.servers
async def test_a_burst_beyond_the_stream_bound_is_served_or_refused_unprocessed_and_a_retry_serves(door):
    """What docs/api.md promises: every call of a burst ten times the bound is served, or
    refused as UNAVAILABLE before it reached the handler (grpc's overload protection), and
    such a call served when sent again."""
    async with grpc.aio.insecure_channel(door) as channel:
        generate = channel.unary_stream(
            METHOD,
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        codes = await asyncio.gather(
            *(
                _code(generate(pb.GenerateRequest(request_id=str(i)), timeout=30))
                for i in range(10 * MAX_STREAMS)
            )
        )
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
        assert codes.count(grpc.StatusCode.OK) >= MAX_STREAMS
        refused = [i for i, code in enumerate(codes) if code != grpc.StatusCode.OK]
        for i in refused:  # one at a time: within the bound
            assert (
                await _code(generate(pb.GenerateRequest(request_id=str(i)), timeout=30)) == grpc.StatusCode.OK
            )


@pytest.mark.servers
@pytest.mark.parametrize(
    "data, reason",
    [
        (b"\xff\xff\xff", "the protobuf encoding is corrupt"),
        (pb.GenerateRequest(model="ab").SerializeToString().replace(b"ab", b"\xc3\x28"), "field model"),
    ],
)
async def test_a_request_that_does_not_decode_is_invalid_argument(door, data, reason):
    async with grpc.aio.insecure_channel(door) as channel:
        call = channel.unary_stream(METHOD, request_serializer=lambda b: b)(data, timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kvmesh.v1.GenerateRequest" in caught.value.details() and reason in caught.value.details()


def test_the_field_at_fault_is_named_however_deep():
    chat = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="ok")]))
    chat.chat.messages.append(pb.ChatMessage(role="user", content="XY"))
    data = chat.SerializeToString().replace(b"XY", b"\xed\xa0")  # a lone surrogate: not UTF-8
    assert "field chat.messages.content is not valid UTF-8" in why_undecodable(
        pb.GenerateRequest.DESCRIPTOR, data
    )


def test_the_search_for_the_field_at_fault_is_bounded():
    many = b"".join(
        pb.GenerateRequest(sampling=pb.SamplingParams(top_k=1)).SerializeToString() for _ in range(10_000)
    )
    data = many + pb.GenerateRequest(model="ab").SerializeToString().replace(b"ab", b"\xff\xfe")
    assert "the protobuf encoding is corrupt" in why_undecodable(pb.GenerateRequest.DESCRIPTOR, data)
