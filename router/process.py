"""One router process assembled: gRPC ``kvmesh.v1.Router`` + OpenAI HTTP, over the shared index.

Reads the model folder only for its tokenizer and config (never loads weights or torch).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from kvmesh.kvcache.index import INDEX_ERRORS, IndexSettingsError
from kvmesh.protos import pb_grpc
from kvmesh.router.config import RouterConfig
from kvmesh.router.core import RouterCore
from kvmesh.router.decision import RoutingOptions
from kvmesh.router.grpc_service import RouterService
from kvmesh.router.registry import ReplicaRegistry
from kvmesh.router.shared_load import FleetLoad
from kvmesh.serving import tracing
from kvmesh.serving.auth import TokenAuthInterceptor
from kvmesh.serving.grpc_server import GrpcServer, check_free, start_grpc_server
from kvmesh.serving.http_server import HttpServer, start_http_server
from kvmesh.serving.index_connection import RedisCredentials, connect_index
from kvmesh.serving.model_info import ModelInfo
from kvmesh.serving.model_lock import reading_model
from kvmesh.serving.open_endpoint import METRICS_TYPE, start_open_endpoint
from kvmesh.serving.openai.app import build_app
from kvmesh.serving.options import effective_config

log = logging.getLogger(__name__)


class RouterServer:
    def __init__(self, config: RouterConfig, redis_credentials: RedisCredentials | None = None):
        """``redis_credentials``: its Redis user (default: from this process's environment)."""
        if not config.redis_url:
            raise ValueError("the router needs the prefix index's redis_url")
        self.config = config
        self.model_id = config.model_id or Path(config.model_dir).resolve().name
        with reading_model(config.model_dir):  # no download swaps the folder while it is read
            self.tokenizer = config.api.load_tokenizer(config.model_dir)
            self.defaults = config.api.load_defaults(config.model_dir)
        # With block size "auto" the model's hash namespace is known once a replica stored it.
        self.model = self._model_info(config.block_size) if config.block_size else None
        seed = self.model.hash_seed if self.model else None
        self.index = connect_index(
            config.redis_url, self.model_id, config.block_size, seed, config.deployment, redis_credentials
        )
        self.fleet = (
            FleetLoad(self.index, speculative_ttl_s=config.speculative_ttl_s)
            if config.shared_load == "on"
            else None
        )
        self.registry = ReplicaRegistry(
            self.index,
            refresh_s=config.refresh_s,
            tls=config.tls,
            fleet=self.fleet,
            replica_token=config.replica_token(),
        )
        self.service = RouterService(
            None, json.dumps(effective_config(config)), config.connections.stream_write_timeout_s
        )
        self.core: RouterCore | None = None
        self.grpc: GrpcServer | None = None
        self.http: HttpServer | None = None
        self.open_endpoint: asyncio.Server | None = None  # /metrics and /health, no token

    def _model_info(self, block_size: int) -> ModelInfo:
        c = self.config
        with reading_model(c.model_dir):
            return ModelInfo.from_folder(
                c.model_dir, self.model_id, block_size, c.max_model_len, c.api.served_model_name
            )

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
        if self.model is None:
            self.model = await self._learn_block_size()
        else:
            await self._store_settings()
        options = RoutingOptions(
            self.config.policy,
            self.config.limits,
            self.defaults,
            speculative_ttl_s=self.config.speculative_ttl_s,
            index_health=self.config.index_health,
        )
        self.core = RouterCore(self.model, self.tokenizer, self.index, self.registry, options)
        self.service.core = self.core
        self.registry.on_change(self._health_follows)
        if self.fleet is not None:
            self.fleet.on_synced = self.core.metrics.fleet_sync.observe
            self.core.metrics.fleet_routers.set_function(lambda: self.fleet.routers)
            await self.fleet.start()
        await self.registry.start()
        if self.config.serves_http:
            app = build_app(
                self.core,
                self.health,
                auth_token=token,
                max_body_bytes=self.config.max_message_bytes,
            )
            self.http = await start_http_server(
                app,
                self.config.host,
                self.config.http_port,
                self.config.tls,
                self.config.connections.stream_write_timeout_s,
            )
        log.info("router serving", extra={"grpc": self.address, "http_port": self.http_port})

    async def _start_open_endpoint(self) -> asyncio.Server:
        async def metrics() -> tuple[int, str, bytes]:
            return 200, METRICS_TYPE, self.core.render_metrics() if self.core else b""

        async def health() -> tuple[int, str, bytes]:
            body = self.health()
            return 200 if body["status"] == "ok" else 503, "application/json", json.dumps(body).encode()

        c = self.config
        check_free(c.host, c.metrics_port, "metrics")
        return await start_open_endpoint(c.host, c.metrics_port, {"/metrics": metrics, "/health": health})

    @property
    def metrics_port(self) -> int | None:
        return self.open_endpoint.sockets[0].getsockname()[1] if self.open_endpoint else None

    async def _store_settings(self) -> None:
        try:
            await self.index.ensure_settings()
        except IndexSettingsError:
            raise
        except INDEX_ERRORS as exc:  # Redis away at start: serve anyway, the registry keeps trying
            log.warning("prefix index unreachable at start", extra={"error": str(exc)})

    async def _learn_block_size(self) -> ModelInfo:
        """Block size "auto": the one the replicas chose (they store it when they register)."""
        said = False
        while True:
            try:
                settings = await self.index.settings()
            except INDEX_ERRORS as exc:
                settings = None
                if not said:
                    log.warning("prefix index unreachable, waiting for it", extra={"error": str(exc)})
            if settings:
                model = self._model_info(int(settings["block_size"]))
                if str(model.hash_seed) != settings.get("hash_seed"):
                    raise IndexSettingsError(
                        f"the replicas of {self.model_id!r} hash with seed {settings.get('hash_seed')}, "
                        f"this router would use {model.hash_seed}"
                    )
                log.info("block size from the replicas", extra={"block_size": model.block_size})
                return model
            if not said:
                log.info(
                    "waiting for a replica to register the model's block size", extra={"model": self.model_id}
                )
                said = True
            await asyncio.sleep(self.config.refresh_s)

    async def _health_follows(self, live: int) -> None:
        await self.grpc.set_serving(live > 0)

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http else None

    def health(self) -> dict:
        """/health: ok while this router routes (503 while draining, or with no live replica)."""
        live = len(self.registry.live()) if self.core else 0
        draining = bool(self.core and self.core.draining)
        return {"status": "draining" if draining else "ok" if live else "no live replica", "replicas": live}

    async def stop(self, grace: float | None = None) -> None:
        """Drain: health goes NOT_SERVING (and /health 503) and new requests are refused at
        once; in-flight streams get what is left of ``grace`` seconds (default: the config's
        drain timeout), which bounds the whole stop; then everything closes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.drain_timeout_s if grace is None else grace)
        if self.core:
            self.core.draining = True
        if self.grpc:
            await self.grpc.set_serving(False)
            while self.core and self.core.active and loop.time() < deadline:
                await asyncio.sleep(0.05)
            await self.service.cut_off()
            # No grace: during one the server accepts calls it never serves, and they end
            # CANCELLED; stopped at once, new calls see the listener gone (UNAVAILABLE).
            await self.grpc.stop(0)
        if self.http:
            await self.http.stop(max(0.0, deadline - loop.time()))
        if self.open_endpoint:
            self.open_endpoint.close()
        if self.core:
            await self.core.stop()
        if self.fleet is not None:
            await self.fleet.stop()
        await self.registry.stop()
        await self.index.close()
