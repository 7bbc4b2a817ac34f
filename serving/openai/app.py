"""OpenAI-compatible HTTP front end (FastAPI), served by the router and by every replica.

``/v1/completions`` and ``/v1/chat/completions`` (SSE when ``stream``), ``/v1/models``,
vLLM-style ``/tokenize``, ``/detokenize``, ``/version`` and
``/v1[/chat]/completions/render``, SGLang-style ``/server_info``, ``/health`` (503 until
ready) and ``/metrics`` (Prometheus), over the ``ServedModels`` of a server: the router's
(a RouterCore per model) or a replica's one engine (``OneModel``), so the same code (and the
same error mapping) fronts both, and third-party routers (sglang-router, vllm-router) can
front the replicas too. A request's ``model`` picks its backend.

Which request fields are honoured is ``openai_protocol.FIELD_RULES``. Every error, in a body
or in band in a stream, is OpenAI's ``{"error": {"message", "type", "param", "code"}}``:
400 for bad input (``param`` names the field), 401 without the token, 404 for an unknown
model or path, 413 for an oversized body, 429 when overloaded, 503 when nothing can serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from importlib.metadata import version
from typing import Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from kvmesh.protos import pb
from kvmesh.serving import tracing
from kvmesh.serving.admission import Ticket
from kvmesh.serving.auth import token_matches
from kvmesh.serving.errors import InvalidRequest, ServingError
from kvmesh.serving.http_server import DIRECT_BODY, DirectBody
from kvmesh.serving.limits import InputLimits
from kvmesh.serving.model_info import ModelInfo
from kvmesh.serving.offload import sized
from kvmesh.serving.openai.protocol import (
    FIELD_RULES,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
)
from kvmesh.serving.openai.relay import (
    RELAY_PATHS,
    ChatEnvelope,
    CompletionEnvelope,
    RelayEnvelope,
    failure_line,
    token_line,
    trailer,
)
from kvmesh.serving.openai.requests import Plan, chat_plan, completion_plan, session_key_of, tokenize_request
from kvmesh.serving.openai.responses import Echo, ResponseBuilder, TokenNames
from kvmesh.serving.streams import merge
from kvmesh.serving.tokenizer import PromptTokenizer

_VERSION = version("kvmesh")
Body = TypeVar("Body", bound=BaseModel)
T = TypeVar("T")
_FIELDS = frozenset(rule.name for rule in FIELD_RULES) | {"top_logprobs", "tokens"}
# An oversized body is read (and dropped) up to this much, so the client gets its 413
# instead of a connection reset; beyond it the connection is simply closed.
_DRAIN_LIMIT_BYTES = 64 << 20


class OpenAIBackend(Protocol):
    """What the front end serves from (the router's RouterCore, or a replica's EngineBackend)."""

    model: ModelInfo
    tokenizer: PromptTokenizer | None
    inputs: InputLimits

    def admit(self, count: int = 1, policy: str = "") -> Ticket: ...

    async def prompt_ids(self, request: pb.GenerateRequest) -> list[int]: ...

    def generate(
        self, request: pb.GenerateRequest, trace: object = None
    ) -> AsyncIterator[pb.GenerateResponse]: ...

    def render_metrics(self) -> bytes: ...

    relays_sse: bool  # True: one-prompt streams go through ``generate_sse`` (the router's relay)


class SseRelayBackend(OpenAIBackend, Protocol):
    """A backend that streams a one-prompt request's SSE from elsewhere, byte for byte."""

    def generate_sse(
        self,
        request: pb.GenerateRequest,
        chat: bool,
        body: bytes,
        trace: object = None,
        direct: Callable[[], DirectBody | None] | None = None,
    ) -> AsyncIterator[bytes]:
        """``direct``: the response's ``DirectBody`` once its headers went out (None where the
        server offers none), for the stream to splice into instead of yielding each event."""
        ...


class ServedModels(Protocol):
    """What a front end serves: each model's backend, found by the name a request gives."""

    def backend(self, name: str | None) -> OpenAIBackend:
        """The backend of model ``name`` (a served name or id; none: the only model's);
        NotFound for a model not served here."""
        ...

    def serving(self) -> list[OpenAIBackend]:
        """The models clients can use now (/v1/models)."""
        ...

    def render_metrics(self) -> bytes: ...


