"""OpenAI-compatible HTTP front end (FastAPI), served by the router and by every replica.

``/v1/completions`` and ``/v1/chat/completions`` (SSE when ``stream``), ``/v1/models``,
vLLM-style ``/tokenize`` and ``/v1[/chat]/completions/render``, SGLang-style
``/server_info``, ``/health`` (503 until ready) and ``/metrics`` (Prometheus), over
any ``OpenAIBackend``: the router's RouterCore or a replica's own engine, so the same code
(and the same error mapping) fronts both, and third-party routers (sglang-router,
vllm-router) can front the replicas too. Errors use OpenAI's shape
``{"error": {"message", "type", "code"}}``: 400 for bad input, 404 for an unknown model,
429 when overloaded, 503 when nothing can serve.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from importlib.metadata import version
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field, field_validator

from kvmesh.protos import pb
from kvmesh.serving.auth import token_matches
from kvmesh.serving.errors import InvalidRequest, ServingError
from kvmesh.serving.model_info import ModelInfo

_VERSION = version("kvmesh")


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


class _ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[_ContentPart]

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[_ContentPart]) -> str:
        """OpenAI content parts (what guidellm's chat mode sends) join into one string."""
        if isinstance(content, str):
            return content
        if any(part.type != "text" or part.text is None for part in content):
            raise ValueError("only text content parts are supported")
        return "".join(part.text for part in content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # accepted for vLLM compatibility; the tokenizer's default applies


class OpenAIBackend(Protocol):
    """What the front end serves from (the router's RouterCore, or a replica's EngineBackend)."""

    model: ModelInfo

    async def prompt_ids(self, request: pb.GenerateRequest) -> list[int]: ...

    def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]: ...

    def render_metrics(self) -> bytes: ...


class _UnknownModel(ServingError):
    http_status = 404


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "code": status}}
    )


def _check_model(name: str | None, model: ModelInfo) -> None:
    if name not in (None, "", model.model_id):
        raise _UnknownModel(f"model {name!r} is not served here; this server serves {model.model_id!r}")


def _check_ids(name: str, ids) -> None:
    if isinstance(ids, list) and any(not 0 <= t < 2**32 for t in ids):
        raise InvalidRequest(f"{name}: token ids must be in [0, 2**32)")


def _set_prompt(
    request: pb.GenerateRequest, prompt: str | list[int] | None, messages: list[ChatMessage] | None
) -> None:
    """Chat messages, text or (checked) token ids, whichever the body has."""
    if messages:
        request.chat.messages.extend(pb.ChatMessage(role=m.role, content=m.content) for m in messages)
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        _check_ids("prompt", prompt)
        request.token_ids.ids.extend(prompt)
    else:
        raise InvalidRequest("set prompt or messages")


def _to_proto(body: _Sampling, model: ModelInfo) -> pb.GenerateRequest:
    if body.n != 1:
        raise InvalidRequest("only n=1 is supported")
    _check_model(body.model, model)
    request = pb.GenerateRequest(policy=body.policy or "", affinity_key=body.user or "")
    _set_prompt(request, getattr(body, "prompt", None), getattr(body, "messages", None))
    _check_ids("stop_token_ids", body.stop_token_ids)
    sampling = request.sampling
    sampling.ignore_eos = body.ignore_eos
    sampling.stop_token_ids.extend(body.stop_token_ids or [])
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
    backend: OpenAIBackend,
    health: Callable[[], dict],
    auth_token: str | None = None,
    max_body_bytes: int = 4 << 20,
    title: str = "kvmesh router",
) -> FastAPI:
    """``health()`` returns the /health body; ``status == "ok"`` means 200, else 503."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    model = backend.model.model_id
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

    @app.exception_handler(ServingError)
    async def _router_error(request: Request, exc: ServingError):
        kind = "invalid_request_error" if exc.http_status < 500 else "service_unavailable"
        return _error(exc.http_status, str(exc), kind)

    @app.get("/health")
    async def health_check():
        body = health()
        return JSONResponse(status_code=200 if body.get("status") == "ok" else 503, content=body)

    @app.get("/metrics")
    async def metrics():
        return Response(backend.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "kvmesh",
            "max_model_len": backend.model.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        """SGLang's metadata shape: sglang-router names the worker's model from it."""
        return {
            "served_model_name": model,
            "max_model_len": backend.model.max_model_len,
            "page_size": backend.model.block_size,
            "version": _VERSION,
        }

    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest):
        return [{"token_ids": await backend.prompt_ids(_to_proto(body, backend.model))}]

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatRequest):
        """vLLM's render shape: vllm-router's cache_aware policy asks every worker for it."""
        return [{"token_ids": await backend.prompt_ids(_to_proto(body, backend.model))}]

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(body.model, backend.model)
        request = pb.GenerateRequest()
        _set_prompt(request, body.prompt, body.messages)
        tokens = await backend.prompt_ids(request)
        return {"count": len(tokens), "max_model_len": backend.model.max_model_len, "tokens": tokens}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await _serve(body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        return await _serve(body, chat=True)

    async def _serve(body: _Sampling, chat: bool):
        stream = backend.generate(_to_proto(body, backend.model))
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
    except ServingError as exc:  # the replica failed mid-stream: tell the client, in band
        yield f"data: {json.dumps({'error': {'message': str(exc), 'code': exc.http_status}})}\n\n"
    yield "data: [DONE]\n\n"
