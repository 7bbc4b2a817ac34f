"""OpenAI-compatible HTTP front end (FastAPI), served by the router and by every replica.

``/v1/completions`` and ``/v1/chat/completions`` (SSE when ``stream``), ``/v1/models``,
vLLM-style ``/tokenize``, ``/detokenize``, ``/version`` and
``/v1[/chat]/completions/render``, SGLang-style ``/server_info``, ``/health`` (503 until
ready) and ``/metrics`` (Prometheus), over the ``ServedModels`` of a server: the router's
(a RouterCore per model) or a replica's one engine (``OneModel``), so the same code (and the
same error mapping, ``errors.py``) fronts both, and third-party routers (sglang-router,
vllm-router) can front the replicas too. A request's ``model`` picks its backend. Which
request fields are honoured is ``protocol.FIELD_RULES``.

This module only wires the app: the routes are ``handlers.py``'s, the middlewares
``middleware.py``'s, the streams ``streaming.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from kvmesh.serving.errors import ServingError
from kvmesh.serving.openai.backends import OneModel, OpenAIBackend, ServedModels
from kvmesh.serving.openai.errors import error_response, serving_error_response, validation_error
from kvmesh.serving.openai.handlers import Handlers
from kvmesh.serving.openai.middleware import BodyLimit, HotRoutes, TokenAuth
from kvmesh.serving.openai.relay import RELAY_PATHS

__all__ = ["OneModel", "OpenAIBackend", "ServedModels", "build_app"]


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
    ``relay_routes``: serve the routes a relaying router streams from (a replica's).
    ``on_request(headers)``: called as a generating request begins (the router's flow key)."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    routes = Handlers(models, health, on_request)
    hot = {"/v1/completions": routes.completions, "/v1/chat/completions": routes.chat_completions}
    app.add_middleware(HotRoutes, routes=hot)  # added first: inside the two below
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if auth_token:
        app.add_middleware(TokenAuth, token=auth_token)

    async def invalid(request: Request, exc: RequestValidationError):
        error = validation_error(exc.errors())
        return error_response(400, str(error), error.param)

    async def http_error(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail))

    async def serving_error(request: Request, exc: ServingError):
        return serving_error_response(exc)

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ServingError, serving_error)
    for path, handler in {
        "/health": routes.health_check,
        "/metrics": routes.metrics,
        "/version": routes.server_version,
        "/v1/models": routes.model_list,
        "/server_info": routes.server_info,
        "/get_server_info": routes.server_info,
    }.items():
        app.get(path)(handler)
    posts = {
        "/v1/completions/render": routes.render_completion,
        "/v1/chat/completions/render": routes.render_chat,
        "/tokenize": routes.tokenize,
        "/detokenize": routes.detokenize,
        **hot,  # FastAPI lists them too; HotRoutes serves them
    }
    if relay_routes:
        posts[RELAY_PATHS["completions"]] = routes.relayed_completions
        posts[RELAY_PATHS["chat"]] = routes.relayed_chat
    for path, handler in posts.items():
        app.post(path)(handler)
    return app
