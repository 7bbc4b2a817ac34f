"""One router process assembled: gRPC ``kvmesh.v1.Router`` + OpenAI HTTP, over the shared index,
for one model or several (``models.py``: a route per model).

Reads the model folders only for their tokenizers and configs (never loads weights or torch).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Sequence

from kvmesh.kvcache.index.api import PrefixIndex
from kvmesh.protos import pb_grpc
from kvmesh.router.config import RouterConfig
from kvmesh.router.core import RouterCore
from kvmesh.router.flow import FLOW_KEY
from kvmesh.router.grpc_service import RouterService
from kvmesh.router.registry import ReplicaRegistry
from kvmesh.router.routes import ModelRoutes
from kvmesh.serving import tracing
from kvmesh.serving.auth import TokenAuthInterceptor
from kvmesh.serving.background import failing_loops
from kvmesh.serving.grpc_server import GrpcServer, check_free, start_grpc_server
from kvmesh.serving.http_server import HttpServer, start_http_server
from kvmesh.serving.index_connection import RedisCredentials
from kvmesh.serving.open_endpoint import METRICS_TYPE, start_open_endpoint
from kvmesh.serving.openai.app import build_app

log = logging.getLogger(__name__)


class RouterServer:
    """``config``: one model's router, or one config per model (alike but for their per-model
    fields: ``option(per_model=True)``), all behind the same ports."""

    def __init__(
        self, config: RouterConfig | Sequence[RouterConfig], redis_credentials: RedisCredentials | None = None
    ):
        """``redis_credentials``: its Redis user (default: from this process's environment)."""
        configs = [config] if isinstance(config, RouterConfig) else list(config)
        if not configs or not configs[0].redis_url:
            raise ValueError("the router needs the prefix index's redis_url")
        _check_alike(configs)
        self.config = configs[0]
        self.models = ModelRoutes(configs, redis_credentials)
        self.service = RouterService(self.models, self.config.connections.stream_write_timeout_s)
        self.grpc: GrpcServer | None = None
        self.http: HttpServer | None = None
        self.open_endpoint: asyncio.Server | None = None  # /metrics and /health, no token
        self._starts: list[asyncio.Task] = []  # each model's route, until its block size is known

    # A one-model router's parts (of several models: the first's).
    @property
    def core(self) -> RouterCore | None:
        return self.models.routes[0].core

    @property
    def registry(self) -> ReplicaRegistry:
        return self.models.routes[0].registry

    @property
    def index(self) -> PrefixIndex:
        return self.models.routes[0].index

    @property
    def model_id(self) -> str:
        return self.models.routes[0].model_id

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.grpc.port}"

    async def start(self) -> None:
        """Serve gRPC at once (health NOT_SERVING, requests UNAVAILABLE until the model's block
        size is known and a replica is live), then routing, then HTTP."""
        if self.config.otlp_endpoint:
            tracing.configure("kvmesh-router", self.config.otlp_endpoint)
        token = self.config.client_token()
        interceptors = [TokenAuthInterceptor(token)] if token else []
        if self.config.http_port > 0:  # HTTP listens only once routing can start: fail fast now
            check_free(self.config.host, self.config.http_port, "HTTP")
        if self.config.metrics_port >= 0:  # probes see NOT ready from the start
            self.open_endpoint = await self._start_open_endpoint()
        self.grpc = await start_grpc_server(
            [(pb_grpc.add_RouterServicer_to_server, self.service, "kvmesh.v1.Router")],
            self.config.host,
            self.config.port,
            serving=False,
            tls=self.config.tls,
            interceptors=interceptors,
            max_message_bytes=self.config.max_message_bytes,
            connections=self.config.connections,
        )
        self._starts = [asyncio.create_task(r.start(self._health_follows)) for r in self.models.routes]
        await self._first_route()
        if self.config.serves_http:
            app = build_app(
                self.models,
                self.health,
                auth_token=token,
                max_body_bytes=self.config.max_message_bytes,
                on_request=lambda headers: FLOW_KEY.set(self.config.flow.key(headers)),
            )
            self.http = await start_http_server(
                app,
                self.config.host,
                self.config.http_port,
                self.config.tls,
                self.config.connections,
            )
        log.info("router serving", extra={"grpc": self.address, "http_port": self.http_port})

    async def _start_open_endpoint(self) -> asyncio.Server:
        async def metrics() -> tuple[int, str, bytes]:
            return 200, METRICS_TYPE, self.models.render_metrics()

        async def health() -> tuple[int, str, bytes]:
            body = self.health()
            return 200 if body["status"] == "ok" else 503, "application/json", json.dumps(body).encode()

        c = self.config
        check_free(c.host, c.metrics_port, "metrics")
        return await start_open_endpoint(c.host, c.metrics_port, {"/metrics": metrics, "/health": health})

    @property
    def metrics_port(self) -> int | None:
        return self.open_endpoint.sockets[0].getsockname()[1] if self.open_endpoint else None

    async def _first_route(self) -> None:
        """Until one model routes (HTTP starts then); a model whose route fails to start fails
        the router while none routes yet, later it is logged and that model stays unavailable."""
        pending = set(self._starts)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises a start's error
            if self.models.cores:
                break
        for task in pending:
            task.add_done_callback(_log_failed_start)

    async def _health_follows(self, live: int) -> None:
        await self.grpc.set_serving(any(route.live for route in self.models.routes))

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http else None

    def health(self) -> dict:
        """/health: ok while this router routes (503 while draining, or with no live replica of
        any model); the live replicas in all, and of each model; background loops that failed
        lately (they are restarted, but one that keeps failing leaves part of the router stale)."""
        models = {route.api_name: route.live for route in self.models.routes}
        live = sum(models.values())
        status = "draining" if self._draining else "ok" if live else "no live replica"
        body = {"status": status, "replicas": live, "models": models}
        if failing := failing_loops():
            body["failing_loops"] = failing
        return body

    @property
    def _draining(self) -> bool:
        return any(core.draining for core in self.models.cores)

    @property
    def _active(self) -> int:
        return sum(core.active for core in self.models.cores)

    async def stop(self, grace: float | None = None) -> None:
        """Drain: health goes NOT_SERVING (and /health 503) and new requests are refused at
        once; in-flight streams get what is left of ``grace`` seconds (default: the config's
        drain timeout), which bounds the whole stop; then everything closes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.drain_timeout_s if grace is None else grace)
        for task in self._starts:
            task.cancel()
        for core in self.models.cores:
            core.draining = True
        if self.grpc:
            await self.grpc.set_serving(False)
            while self._active and loop.time() < deadline:
                await asyncio.sleep(0.05)
            await self.service.cut_off()
            # No grace: during one the server accepts calls it never serves, and they end
            # CANCELLED; stopped at once, new calls see the listener gone (UNAVAILABLE).
            await self.grpc.stop(0)
        if self.http:
            await self.http.stop(max(0.0, deadline - loop.time()))
        if self.open_endpoint:
            self.open_endpoint.close()
        for route in self.models.routes:
            await route.stop()


def _check_alike(configs: Sequence[RouterConfig]) -> None:
    """The models of one router differ only in their per-model settings."""
    shared = [f.name for f in dataclasses.fields(RouterConfig) if not f.metadata["per_model"]]
    for config in configs[1:]:
        differ = [name for name in shared if getattr(config, name) != getattr(configs[0], name)]
        if differ:
            raise ValueError(f"the models of one router differ in router-wide settings: {', '.join(differ)}")


def _log_failed_start(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a model's route failed to start", extra={"error": str(task.exception())})
