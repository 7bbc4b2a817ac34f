"""OpenAI-compatible HTTP front end (FastAPI) over the same RouterCore as gRPC.

``/v1/completions`` and ``/v1/chat/completions`` (SSE when ``stream``), ``/v1/models``,
``/health`` (503 until a replica is live) and ``/metrics`` (Prometheus). Errors use
OpenAI's shape ``{"error": {"message", "type", "code"}}``: 400 for bad input, 404 for an
unknown model, 429 when overloaded, 503 with no live replica.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from kvmesh.protos import pb
from kvmesh.router.core import RouterCore
from kvmesh.router.errors import InvalidRequest, RouterError
from kvmesh.router.security import token_matches


class _Sampling(BaseModel):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    user: str | None = None  # used as the session affinity key
    policy: str | None = None  # kvmesh extension: per-request routing policy


class CompletionRequest(_Sampling):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class _UnknownModel(RouterError):
    http_status = 404


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "code": status}}
    )


def _to_proto(body: _Sampling, core: RouterCore) -> pb.GenerateRequest:
    if body.n != 1:
        raise InvalidRequest("only n=1 is supported")
    if body.model not in (None, "", core.model.model_id):
        raise _UnknownModel(
            f"model {body.model!r} is not served here; this router serves {core.model.model_id!r}"
        )
    for name, ids in (
        ("prompt", body.prompt if isinstance(body, CompletionRequest) else None),
        ("stop_token_ids", body.stop_token_ids),
    ):
        if isinstance(ids, list) and any(not 0 <= t < 2**32 for t in ids):
            raise InvalidRequest(f"{name}: token ids must be in [0, 2**32)")
    sampling = pb.SamplingParams(ignore_eos=body.ignore_eos, stop_token_ids=body.stop_token_ids or [])
    sampling.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop or [])
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    for name, value in (
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("top_k", body.top_k),
        ("seed", body.seed),
        ("max_tokens", max_tokens),
    ):
        if value is not None:
            if name in ("top_k", "seed", "max_tokens") and value < 0:
                raise InvalidRequest(f"{name} must be non-negative, got {value}")
            try:
                setattr(sampling, name, value)
            except (ValueError, TypeError, OverflowError):
                raise InvalidRequest(f"{name} {value!r} is out of range") from None
    request = pb.GenerateRequest(sampling=sampling, policy=body.policy or "", affinity_key=body.user or "")
    if isinstance(body, ChatRequest):
        request.chat.messages.extend(pb.ChatMessage(role=m.role, content=m.content) for m in body.messages)
    elif isinstance(body.prompt, str):
        request.text = body.prompt
    else:
        request.token_ids.ids.extend(body.prompt)
    return request


def _usage(complete: pb.Complete) -> dict:
    u = complete.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def build_app(
    core: RouterCore,
    live_replicas: Callable[[], int],
    auth_token: str | None = None,
    max_body_bytes: int = 4 << 20,
) -> FastAPI:
    app = FastAPI(title="kvmesh router", docs_url=None, redoc_url=None, openapi_url=None)
    model = core.model.model_id
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    if auth_token:

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if request.url.path == "/health" or token_matches(
                request.headers.get("authorization"), auth_token
            ):
                return await call_next(request)
            return _error(
                401,
                "missing or wrong bearer token (header 'Authorization: Bearer <token>')",
                "authentication_error",
            )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}", "invalid_request_error")

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError):
        kind = "invalid_request_error" if exc.http_status < 500 else "service_unavailable"
        return _error(exc.http_status, str(exc), kind)

    @app.get("/health")
    async def health():
        n = live_replicas()
        return JSONResponse(
            status_code=200 if n else 503, content={"status": "ok" if n else "no live replica", "replicas": n}
        )

    @app.get("/metrics")
    async def metrics():
        return Response(core.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "kvmesh",
            "max_model_len": core.model.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await _serve(body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        return await _serve(body, chat=True)

    async def _serve(body: _Sampling, chat: bool):
        stream = core.generate(_to_proto(body, core))
        first = await anext(stream)  # routing errors surface here, before any header is sent
        prefix = "chatcmpl" if chat else "cmpl"
        rid = f"{prefix}-{first.request_id}"
        created = int(time.time())
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            events = _sse(first, stream, rid, created, model, chat, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        text, complete = [], None
        async for response in _chain(first, stream):
            if response.WhichOneof("kind") == "chunk":
                text.append(response.chunk.text)
            else:
                complete = response.complete
        choice = {"index": 0, "finish_reason": complete.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(complete),
            "kvmesh": {
                "replica_id": complete.replica_id,
                "predicted_cached_tokens": complete.predicted_cached_tokens,
            },
        }

    return app


class _BodyLimit:
    """Refuses request bodies over ``max_bytes`` with 413, without reading them into memory."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope, receive, send):
        response = _error(413, f"request body over {self.max_bytes} bytes", "invalid_request_error")
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


async def _chain(first: pb.GenerateResponse, rest: AsyncIterator[pb.GenerateResponse]):
    yield first
    async for response in rest:
        yield response


async def _sse(first, rest, rid: str, created: int, model: str, chat: bool, include_usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list, usage: dict | None = None) -> str:
        payload = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def choice(text: str, finish: str | None, role: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

    try:
        if chat:
            yield event([choice("", None, role=True)])
        async for response in _chain(first, rest):
            if response.WhichOneof("kind") == "chunk":
                yield event([choice(response.chunk.text, None)])
            else:
                yield event([choice("", response.complete.finish_reason)])
                if include_usage:
                    yield event([], _usage(response.complete))
    except RouterError as exc:  # the replica failed mid-stream: tell the client, in band
        yield f"data: {json.dumps({'error': {'message': str(exc), 'code': exc.http_status}})}\n\n"
    yield "data: [DONE]\n\n"
