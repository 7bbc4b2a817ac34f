"""A whole kvmesh deployment in one process tree: Ray, Redis, N replica actors per model, the router.

``kvmesh up``, ``kvmesh demo``, the end-to-end tests and the router benchmark all use
LocalCluster, so they exercise exactly what users run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import ray
from ray.exceptions import RayError

from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.cluster.errors import UsageError
from kvmesh.cluster.local_secrets import LocalSecrets
from kvmesh.cluster.signals import wait_for_signal
from kvmesh.cluster.supervisor import Supervisor
from kvmesh.kvcache import namespace_seed
from kvmesh.kvcache.index.acl import ROLES, USERS, acl_file
from kvmesh.kvcache.index.api import PrefixIndex
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
        config: ClusterConfig | Sequence[ClusterConfig],
        progress: Callable[[str], None] | None = None,
        *,
        open_replicas: bool = False,
    ):
        """``config``: one model's deployment, or one per model (``ClusterConfig.together``):
        each model its own replicas and supervisor, one router for all.
        ``open_replicas``: replicas without a token (on loopback only), for the benchmarks
        that put third-party routers, which cannot present kvmesh's token, in front of them."""
        self.configs = [config] if isinstance(config, ClusterConfig) else ClusterConfig.together(config)
        self.open_replicas = open_replicas
        self.progress = progress or (lambda line: None)  # one line per step while starting
        self.redis: EmbeddedRedis | None = None
        self.redis_url = self.config.router.redis_url
        self.supervisors: dict[str, Supervisor] = {}  # by model id, in the order given
        self.router: RouterServer | None = None
        self._indexes: dict[str, PrefixIndex] = {}  # each model's, as the index's admin
        self._owns_ray = False
        self._secrets = LocalSecrets()  # what it generates where the user gave none
        self.router_redis = RedisCredentials()  # the router's index user (set at start)

    # One model's deployment (of several: the first model's).
    @property
    def config(self) -> ClusterConfig:
        return self.configs[0]

    @property
    def replicas(self) -> int:
        """Replicas of every model together."""
        return sum(c.replicas for c in self.configs)

    @property
    def supervisor(self) -> Supervisor | None:
        return next(iter(self.supervisors.values()), None)

    @property
    def index(self) -> PrefixIndex | None:
        return next(iter(self._indexes.values()), None)

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
    def http_url(self) -> str | None:
        return f"http://{self.config.router.host}:{self.router.http_port}" if self.router.http_port else None

    async def start(self, ready_timeout_s: float = 600.0) -> LocalCluster:
        configs = self.configs
        if not ray.is_initialized():
            await self._init_ray()
            self._owns_ray = True
        if (
            self.config.replica.api_key_file is None and not self.open_replicas
        ):  # every replica door takes a token
            token = self._secrets.new("replica-token")[0]
            configs = [c.with_replica_token(token) for c in configs]
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
            configs = [c.with_redis(self.redis_url) for c in configs]
        self.configs = configs
        use_gpu = cluster_has_gpus()
        check_gpus(self.replicas, ray.cluster_resources().get("GPU", 0), self._owns_ray, self.progress)
        for c in configs:
            self._add_model(c, use_gpu, admin, replica_env)
        if not await self.index.load_functions():
            log.warning(
                "this Redis user may not load the index functions: routers and replicas wait for an admin to"
            )
        where = "GPU" if use_gpu else "CPU"
        for supervisor in self.supervisors.values():
            self.progress(
                f"starting {len(supervisor.slots)} replica(s) of {supervisor.template.model_dir} ({where}) ..."
            )
        await asyncio.gather(*(supervisor.start() for supervisor in self.supervisors.values()))
        if self.config.with_router:
            self.router = RouterServer([c.router for c in configs], redis_credentials=self.router_redis)
            await self.router.start()
        await self.wait_for_replicas(self.replicas, ready_timeout_s)
        return self

    def _add_model(
        self, c: ClusterConfig, use_gpu: bool, admin: RedisCredentials, env: dict[str, str]
    ) -> None:
        """One model's index connection and supervisor (CPU replicas share the cores evenly)."""
        replica, model_id = c.replica, c.model_id
        block_size = replica.engine.block_size
        seed = namespace_seed(model_id, block_size) if block_size else None
        index = connect_index(self.redis_url, model_id, block_size, seed, replica.deployment, admin)
        if replica.torch_threads is None and not use_gpu:
            replica = dataclasses.replace(
                replica, torch_threads=max(1, (os.cpu_count() or 1) // self.replicas)
            )
        # Several models: replicas named by model, as a file name can hold it (drain sockets)
        prefix = (
            re.sub(r"[^A-Za-z0-9._-]", "-", model_id.replace("/", "--"))
            if len(self.configs) > 1
            else "replica"
        )
        self._indexes[model_id] = index
        self.supervisors[model_id] = Supervisor(
            replica,
            c.replicas,
            use_gpu,
            index,
            on_ready=self._ready,
            environment=env,
            replica_prefix=prefix,
            ray_resource=c.ray_resource,
        )

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
        local_cpus = None if c.ray_address else max(os.cpu_count() or 1, self.replicas + 1)
        # A local Ray is every model's node: it offers each model's --ray-resource for all its replicas.
        offered = {m.ray_resource: m.replicas for m in self.configs if m.ray_resource and not c.ray_address}
        for attempt in range(1, attempts + 1):
            try:
                ray.init(
                    address=c.ray_address or "local",
                    num_cpus=local_cpus,
                    resources=offered or None,
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
            return sum([len(await index.live_replicas()) for index in self._indexes.values()])
        live = 0
        for route in self.router.models.routes:
            await route.registry.refresh()
            live += len(route.registry.live())
        return live

    def _ready(self, replica_id: str, address: str, seconds: float) -> None:
        self.progress(f"  {replica_id} serving at {address} ({seconds:.1f} s)")

    async def replica_pids(self) -> dict[str, int]:
        """Each live replica's process id (benchmarks read its CPU and memory from /proc); a
        replica that does not answer within 2 s (killed a moment ago) is left out."""

        async def pid_of(actor) -> int | None:
            try:
                return await asyncio.wait_for(actor.pid.remote(), 2.0)
            except (RayError, TimeoutError):
                return None

        actors = {rid: a for supervisor in self.supervisors.values() for rid, a in supervisor.actors.items()}
        pids = await asyncio.gather(*map(pid_of, actors.values()))
        return {rid: pid for rid, pid in zip(actors, pids, strict=True) if pid is not None}

    async def reset_prefix_caches(self) -> None:
        """Cold caches everywhere (experiments compare policies from the same start): replicas
        forget their prefixes, and the router's speculative entries, which would still point
        at the old holders, expire."""
        auth = bearer_metadata(self.config.replica.token())
        addresses = [a for supervisor in self.supervisors.values() for a in supervisor.addresses.values()]
        for address in addresses:
            async with open_channel(address, self.config.router.tls) as channel:
                stub = pb_grpc.ReplicaStub(channel)
                await stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=30, metadata=auth)
        if self.router is not None:
            await asyncio.sleep(self.router.core.overlay.ttl_s + 0.2)

    async def stop(self, grace: float | None = None) -> None:
        """Drain the router, stop the replicas, then Redis and Ray (if we started them).
        ``grace``: seconds in-flight requests get (default: the configured drain timeouts).
        A step that fails is logged and the next one runs: the secrets it generated are
        removed and the servers it started stopped, whatever went wrong before."""
        try:
            if self.router:
                await _logged("router", self.router.stop(grace))
            grace = self.config.replica.drain_timeout_s if grace is None else grace
            await asyncio.gather(
                *(
                    _logged("replicas", s.stop(grace, keep_replicas=self.config.keep_replicas))
                    for s in self.supervisors.values()
                )
            )
            for index in self._indexes.values():
                await _logged("index client", index.close())
        finally:
            if self.redis:
                self.redis.close()
            self._secrets.close()
            if self._owns_ray:
                ray.shutdown()

    async def __aenter__(self) -> LocalCluster:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()


async def _logged(what: str, step: Awaitable[None]) -> None:
    """Await one step of a stop; an error is logged, not raised (the stop goes on)."""
    try:
        await step
    except Exception:  # whatever one part did, the others must still stop
        log.exception("stopping failed; stopping the rest", extra={"part": what})


async def serve_cluster(config: ClusterConfig | Sequence[ClusterConfig]) -> None:
    """``kvmesh up``: start everything, print the endpoints, drain and stop on a signal."""
    cluster = LocalCluster(config, progress=lambda line: print(line, flush=True))
    config = cluster.config
    try:
        await cluster.start()
        for c in cluster.configs:
            print(f"kvmesh up: {c.replicas} replicas of {c.replica.model_dir}", flush=True)
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