class OneModel:
    """A server of one model (a replica): its backend answers to its served name, its id, or none."""

    def __init__(self, backend: OpenAIBackend):
        self._backend = backend

    def backend(self, name: str | None) -> OpenAIBackend:
        self._backend.model.check_named(name)
        return self._backend

    def serving(self) -> list[OpenAIBackend]:
        return [self._backend]

    def render_metrics(self) -> bytes:
        return self._backend.render_metrics()


class _ClientLeft(ServingError):
    """The client disconnected before its answer was ready (nginx's 499: nobody reads it)."""

    http_status = 499


_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "service_unavailable")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, param))


def _serving_error_response(exc: ServingError) -> JSONResponse:
    response = _error(exc.http_status, str(exc), _param_of(exc))
    if getattr(exc, "retry_after_s", None):
        response.headers["retry-after"] = str(math.ceil(exc.retry_after_s))
    return response


def _param_of(exc: ServingError) -> str | None:
    """The field an error is about: its own, else the request field its message starts with."""
    if exc.param or exc.http_status != 400:
        return exc.param
    message = str(exc)
    if message.startswith("replica error ("):
        message = message.split("): ", 1)[-1]
    word = message.replace(":", " ").split(" ", 1)[0]
    return word if word in _FIELDS else None


def _validation_error(errors: list) -> InvalidRequest:
    """A body that does not fit its model, as one 400 naming the first field at fault."""
    first = errors[0] if errors else {}
    where = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = first.get("msg", "invalid request")
    return InvalidRequest(f"{'.'.join(where)}: {message}" if where else message, where[0] if where else None)


