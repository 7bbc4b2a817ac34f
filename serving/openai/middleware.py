"""The front end's ASGI middlewares, plain ASGI (a Starlette ``BaseHTTPMiddleware`` would
pass every streamed chunk through a task and a memory stream of its own): the bearer token,
the body limit, and the hot routes served without FastAPI's routing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvmesh.serving.auth import token_matches
from kvmesh.serving.errors import ServingError
from kvmesh.serving.openai.errors import error_response, serving_error_response

# An oversized body is read (and dropped) up to this much, so the client gets its 413
# instead of a connection reset; beyond it the connection is simply closed.
DRAIN_LIMIT_BYTES = 64 << 20


class HotRoutes:
    """POST ``/v1/completions`` and ``/v1/chat/completions``, the routes nearly every request
    takes, called from here: FastAPI's way there (a path match per route in turn, the
    dependency solver, the exception and exit-stack middlewares, the response serializer)
    cost more CPU than the rest of the request's handling, for handlers that take the raw
    request and use none of it. A ``ServingError`` gets the body the app's handler gives it; anything else goes on
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
            response = serving_error_response(exc)
        if not isinstance(response, Response):
            response = JSONResponse(response)
        await response(scope, receive, send)


class TokenAuth:
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
        response = error_response(
            401, "missing or wrong bearer token (header 'Authorization: Bearer <token>')"
        )
        await response(scope, receive, send)


class BodyLimit:
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
        while drained < DRAIN_LIMIT_BYTES:
            message = await receive()
            drained += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        response = error_response(413, f"request body over {self.max_bytes} bytes")
        await response(scope, receive, send)
