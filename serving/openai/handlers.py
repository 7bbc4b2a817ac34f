"""The front end's routes, one method each, over the ``ServedModels`` of a server: every route
that does work for a request (generate, render, tokenize, detokenize) finds its model's
backend, takes its in-flight slots (``backend.admit``) first, a batch all its prompts at
once, and parses, renders and tokenizes off the event loop when the request is large."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from importlib.metadata import version
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from kvmesh.serving import tracing
from kvmesh.serving.admission import Ticket
from kvmesh.serving.errors import InvalidRequest
from kvmesh.serving.http_server import DIRECT_BODY
from kvmesh.serving.offload import sized
from kvmesh.serving.openai.backends import OpenAIBackend, ServedModels, SseRelayBackend
from kvmesh.serving.openai.errors import validation_error
from kvmesh.serving.openai.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
)
from kvmesh.serving.openai.relay import ChatEnvelope, CompletionEnvelope, RelayEnvelope
from kvmesh.serving.openai.requests import Plan, chat_plan, completion_plan, session_key_of, tokenize_request
from kvmesh.serving.openai.responses import Echo, ResponseBuilder, TokenNames
from kvmesh.serving.openai.streaming import (
    EventStream,
    chain,
    relayed_events,
    released_unless_streaming,
    sse,
    tagged,
    unless_client_leaves,
)
from kvmesh.serving.streams import merge

_VERSION = version("kvmesh")
Body = TypeVar("Body", bound=BaseModel)


async def parsed(raw: Request, model: type[Body]) -> tuple[Body, int]:
    """The request body as ``model``, and its size in bytes (which decides whether the work
    for it runs off the event loop: parsing a large body included)."""
    data = await raw.body()
    try:
        return await sized(len(data), parse_body, data, model), len(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def parse_body(data: bytes, model: type[Body]) -> Body:
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid UTF-8 JSON ({exc.reason})") from None
    return model.model_validate_json(text)


class Handlers:
    """``health()`` returns the /health body (``status == "ok"``: 200, else 503);
    ``on_request(headers)`` is called as a generating request begins (the router's flow key)."""

    def __init__(
        self,
        models: ServedModels,
        health: Callable[[], dict],
        on_request: Callable[[Mapping[str, str]], None] | None = None,
    ):
        self.models, self.health, self.on_request = models, health, on_request

    async def health_check(self):
        body = self.health()
        return JSONResponse(status_code=200 if body.get("status") == "ok" else 503, content=body)

    async def metrics(self):
        return Response(self.models.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    async def server_version(self):
        return {"version": _VERSION}

    async def model_list(self):
        cards = [
            {
                "id": backend.model.api_name,
                "object": "model",
                "created": 0,
                "owned_by": "kvmesh",
                "root": backend.model.model_id,
                "max_model_len": backend.model.max_model_len,
            }
            for backend in self.models.serving()
        ]
        return {"object": "list", "data": cards}

    async def server_info(self):
        """SGLang's metadata shape (one model: sglang-router names the worker's model from it)."""
        backend = self.models.backend(None)
        return {
            "served_model_name": backend.model.api_name,
            "max_model_len": backend.model.max_model_len,
            "page_size": backend.model.block_size,
            "version": _VERSION,
        }

    async def render_completion(self, raw: Request):
        body, size = await parsed(raw, CompletionRequest)
        backend = self.models.backend(body.model)
        prompts = len(body.prompts())
        backend.inputs.check_batch(prompts, 1)
        with backend.admit(prompts, body.policy or ""):
            plan = await sized(size, completion_plan, body, backend.tokenizer)
            return [{"token_ids": await backend.prompt_ids(r)} for r in plan.requests]

    async def render_chat(self, raw: Request):
        """vLLM's render shape: vllm-router's cache_aware policy asks every worker for it."""
        body, size = await parsed(raw, ChatRequest)
        backend = self.models.backend(body.model)
        with backend.admit(1, body.policy or ""):
            plan = await sized(size, chat_plan, body)
            return [{"token_ids": await backend.prompt_ids(plan.requests[0])}]

    async def tokenize(self, raw: Request):
        body, size = await parsed(raw, TokenizeRequest)
        backend = self.models.backend(body.model)
        with backend.admit(1):
            request = await sized(size, tokenize_request, body, backend.tokenizer)
            tokens = await backend.prompt_ids(request)
            reply = {"count": len(tokens), "max_model_len": backend.model.max_model_len, "tokens": tokens}
            if body.return_token_strs:
                reply["token_strs"] = await sized(size, TokenNames(backend.tokenizer), tokens)
            return reply

    async def detokenize(self, raw: Request):
        body, size = await parsed(raw, DetokenizeRequest)
        backend = self.models.backend(body.model)
        if backend.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer", param="tokens")
        bad = next((t for t in body.tokens if not 0 <= t < backend.model.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary", param="tokens")
        with backend.admit(1):
            return {"prompt": await sized(size, backend.tokenizer.decode, body.tokens)}

    async def completions(self, raw: Request):
        if self.on_request is not None:
            self.on_request(raw.headers)
        body, size = await parsed(raw, CompletionRequest)
        body.check_supported()
        backend = self.models.backend(body.model)
        prompts = len(body.prompts())
        backend.inputs.check_batch(prompts, body.n)
        session = session_key_of(raw.headers, body, backend.inputs)
        ticket = backend.admit(prompts, body.policy or "")
        with released_unless_streaming(ticket):
            plan = await sized(size, completion_plan, body, backend.tokenizer, session)
            if self._relayed(backend, body, plan):
                return await self._relay(backend, raw, plan, False, ticket)
            echoes = await self._echoes(backend, body, plan, size) if plan.echo_prompt else None
            return await self._serve(backend, raw, body, plan, False, echoes, ticket)

    async def chat_completions(self, raw: Request):
        if self.on_request is not None:
            self.on_request(raw.headers)
        body, size = await parsed(raw, ChatRequest)
        body.check_supported()
        backend = self.models.backend(body.model)
        backend.inputs.check_batch(1, body.n)
        session = session_key_of(raw.headers, body, backend.inputs)
        ticket = backend.admit(1, body.policy or "")
        with released_unless_streaming(ticket):
            plan = await sized(size, chat_plan, body, session)
            if self._relayed(backend, body, plan):
                return await self._relay(backend, raw, plan, True, ticket)
            return await self._serve(backend, raw, body, plan, True, None, ticket)

    async def relayed_completions(self, raw: Request):
        envelope, size = await parsed(raw, CompletionEnvelope)
        return await self._serve_envelope(raw, envelope, False, size)

    async def relayed_chat(self, raw: Request):
        envelope, size = await parsed(raw, ChatEnvelope)
        return await self._serve_envelope(raw, envelope, True, size)

    def _relayed(self, backend: OpenAIBackend, body: CompletionRequest | ChatRequest, plan: Plan) -> bool:
        """Whether the backend relays this request's SSE from a replica, byte for byte."""
        return body.stream and len(plan.requests) == 1 and backend.relays_sse

    async def _relay(self, backend: OpenAIBackend, raw: Request, plan: Plan, chat: bool, ticket: Ticket):
        relay: SseRelayBackend = backend  # type: ignore[assignment]
        stream = relay.generate_sse(
            plan.requests[0], chat, await raw.body(), tracing.extract(raw.headers), raw.scope.get(DIRECT_BODY)
        )
        first = await unless_client_leaves(raw, anext(stream))  # routing errors: before any header
        return EventStream(relayed_events(first, stream), ticket)

    async def _serve_envelope(
        self, raw: Request, envelope: ChatEnvelope | CompletionEnvelope, chat: bool, size: int
    ):
        """A router's relayed stream: the client's body, the router's token ids and ids (the
        router chose this server's model: the body's name is the router's for it)."""
        backend = self.models.backend(None)
        body = envelope.request
        body.check_supported()
        if not body.stream or (not chat and len(body.prompts()) != 1):
            raise InvalidRequest("a relayed request is one streamed prompt")
        ticket = backend.admit(1)
        with released_unless_streaming(ticket):
            if chat:
                plan = await sized(size, chat_plan, body)
            else:
                plan = await sized(size, completion_plan, body, backend.tokenizer)
            envelope.upstream(plan.requests[0])
            echoed = plan.echo_prompt and not envelope.continued_tokens  # a continuation echoes nothing
            echoes = await self._echoes(backend, body, plan, size) if echoed else None
            return await self._serve(backend, raw, body, plan, chat, echoes, ticket, envelope)

    async def _echoes(
        self, backend: OpenAIBackend, body: CompletionRequest, plan: Plan, size: int
    ) -> list[Echo]:
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
        self,
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
        responses = merge(streams) if len(streams) > 1 else tagged(streams[0])
        token_names = TokenNames(None if body.return_tokens_as_token_ids else backend.tokenizer)

        def builder_for(first) -> ResponseBuilder:
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{first[1].request_id}"
            shown = relayed.model if relayed else backend.model.api_name
            created = relayed.created if relayed and relayed.created else int(time.time())
            return ResponseBuilder(plan, chat, shown, token_names, rid, created, echoes)

        if body.stream:
            # routing errors surface here, before any header is sent
            first = await unless_client_leaves(raw, anext(responses))
            options = body.stream_options or StreamOptions()
            events = sse(builder_for(first), first, responses, options, relayed)
            return EventStream(events, ticket)

        async def whole() -> JSONResponse:
            first = await anext(responses)
            builder = builder_for(first)
            total = 0
            async for prompt, response in chain(first, responses):
                size = response.ByteSize()
                total += size
                await sized(size, builder.add, prompt, response)
            return await sized(total, JSONResponse, builder.body())

        return await unless_client_leaves(raw, whole())  # one watch for the whole answer
