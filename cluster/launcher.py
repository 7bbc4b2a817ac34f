"""A whole kvmesh deployment in one process tree: Ray, Redis, N replica actors, the router.

``kvmesh up``, ``kvmesh demo``, the end-to-end tests and the router benchmark all use
LocalCluster, so they exercise exactly what users run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import ray

from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.cluster.errors import UsageError
from kvmesh.cluster.local_secrets import LocalSecrets
from kvmesh.cluster.signals import wait_for_signal
from kvmesh.cluster.supervisor import Supervisor
from kvmesh.kvcache import namespace_seed
from kvmesh.kvcache.index_acl import ROLES, USERS, acl_file
from kvmesh.kvcache.index_api import PrefixIndex
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.actor import cluster_has_gpus
from kvmesh.router.process import RouterServer
from kvmesh.serving.auth import bearer_metadata
from kvmesh.serving.index_connection import RedisCredentials, connect_index
from kvmesh.serving.options import redacted_url
from kvmesh.serving.tls import open_channel

log = logging.getLogger(__name__)


def check_gpus(replicas: int, gpus: float, local: bool, progress: Callable[[str], None]) -> None:
    """Refuse at once what cannot be placed on this machine's GPUs; on a cluster that may
    grow (an autoscaler), say what the replicas wait for."""
    if not gpus or replicas <= gpus:
        return
    if local:
        raise UsageError(
            f"{replicas} replicas need one GPU each and this machine has {int(gpus)}: use --replicas {int(gpus)}"
        )
    progress(f"waiting for GPUs: {replicas} replicas need {replicas}, the Ray cluster has {int(gpus)} now")


class LocalCluster:
    def __init__(
        self,
        config: ClusterConfig,
        progress: Callable[[str], None] | None = None,
        *,
        open_replicas: bool = False,
    ):
        """``open_replicas``: replicas without a token (on loopback only), for the benchmarks
        that put third-party routers, which cannot present kvmesh's token, in front of them."""
        self.config = config
        self.open_replicas = open_replicas
        self.progress = progress or (lambda line: None)  # one line per step while starting
        self.redis: EmbeddedRedis | None = None
        self.redis_url = config.router.redis_url
        self.supervisor: Supervisor | None = None
        self.router: RouterServer | None = None
        self._index: PrefixIndex | None = None
        self._owns_ray = False
        self._secrets = LocalSecrets()  # what it generates where the user gave none
        self.router_redis = RedisCredentials()  # the router's index user (set at start)

    @property
    def router_address(self) -> str:
        return self.router.address

    def router_environment(self) -> dict[str, str]:
        """What another router process of this deployment needs in its environment: its index
        user (the replicas' token file: ``config.router.replica_api_key_file``)."""
        return self.router_redis.environment()

    @property
    def secrets_folder(self) -> Path | None:
        """Where the secrets it generated are (the replicas' token, the index users' passwords)."""
        return self._secrets.folder

    @property
    def index(self) -> PrefixIndex:
        return self._index

    @property
    def http_url(self) -> str | None:
        return f"http://{self.config.router.host}:{self.router.http_port}" if self.router.http_port else None

    async def start(self, ready_timeout_s: float = 600.0) -> LocalCluster:
        c = self.config
        if not ray.is_initialized():
            await self._init_ray()
            self._owns_ray = True
        if c.replica.api_key_file is None and not self.open_replicas:  # every replica door takes a token
            c = c.with_replica_token(self._secrets.new("replica-token")[0])
        # An external Redis: this process and its router are who its environment says; the
        # replicas read their own (on Kubernetes, their pods' Secret).
        admin = self.router_redis = RedisCredentials.from_env()
        replica_env: dict[str, str] = {}
        if self.redis_url is None:
            users = self._start_embedded_redis()
            admin, self.router_redis, replica_env = (
                users["admin"],
                users["router"],
                users["replica"].environment(),
            )
            c = c.with_redis(self.redis_url)
        self.config = c
        replica = c.replica
        model_id = replica.model_id or os.path.basename(os.path.realpath(replica.model_dir))
        block_size = replica.engine.block_size
        seed = namespace_seed(model_id, block_size) if block_size else None
        self._index = connect_index(self.redis_url, model_id, block_size, seed, replica.deployment, admin)
        if not await self._index.load_functions():
            log.warning(
                "this Redis user may not load the index functions: routers and replicas wait for an admin to"
            )
        use_gpu = cluster_has_gpus()
        check_gpus(c.replicas, ray.cluster_resources().get("GPU", 0), self._owns_ray, self.progress)
        if replica.torch_threads is None and not use_gpu:  # CPU replicas share this machine's cores
            replica = dataclasses.replace(replica, torch_threads=max(1, (os.cpu_count() or 1) // c.replicas))
        self.supervisor = Supervisor(
            replica, c.replicas, use_gpu, self._index, on_ready=self._ready, environment=replica_env
        )
        self.progress(
            f"starting {c.replicas} replica(s) of {replica.model_dir} ({'GPU' if use_gpu else 'CPU'}) ..."
        )
        await self.supervisor.start()
        if not c.with_router:
            await self.wait_for_replicas(c.replicas, ready_timeout_s)
            return self
        self.router = RouterServer(c.router, redis_credentials=self.router_redis)
        await self.router.start()
        await self.wait_for_replicas(c.replicas, ready_timeout_s)
        return self

    def _start_embedded_redis(self) -> dict[str, RedisCredentials]:
        """A private Valkey with one ACL user per role (generated passwords): the router,
        the replicas and this process each connect as their own."""
        users, passwords = {}, {}
        for role in ROLES:
            path, passwords[role] = self._secrets.new(f"redis-{role}")
            users[role] = RedisCredentials(USERS[role], path)
        self.redis = EmbeddedRedis(aclfile=self._secrets.write("valkey.acl", acl_file(passwords))).start()
        self.redis_url = self.redis.url
        return users

    async def _init_ray(self, attempts: int = 3) -> None:
        """Connect to Ray (no --ray-address: a new local Ray, never one an earlier `ray start`
        left running). A ``ray://`` connection is tried again on a server-side start failure:
        Ray's client proxier sometimes loses the per-client server it just spawned (seen as
        "Initialization failure from server ... ZombieProcess"), and a second try succeeds."""
        c = self.config
        local_cpus = None if c.ray_address else max(os.cpu_count() or 1, c.replicas + 1)
        for attempt in range(1, attempts + 1):
            try:
                ray.init(
                    address=c.ray_address or "local",
                    num_cpus=local_cpus,
                    include_dashboard=False,
                    log_to_driver=c.verbose,
                    logging_level=logging.INFO if c.verbose else logging.ERROR,
                )
                return
            except ConnectionAbortedError as exc:
                if not (c.ray_address or "").startswith("ray://") or attempt == attempts:
                    raise
                log.warning(
                    "Ray client connection failed, retrying",
                    extra={"attempt": attempt, "error": str(exc)[-200:]},
                )
                await asyncio.sleep(2.0 * attempt)

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

    def _ready(self, replica_id: str, address: str, seconds: float) -> None:
        self.progress(f"  {replica_id} serving at {address} ({seconds:.1f} s)")

    async def reset_prefix_caches(self) -> None:
        """Cold caches everywhere (experiments compare policies from the same start): replicas
        forget their prefixes, and the router's speculative entries, which would still point
        at the old holders, expire."""
        auth = bearer_metadata(self.config.replica.token())
        for address in self.supervisor.addresses.values():
            async with open_channel(address, self.config.router.tls) as channel:
                stub = pb_grpc.ReplicaStub(channel)
                await stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=30, metadata=auth)
        if self.router is not None:
            await asyncio.sleep(self.router.core.overlay.ttl_s + 0.2)

    async def stop(self, grace: float | None = None) -> None:
        """Drain the router, stop the replicas, then Redis and Ray (if we started them).
        ``grace``: seconds in-flight requests get (default: the configured drain timeouts)."""
        if self.router:
            await self.router.stop(grace)
        if self.supervisor:
            grace = self.config.replica.drain_timeout_s if grace is None else grace
            await self.supervisor.stop(grace, keep_replicas=self.config.keep_replicas)
        if self._index:
            await self._index.close()
        if self.redis:
            self.redis.close()
        self._secrets.close()
        if self._owns_ray:
            ray.shutdown()

    async def __aenter__(self) -> LocalCluster:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()


async def serve_cluster(config: ClusterConfig) -> None:
    """``kvmesh up``: start everything, print the endpoints, drain and stop on a signal."""
    cluster = LocalCluster(config, progress=lambda line: print(line, flush=True))
    try:
        await cluster.start()
        print(f"kvmesh up: {config.replicas} replicas of {config.replica.model_dir}", flush=True)
        if cluster.router is not None:
            print(f"  router gRPC  {cluster.router_address}", flush=True)
        if cluster.router is not None and cluster.http_url:
            print(
                f"  router HTTP  {cluster.http_url}/v1 (OpenAI-compatible), {cluster.http_url}/metrics",
                flush=True,
            )
        print(f"  redis        {redacted_url(cluster.redis_url)}", flush=True)
        if cluster.redis is not None:  # behind ACL users: say where a reader finds its password
            print(
                f"  index users  kvmesh-admin, kvmesh-router, kvmesh-replica; password files redis-<role> in "
                f"{cluster.secrets_folder} (kvmesh status: KVMESH_REDIS_USERNAME and KVMESH_REDIS_PASSWORD_FILE)",
                flush=True,
            )
        print(f"  deployment   {config.deployment}", flush=True)
        print("  Ctrl-C to stop", flush=True)
        await wait_for_signal()
        print("draining ...", flush=True)
    finally:
        await cluster.stop()
