"""How the front end answers over time: SSE responses that hold their request's slots until
they end, the watch for a client that leaves (its work cancelled, its blocks freed), relayed
replica streams with in-band failures, and the events of a kvmesh stream (``sse``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvmesh.protos import pb
from kvmesh.serving.admission import Ticket
from kvmesh.serving.errors import ServingError
from kvmesh.serving.http_server import DIRECT_BODY
from kvmesh.serving.offload import sized
from kvmesh.serving.openai.errors import ClientLeft, error_event
from kvmesh.serving.openai.protocol import StreamOptions
from kvmesh.serving.openai.relay import RelayEnvelope, failure_line, token_line, trailer
from kvmesh.serving.openai.responses import ResponseBuilder

T = TypeVar("T")


@contextlib.contextmanager
def released_unless_streaming(ticket: Ticket):
    """A request's slots go back when its handler ends, unless a stream took them over (an
    ``EventStream`` releases them when it ends)."""
    try:
        yield
    except BaseException:
        ticket.release()
        raise
    else:
        if not ticket.streaming:
            ticket.release()


async def unless_client_leaves(raw: Request, work: Awaitable[T]) -> T:
    """``work``'s result; or, when the client disconnects first, ``work`` cancelled (its
    requests aborted, their blocks freed: nobody waits for the answer) and ``ClientLeft``."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnect(raw.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientLeft("the client disconnected before the answer")
    return task.result()


async def disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """An SSE response that holds its request's slots until it ends, and closes its event
    generator however it ends (a failed write included), so the request's cleanup (abort
    upstream) runs now, not when the generator is collected.

    Streamed without Starlette's task group: one plain task watches for the client leaving
    (and cancels the stream when it does), and each event goes straight to the connection
    where the server allows it (``DirectBody``): per token, one write instead of an ASGI
    send through every middleware."""

    def __init__(self, events: AsyncIterator[str | bytes], ticket: Ticket):
        super().__init__(events, media_type="text/event-stream")
        self.ticket = ticket
        ticket.streaming = True  # the handler leaves the slots to this response

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.current_task()
        watcher = asyncio.ensure_future(cancel_when_gone(receive, streaming))
        try:
            async with contextlib.aclosing(self.body_iterator) as events:
                await send(
                    {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
                )
                direct = scope.get(DIRECT_BODY)
                body = direct() if direct is not None else None
                async for event in events:
                    data = event if isinstance(event, bytes) else event.encode()
                    if body is not None:
                        await body.write(data)
                    else:
                        await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # Ours (the client left): the stream ends here, as Starlette's would. Anyone
            # else's cancellation goes on.
            if not client_left(watcher) or streaming.uncancel() > 0:
                raise
        finally:
            watcher.cancel()
            self.ticket.release()


async def cancel_when_gone(receive, task: asyncio.Task) -> bool:
    await disconnect(receive)
    return task.cancel()


def client_left(watcher: asyncio.Future) -> bool:
    """Whether ``cancel_when_gone`` saw the client leave and so cancelled the stream."""
    return watcher.done() and not watcher.cancelled() and watcher.exception() is None and watcher.result()


async def relayed_events(first: bytes, rest: AsyncIterator[bytes]):
    """A replica's stream as relayed; when it fails midway, the error in band and the end."""
    try:
        yield first
        async for block in rest:
            yield block
    except ServingError as exc:
        yield error_event(exc) + "data: [DONE]\n\n"
    finally:
        await rest.aclose()


async def tagged(stream: AsyncIterator[pb.GenerateResponse]):
    async for response in stream:
        yield 0, response


async def chain(first, rest: AsyncIterator):
    yield first
    async for item in rest:
        yield item


def _event(
    builder: ResponseBuilder, prompt: int, response: pb.GenerateResponse, options: StreamOptions
) -> tuple[int, str] | None:
    """The choice a response adds to and the event it makes (None: nothing to show), built
    in one go so that a large one (a prompt's log-probabilities) is built off the loop."""
    delta = builder.add(prompt, response)
    text = delta["text"] if "text" in delta else delta["delta"].get("content")
    if not (text or delta["logprobs"] or delta["finish_reason"]):
        return None
    usage = builder.running_usage(delta["index"]) if options.continuous_usage_stats else None
    return delta["index"], builder.event([delta], usage)


async def sse(
    builder: ResponseBuilder,
    first,
    rest: AsyncIterator,
    options: StreamOptions,
    relayed: RelayEnvelope | None = None,
):
    """``relayed``: a router's stream, which ends with the trailer the router reads; where it
    asks, every data event starts with the token ids it shows (``token_line``, empty for most
    but the chunks'), a failure's event says its code (``failure_line``: the router moves a
    stream whose replica failed), and a continuation does not open its choice again."""
    lines = relayed is not None and relayed.stream_token_ids

    def marked(event: str, ids: list[int] | tuple = (), failed: str = "") -> str:
        if not lines:
            return event
        return token_line(ids) + (failure_line(failed) if failed else "") + event

    complete, unshown = None, []  # the token ids of chunks no event has shown yet
    try:
        if relayed is None or not relayed.continuation:
            for event in builder.opening_events():
                yield marked(event)
        async for prompt, response in chain(first, rest):
            if relayed and response.WhichOneof("kind") == "complete" and response.complete.index == 0:
                complete = response.complete
            elif lines and response.chunk.index == 0:
                unshown.extend(response.chunk.token_ids)
            shown = await sized(response.ByteSize(), _event, builder, prompt, response, options)
            if shown is not None:
                index, event = shown
                if index == 0:
                    yield marked(event, unshown)
                    unshown = []
                else:
                    yield marked(event)
        if options.include_usage:
            yield marked(builder.event([], builder.openai_usage()))
        if complete is not None:
            yield trailer(complete)
    except ServingError as exc:  # a replica failed mid-stream: tell the client, in band
        yield marked(error_event(exc), failed=exc.grpc_code.name)
    finally:
        await rest.aclose()
    yield marked("data: [DONE]\n\n")