async def _parsed(raw: Request, model: type[Body]) -> tuple[Body, int]:
    """The request body as ``model``, and its size in bytes (which decides whether the work
    for it runs off the event loop: parsing a large body included)."""
    data = await raw.body()
    try:
        return await sized(len(data), _parse, data, model), len(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None


def _parse(data: bytes, model: type[Body]) -> Body:
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid UTF-8 JSON ({exc.reason})") from None
    return model.model_validate_json(text)


def build_app(
    models: ServedModels,
    health: Callable[[], dict],
    auth_token: str | None = None,
    max_body_bytes: int = 4 << 20,
    title: str = "kvmesh router",
    relay_routes: bool = False,
    on_request: Callable[[Mapping[str, str]], None] | None = None,
) -> FastAPI:
    """``health()`` returns the /health body; ``status == "ok"`` means 200, else 503.

    Every route that does work for a request (generate, render, tokenize, detokenize) finds
    its model's backend, then takes its in-flight slots (``backend.admit``) first, a batch all its prompts at once, and
    parses, renders and tokenizes off the event loop when the request is large.
    ``relay_routes``: serve the routes a relaying router streams from (a replica's).
    ``on_request(headers)``: called as a generating request begins (the router's flow key)."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    hot_routes: dict[str, Callable[[Request], Awaitable]] = {}  # filled by ``hot_post``
    app.add_middleware(_HotRoutes, routes=hot_routes)  # added first: inside the two below

    def hot_post(path: str):
        """A POST route served by ``_HotRoutes`` (FastAPI keeps it too, for its listing)."""

        def register(handler):
            hot_routes[path] = handler
            return app.post(path)(handler)

        return register

    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    if auth_token:
        app.add_middleware(_TokenAuth, token=auth_token)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        error = _validation_error(exc.errors())
        return _error(400, str(error), error.param)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(ServingError)
    async def _serving_error(request: Request, exc: ServingError):
        return _serving_error_response(exc)

    @app.get("/health")
    async def health_check():
        body = health()
        return JSONResponse(status_code=200 if body.get("status") == "ok" else 503, content=body)

    @app.get("/metrics")
    async def metrics():
        return Response(models.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def server_version():
        return {"version": _VERSION}

    @app.get("/v1/models")
    async def model_list():
        cards = [
            {
                "id": backend.model.api_name,
                "object": "model",
                "created": 0,
                "owned_by": "kvmesh",
                "root": backend.model.model_id,
                "max_model_len": backend.model.max_model_len,
            }
            for backend in models.serving()
        ]
        return {"object": "list", "data": cards}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        """SGLang's metadata shape (one model: sglang-router names the worker's model from it)."""
        backend = models.backend(None)
        return {
            "served_model_name": backend.model.api_name,
            "max_model_len": backend.model.max_model_len,
            "page_size": backend.model.block_size,
            "version": _VERSION,
        }

    @app.post("/v1/completions/render")
    async def render_completion(raw: Request):
        body, size = await _parsed(raw, CompletionRequest)
        backend = models.backend(body.model)
        prompts = len(body.prompts())
        backend.inputs.check_batch(prompts, 1)
        with backend.admit(prompts, body.policy or ""):
            plan = await sized(size, completion_plan, body, backend.tokenizer)
            return [{"token_ids": await backend.prompt_ids(r)} for r in plan.requests]

    @app.post("/v1/chat/completions/render")
    async def render_chat(raw: Request):
        """vLLM's render shape: vllm-router's cache_aware policy asks every worker for it."""
        body, size = await _parsed(raw, ChatRequest)
        backend = models.backend(body.model)
        with backend.admit(1, body.policy or ""):
            plan = await sized(size, chat_plan, body)
            return [{"token_ids": await backend.prompt_ids(plan.requests[0])}]

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        body, size = await _parsed(raw, TokenizeRequest)
        backend = models.backend(body.model)
        with backend.admit(1):
            request = await sized(size, tokenize_request, body, backend.tokenizer)
            tokens = await backend.prompt_ids(request)
            reply = {"count": len(tokens), "max_model_len": backend.model.max_model_len, "tokens": tokens}
            if body.return_token_strs:
                reply["token_strs"] = await sized(size, TokenNames(backend.tokenizer), tokens)
            return reply

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        body, size = await _parsed(raw, DetokenizeRequest)
        backend = models.backend(body.model)
        if backend.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer", param="tokens")
        bad = next((t for t in body.tokens if not 0 <= t < backend.model.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary", param="tokens")
        with backend.admit(1):
            return {"prompt": await sized(size, backend.tokenizer.decode, body.tokens)}

    @hot_post("/v1/completions")
    async def completions(raw: Request):
        if on_request is not None:
            on_request(raw.headers)
        body, size = await _parsed(raw, CompletionRequest)
        body.check_supported()
        backend = models.backend(body.model)
        prompts = len(body.prompts())
        backend.inputs.check_batch(prompts, body.n)
        session = session_key_of(raw.headers, body, backend.inputs)
        ticket = backend.admit(prompts, body.policy or "")
        with _released_unless_streaming(ticket):
            plan = await sized(size, completion_plan, body, backend.tokenizer, session)
            if _relayed(backend, body, plan):
                return await _relay(backend, raw, plan, False, ticket)
            echoes = await _echoes(backend, body, plan, size) if plan.echo_prompt else None
            return await _serve(backend, raw, body, plan, False, echoes, ticket)

    @hot_post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        if on_request is not None:
            on_request(raw.headers)
        body, size = await _parsed(raw, ChatRequest)
        body.check_supported()
        backend = models.backend(body.model)
        backend.inputs.check_batch(1, body.n)
        session = session_key_of(raw.headers, body, backend.inputs)
        ticket = backend.admit(1, body.policy or "")
        with _released_unless_streaming(ticket):
            plan = await sized(size, chat_plan, body, session)
            if _relayed(backend, body, plan):
                return await _relay(backend, raw, plan, True, ticket)
            return await _serve(backend, raw, body, plan, True, None, ticket)

    if relay_routes:

        @app.post(RELAY_PATHS["completions"])
        async def relayed_completions(raw: Request):
            envelope, size = await _parsed(raw, CompletionEnvelope)
            return await _serve_envelope(raw, envelope, False, size)

        @app.post(RELAY_PATHS["chat"])
        async def relayed_chat(raw: Request):
            envelope, size = await _parsed(raw, ChatEnvelope)
            return await _serve_envelope(raw, envelope, True, size)

    def _relayed(backend: OpenAIBackend, body: CompletionRequest | ChatRequest, plan: Plan) -> bool:
        """Whether the backend relays this request's SSE from a replica, byte for byte."""
        return body.stream and len(plan.requests) == 1 and backend.relays_sse

    async def _relay(backend: OpenAIBackend, raw: Request, plan: Plan, chat: bool, ticket: Ticket):
        relay: SseRelayBackend = backend  # type: ignore[assignment]
        stream = relay.generate_sse(
            plan.requests[0], chat, await raw.body(), tracing.extract(raw.headers), raw.scope.get(DIRECT_BODY)
        )
        first = await _unless_client_leaves(raw, anext(stream))  # routing errors: before any header
        return _EventStream(_relayed_events(first, stream), ticket)

    async def _serve_envelope(
        raw: Request, envelope: ChatEnvelope | CompletionEnvelope, chat: bool, size: int
    ):
        """A router's relayed stream: the client's body, the router's token ids and ids (the
        router chose this server's model: the body's name is the router's for it)."""
        backend = models.backend(None)
        body = envelope.request
        body.check_supported()
        if not body.stream or (not chat and len(body.prompts()) != 1):
            raise InvalidRequest("a relayed request is one streamed prompt")
        ticket = backend.admit(1)
        with _released_unless_streaming(ticket):
            if chat:
                plan = await sized(size, chat_plan, body)
            else:
                plan = await sized(size, completion_plan, body, backend.tokenizer)
            envelope.upstream(plan.requests[0])
            echoed = plan.echo_prompt and not envelope.continued_tokens  # a continuation echoes nothing
            echoes = await _echoes(backend, body, plan, size) if echoed else None
            return await _serve(backend, raw, body, plan, chat, echoes, ticket, envelope)

    async def _echoes(backend: OpenAIBackend, body: CompletionRequest, plan: Plan, size: int) -> list[Echo]:
        """Each prompt's text (and, for logprobs, its token ids) to show before its choices."""
        echoes = []
        for prompt, request in zip(body.prompts(), plan.requests, strict=True):
            ids = await backend.prompt_ids(request) if plan.logprobs is not None else None
            if isinstance(prompt, str):
                echoes.append(Echo(prompt, ids))
            elif backend.tokenizer is None:
                raise InvalidRequest("echo of token ids needs a tokenizer; this model has none", param="echo")
            else:
                echoes.append(Echo(await sized(size, backend.tokenizer.decode, prompt), ids))
        return echoes

    async def _serve(
        backend: OpenAIBackend,
        raw: Request,
        body: CompletionRequest | ChatRequest,
        plan: Plan,
        chat: bool,
        echoes,
        ticket,
        relayed: RelayEnvelope | None = None,
    ):
        """``relayed``: a router's envelope (its client sees the router's model name and
        request id; its stream ends with the router's trailer)."""
        trace = tracing.extract(raw.headers)
        streams = [backend.generate(r, trace) for r in plan.requests]
        responses = merge(streams) if len(streams) > 1 else _tagged(streams[0])
        token_names = TokenNames(None if body.return_tokens_as_token_ids else backend.tokenizer)

        def builder_for(first) -> ResponseBuilder:
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{first[1].request_id}"
            shown = relayed.model if relayed else backend.model.api_name
            created = relayed.created if relayed and relayed.created else int(time.time())
            return ResponseBuilder(plan, chat, shown, token_names, rid, created, echoes)

        if body.stream:
            # routing errors surface here, before any header is sent
            first = await _unless_client_leaves(raw, anext(responses))
            options = body.stream_options or StreamOptions()
            events = _sse(builder_for(first), first, responses, options, relayed)
            return _EventStream(events, ticket)

        async def whole() -> dict:
            first = await anext(responses)
            builder = builder_for(first)
            async for prompt, response in _chain(first, responses):
                builder.add(prompt, response)
            return builder.body()

        return await _unless_client_leaves(raw, whole())  # one watch for the whole answer

    return app


