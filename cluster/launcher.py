"""A whole kvmesh deployment in one process tree: Ray, Redis, N replica actors, the router.

``kvmesh up``, ``kvmesh demo``, the end-to-end tests and the router benchmark all use
LocalCluster, so they exercise exactly what users run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

import ray

from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.cluster.logs import redacted
from kvmesh.cluster.supervisor import Supervisor
from kvmesh.kvcache import namespace_seed
from kvmesh.replica.actor import cluster_has_gpus
from kvmesh.replica.server import ReplicaConfig
from kvmesh.router.core import RouterLimits
from kvmesh.router.index import PrefixIndex
from kvmesh.router.security import TLSConfig
from kvmesh.router.server import RouterConfig, RouterServer

log = logging.getLogger(__name__)


@dataclass
class ClusterConfig:
    model_dir: str
    replicas: int = 2
    redis_url: str | None = None  # None: an embedded valkey-server
    ray_address: str | None = None  # None: a local Ray
    host: str = "127.0.0.1"  # where the router listens
    replica_host: str = (
        "127.0.0.1"  # where replicas listen (0.0.0.0 on Kubernetes: they advertise their node IP)
    )
    router: bool = True  # False: replicas and supervisor only (the chart's controller)
    port: int = 0  # router gRPC
    http_port: int | None = 0  # router HTTP (None: off)
    policy: str = "prefix"
    block_size: int = 16
    model_id: str | None = None
    heartbeat_s: float = 1.0
    ttl_s: float = 5.0
    engine: dict = field(default_factory=dict)  # more LLMEngine options (num_kv_blocks, ...)
    tls: TLSConfig = field(default_factory=TLSConfig)  # every gRPC hop (router and replicas)
    auth_token: str | None = None  # bearer token clients must present to the router
    limits: RouterLimits = field(default_factory=RouterLimits)
    verbose: bool = False


class LocalCluster:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.redis_url = config.redis_url
        self.supervisor: Supervisor | None = None
        self.router: RouterServer | None = None
        self._index: PrefixIndex | None = None
        self._owns_ray = False

    @property
    def router_address(self) -> str:
        return self.router.address

    @property
    def index(self) -> PrefixIndex:
        return self._index

    @property
    def http_url(self) -> str | None:
        return f"http://{self.config.host}:{self.router.http_port}" if self.router.http_port else None

    async def start(self, ready_timeout_s: float = 600.0) -> LocalCluster:
        c = self.config
        if not ray.is_initialized():
            local_cpus = None if c.ray_address else max(os.cpu_count() or 1, c.replicas + 1)
            ray.init(
                address=c.ray_address,
                num_cpus=local_cpus,
                include_dashboard=False,
                log_to_driver=c.verbose,
                logging_level=logging.INFO if c.verbose else logging.ERROR,
            )
            self._owns_ray = True
        if self.redis_url is None:
            self.redis = EmbeddedRedis().start()
            self.redis_url = self.redis.url
        model_id = c.model_id or os.path.basename(os.path.realpath(c.model_dir))
        self._index = PrefixIndex.from_url(
            self.redis_url, model_id, c.block_size, namespace_seed(model_id, c.block_size)
        )
        use_gpu = cluster_has_gpus()
        threads = None if use_gpu else max(1, (os.cpu_count() or 1) // c.replicas)
        engine = {"block_size": c.block_size, **c.engine}

        def replica_config(replica_id: str) -> ReplicaConfig:
            return ReplicaConfig(
                c.model_dir, replica_id, self.redis_url, model_id=model_id, host=c.replica_host, heartbeat_s=c.heartbeat_s,
                ttl_s=c.ttl_s, torch_threads=threads, tls=c.tls, engine=engine,
            )  # fmt: skip

        self.supervisor = Supervisor(replica_config, c.replicas, use_gpu, self._index)
        await self.supervisor.start()
        if not c.router:
            await self.wait_for_replicas(c.replicas, ready_timeout_s)
            return self
        self.router = RouterServer(
            RouterConfig(
                c.model_dir, self.redis_url, model_id=model_id, block_size=c.block_size, host=c.host, port=c.port,
                http_port=c.http_port, policy=c.policy, tls=c.tls, auth_token=c.auth_token, limits=c.limits,
            )
        )  # fmt: skip
        await self.router.start()
        await self.wait_for_replicas(c.replicas, ready_timeout_s)
        return self

    async def wait_for_replicas(self, count: int, timeout_s: float = 60.0) -> None:
        """Until ``count`` replicas are live (in the router's view, or the index's without a router)."""
        deadline = time.monotonic() + timeout_s
        while (live := await self._live_count()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{live} of {count} replicas are live")
            await asyncio.sleep(0.1)

    async def _live_count(self) -> int:
        if self.router is None:
            return len(await self._index.live_replicas())
        await self.router.registry.refresh()
        return len(self.router.registry.live())

    async def stop(self, grace: float = 5.0) -> None:
        """Drain the router, stop the replicas, then Redis and Ray (if we started them)."""
        if self.router:
            await self.router.stop(grace)
        if self.supervisor:
            await self.supervisor.stop(grace)
        if self._index:
            await self._index.close()
        if self.redis:
            self.redis.close()
        if self._owns_ray:
            ray.shutdown()

    async def __aenter__(self) -> LocalCluster:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()


async def wait_for_signal() -> None:
    """Until SIGINT or SIGTERM (Ctrl-C, Kubernetes stop)."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_cluster(config: ClusterConfig, grace: float = 10.0) -> None:
    """``kvmesh up``: start everything, print the endpoints, drain and stop on a signal."""
    cluster = LocalCluster(config)
    try:
        await cluster.start()
        print(f"kvmesh up: {config.replicas} replicas of {config.model_dir}", flush=True)
        if cluster.router is not None:
            print(f"  router gRPC  {cluster.router_address}", flush=True)
        if cluster.router is not None and cluster.http_url:
            print(
                f"  router HTTP  {cluster.http_url}/v1 (OpenAI-compatible), {cluster.http_url}/metrics",
                flush=True,
            )
        print(f"  redis        {redacted(cluster.redis_url)}", flush=True)
        print("  Ctrl-C to stop", flush=True)
        await wait_for_signal()
        print("draining ...", flush=True)
    finally:
        await cluster.stop(grace)


async def serve_router(config: RouterConfig, grace: float = 10.0) -> None:
    """``kvmesh router``: the router alone (Kubernetes), until a signal."""
    router = RouterServer(config)
    try:
        await router.start()
        print(f"kvmesh router: gRPC {router.address}, HTTP port {router.http_port}", flush=True)
        await wait_for_signal()
    finally:
        await router.stop(grace)
