"""One router process: gRPC ``kvmesh.v1.Router`` + OpenAI HTTP, over the shared index.

Reads the model folder only for its tokenizer and config (never loads weights or torch).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.kvcache import namespace_seed
from kvmesh.protos import pb_grpc
from kvmesh.router.core import ModelInfo, RouterCore, RouterLimits
from kvmesh.router.grpc_server import GrpcServer, start_grpc_server
from kvmesh.router.http import build_app
from kvmesh.router.http_server import HttpServer, start_http_server
from kvmesh.router.index import IndexSettingsError, PrefixIndex
from kvmesh.router.registry import ReplicaRegistry
from kvmesh.router.security import TLSConfig, TokenAuthInterceptor
from kvmesh.router.service import RouterService
from kvmesh.router.tokenization import PromptTokenizer

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    model_dir: str
    redis_url: str
    model_id: str | None = None  # default: the model folder's name (as replicas use)
    block_size: int = 16
    max_model_len: int | None = None
    host: str = "127.0.0.1"
    port: int = 0  # gRPC; 0 = any free port
    http_port: int | None = 0  # None: no HTTP front end
    policy: str = "prefix"
    refresh_s: float = 0.5
    speculative_ttl_s: float = 2.0
    limits: RouterLimits = field(default_factory=RouterLimits)
    max_message_bytes: int = 4 << 20  # gRPC and HTTP request bodies; larger: RESOURCE_EXHAUSTED / 413
    tls: TLSConfig = field(default_factory=TLSConfig)  # serving TLS (gRPC + HTTPS) and toward replicas
    auth_token: str | None = None  # bearer token clients must send (None: open)


def model_info(config: RouterConfig) -> ModelInfo:
    path = Path(config.model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {str(path)!r} has no config.json")
    hf = json.loads((path / "config.json").read_text())
    model_id = config.model_id or path.resolve().name
    max_len = config.max_model_len or hf.get("max_position_embeddings") or 4096
    return ModelInfo(
        model_id=model_id,
        block_size=config.block_size,
        max_model_len=max_len,
        vocab_size=hf["vocab_size"],
        hash_seed=namespace_seed(model_id, config.block_size),
    )


class RouterServer:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.model = model_info(config)
        tokenizer = (
            PromptTokenizer(config.model_dir)
            if (Path(config.model_dir) / "tokenizer.json").is_file()
            else None
        )
        self.index = PrefixIndex.from_url(
            config.redis_url, self.model.model_id, self.model.block_size, self.model.hash_seed
        )
        self.registry = ReplicaRegistry(self.index, refresh_s=config.refresh_s, tls=config.tls)
        self.core = RouterCore(
            self.model,
            tokenizer,
            self.index,
            self.registry,
            config.policy,
            speculative_ttl_s=config.speculative_ttl_s,
            limits=config.limits,
        )
        self.grpc: GrpcServer | None = None
        self.http: HttpServer | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.grpc.port}"

    async def start(self) -> None:
        try:
            await self.index.ensure_settings()
        except IndexSettingsError:
            raise
        except Exception as exc:  # Redis away at start: serve anyway, the registry keeps trying
            log.warning("prefix index unreachable at start", extra={"error": str(exc)})
        interceptors = [TokenAuthInterceptor(self.config.auth_token)] if self.config.auth_token else []
        self.grpc = await start_grpc_server(
            [(pb_grpc.add_RouterServicer_to_server, RouterService(self.core), "kvmesh.v1.Router")],
            self.config.host,
            self.config.port,
            serving=False,
            tls=self.config.tls,
            interceptors=interceptors,
            max_message_bytes=self.config.max_message_bytes,
        )
        self.registry.on_change(self._health_follows)
        await self.registry.start()
        if self.config.http_port is not None:
            app = build_app(
                self.core,
                self.health,
                auth_token=self.config.auth_token,
                max_body_bytes=self.config.max_message_bytes,
            )
            self.http = await start_http_server(app, self.config.host, self.config.http_port, self.config.tls)
        log.info("router serving", extra={"grpc": self.address, "http_port": self.http_port})

    async def _health_follows(self, live: int) -> None:
        await self.grpc.set_serving(live > 0)

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http else None

    def health(self) -> dict:
        live = len(self.registry.live())
        return {"status": "ok" if live else "no live replica", "replicas": live}

    async def stop(self, grace: float = 5.0) -> None:
        """Drain: health goes NOT_SERVING and new requests are refused at once, in-flight
        streams get up to ``grace`` seconds, then everything closes."""
        self.core.draining = True
        if self.grpc:
            await self.grpc.set_serving(False)
            deadline = asyncio.get_running_loop().time() + grace
            while self.core.active and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            await self.grpc.stop(max(0.0, deadline - asyncio.get_running_loop().time()))
        if self.http:
            await self.http.stop(grace)
        await self.registry.stop()
        await self.index.close()