@contextlib.contextmanager
def _released_unless_streaming(ticket: Ticket):
    """A request's slots go back when its handler ends, unless a stream took them over (an
    ``_EventStream`` releases them when it ends)."""
    try:
        yield
    except BaseException:
        ticket.release()
        raise
    else:
        if not ticket.streaming:
            ticket.release()


async def _unless_client_leaves(raw: Request, work: Awaitable[T]) -> T:
    """``work``'s result; or, when the client disconnects first, ``work`` cancelled (its
    requests aborted, their blocks freed: nobody waits for the answer) and ``_ClientLeft``."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(raw.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise _ClientLeft("the client disconnected before the answer")
    return task.result()


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
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
        watcher = asyncio.ensure_future(_cancel_when_gone(receive, streaming))
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
            if not _client_left(watcher) or streaming.uncancel() > 0:
                raise
        finally:
            watcher.cancel()
            self.ticket.release()


async def _cancel_when_gone(receive, task: asyncio.Task) -> bool:
    await _disconnect(receive)
    return task.cancel()


def _client_left(watcher: asyncio.Future) -> bool:
    """Whether ``_cancel_when_gone`` saw the client leave and so cancelled the stream."""
    return watcher.done() and not watcher.cancelled() and watcher.exception() is None and watcher.result()


class _HotRoutes:
    """POST ``/v1/completions`` and ``/v1/chat/completions``, the routes nearly every request
    takes, called from here: FastAPI's way there (a path match per route in turn, the
    dependency solver, the exception and exit-stack middlewares, the response serializer)
    cost ~0.3 ms of CPU a request, for handlers that take the raw request and use none of
    it. A ``ServingError`` gets the body the app's handler gives it; anything else goes on
    to the app's 500, as from FastAPI's routes. Sits inside the token check and body limit."""

    def __init__(self, app, routes: dict[str, Callable[[Request], Awaitable]]):
        self.app = app
        self.routes = routes

    async def __call__(self, scope, receive, send):
        handler = (
            self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        )
        if handler is None:
            return await self.app(scope, receive, send)
        try:
            response = await handler(Request(scope, receive, send))
        except ServingError as exc:
            response = _serving_error_response(exc)
        if not isinstance(response, Response):
            response = JSONResponse(response)
        await response(scope, receive, send)


class _TokenAuth:
    """401 without the deployment's bearer token (``/health`` stays open). Plain ASGI: a
    Starlette ``BaseHTTPMiddleware`` would pass every streamed chunk through a task and a
    memory stream of its own."""

    def __init__(self, app, token: str):
        self.app = app
        self.token = token

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if token_matches(given.decode("latin-1") if given is not None else None, self.token):
            return await self.app(scope, receive, send)
        response = _error(401, "missing or wrong bearer token (header 'Authorization: Bearer <token>')")
        await response(scope, receive, send)


class _BodyLimit:
    """Refuses request bodies over ``max_bytes`` with 413 (declared or chunked alike), reading
    no more than that: the body is read here, whole, before the app sees any of it."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body"):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()  # what comes after the body: the client's disconnect
            delivered = True
            return whole

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        """Read the rest of the body first: a server that answers and closes while the client
        is still sending makes the client see a reset, not the 413."""
        drained = 0
        while drained < _DRAIN_LIMIT_BYTES:
            message = await receive()
            drained += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        response = _error(413, f"request body over {self.max_bytes} bytes")
        await response(scope, receive, send)


