"""Keeps N replica actors alive: starts them, notices deaths, retires and replaces them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import ray
from ray.exceptions import RayActorError, RayError

from kvmesh.kvcache.index import INDEX_ERRORS, PrefixIndex
from kvmesh.replica.actor import replica_actor_class
from kvmesh.replica.config import ReplicaConfig
from kvmesh.serving.background import BackgroundLoops

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(
        self,
        template: ReplicaConfig,
        replicas: int,
        use_gpu: bool,
        index: PrefixIndex,
        check_s: float = 1.0,
        start_timeout_s: float = 600.0,
    ):
        self.template = template  # every replica's config; the supervisor names each one
        self.replica_ids = [f"replica-{i}" for i in range(replicas)]
        self.use_gpu = use_gpu
        self.index = index
        self.check_s = check_s
        self.start_timeout_s = start_timeout_s
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.addresses: dict[str, str] = {}
        self.restarts = 0
        self._loops = BackgroundLoops()

    async def start(self) -> dict[str, str]:
        """Start every replica (in parallel) and begin watching them; returns their addresses."""
        await asyncio.gather(*(self._start_one(rid) for rid in self.replica_ids))
        self._loops.start(self._watch(), "kvmesh-supervisor")
        return dict(self.addresses)

    async def _start_one(self, replica_id: str) -> None:
        config = dataclasses.replace(self.template, replica_id=replica_id)
        actor = replica_actor_class(self.use_gpu).remote(config)
        self.actors[replica_id] = actor
        self.addresses[replica_id] = await asyncio.wait_for(actor.start.remote(), self.start_timeout_s)
        log.info("replica started", extra={"replica_id": replica_id, "address": self.addresses[replica_id]})

    async def _watch(self) -> None:
        while self._loops.running:
            await asyncio.sleep(self.check_s)
            for replica_id, actor in list(self.actors.items()):
                try:
                    await asyncio.wait_for(actor.address.remote(), timeout=max(2.0, self.check_s * 5))
                except (RayActorError, TimeoutError) as exc:
                    await self._replace(replica_id, exc)

    async def _replace(self, replica_id: str, why: Exception) -> None:
        log.warning(
            "replica died, replacing it", extra={"replica_id": replica_id, "error": type(why).__name__}
        )
        with contextlib.suppress(*INDEX_ERRORS):  # Redis may be away too: its TTL retires it then
            await self.index.retire(replica_id)
        with contextlib.suppress(RayError, ValueError):
            ray.kill(self.actors[replica_id])
        self.restarts += 1
        try:
            await self._start_one(replica_id)
        except (RayError, TimeoutError) as exc:  # try again at the next check
            log.error("replica restart failed", extra={"replica_id": replica_id, "error": str(exc)})

    async def stop(self, grace: float) -> None:
        await self._loops.stop()
        stops = [asyncio.wait_for(actor.stop.remote(grace), grace + 10) for actor in self.actors.values()]
        await asyncio.gather(*stops, return_exceptions=True)
        for actor in self.actors.values():
            with contextlib.suppress(RayError, ValueError):
                ray.kill(actor)
        self.actors.clear()