def _error_event(exc: ServingError) -> str:
    """A failure after the stream began, in band, in OpenAI's error shape."""
    return f"data: {json.dumps(error_body(exc.http_status, str(exc), _param_of(exc)))}\n\n"


async def _relayed_events(first: bytes, rest: AsyncIterator[bytes]):
    """A replica's stream as relayed; when it fails midway, the error in band and the end."""
    try:
        yield first
        async for block in rest:
            yield block
    except ServingError as exc:
        yield _error_event(exc) + "data: [DONE]\n\n"
    finally:
        await rest.aclose()


async def _tagged(stream: AsyncIterator[pb.GenerateResponse]):
    async for response in stream:
        yield 0, response


async def _chain(first, rest: AsyncIterator):
    yield first
    async for item in rest:
        yield item


async def _sse(
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
        async for prompt, response in _chain(first, rest):
            if relayed and response.WhichOneof("kind") == "complete" and response.complete.index == 0:
                complete = response.complete
            elif lines and response.chunk.index == 0:
                unshown.extend(response.chunk.token_ids)
            delta = builder.add(prompt, response)
            text = delta["text"] if "text" in delta else delta["delta"].get("content")
            shows = text or delta["logprobs"] or delta["finish_reason"]
            if shows:
                usage = builder.running_usage(delta["index"]) if options.continuous_usage_stats else None
                if delta["index"] == 0:
                    yield marked(builder.event([delta], usage), unshown)
                    unshown = []
                else:
                    yield marked(builder.event([delta], usage))
        if options.include_usage:
            yield marked(builder.event([], builder.openai_usage()))
        if complete is not None:
            yield trailer(complete)
    except ServingError as exc:  # a replica failed mid-stream: tell the client, in band
        yield marked(_error_event(exc), failed=exc.grpc_code.name)
    finally:
        await rest.aclose()
    yield marked("data: [DONE]\n\n")
