"""Keeps N replica actors alive: starts them, notices deaths and broken engines, retires and
replaces them.

Replicas are named, detached Ray actors, so they outlive the process that supervises them: a
controller that restarts (a ``helm upgrade``, a crash) re-attaches to the replicas still
running with the same settings instead of reloading every model, and replaces only the dead
ones or those whose settings changed. Every check asks each replica for its health (an
engine that is broken or stalled answers "unhealthy"), all at once; replacements run in
parallel in the background, each start bounded by ``start_timeout_s``. A start that fails
is retried with exponential backoff; each slot's state is written to the index, where
``kvmesh status`` shows it. An unexpected error in one check is counted and logged, and
the watch goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.exceptions import RayError
from redis.exceptions import NoPermissionError

from kvmesh.kvcache.index.acl import issue_replica_user, replica_user, replica_users
from kvmesh.kvcache.index.api import PrefixIndex
from kvmesh.kvcache.index.redis import INDEX_ERRORS
from kvmesh.replica.actor import replica_actor_class
from kvmesh.replica.config import ReplicaConfig
from kvmesh.serving.background import BackgroundLoops

log = logging.getLogger(__name__)
RAY_NAMESPACE = "kvmesh"
# A start fails with the actor's error (RayError), a timeout, or a name still taken (ValueError).
START_ERRORS = (RayError, TimeoutError, ValueError)
# Tries to issue a replica its index user (a second apart) before its start fails.
ISSUE_ATTEMPTS = 10


class ReplicaStartError(RuntimeError):
    """A replica could not start; the message is the one line a user needs (the actor's error)."""


def start_error(replica_id: str, exc: BaseException) -> ReplicaStartError:
    """The cause of a failed start, without Ray's traceback around it."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(exc, TimeoutError):
        text = "did not start in time"
    else:
        lines = [line for line in str(cause).strip().splitlines() if line.strip()]
        text = lines[-1] if lines else type(cause).__name__
    return ReplicaStartError(f"{replica_id} failed to start: {text}")


@dataclass
class Slot:
    """One replica the supervisor keeps: its actor, and how its starts have gone."""

    replica_id: str
    actor: ray.actor.ActorHandle | None = None
    address: str = ""
    # starting (no check touches it until the start ends) | ready | waiting (a failed start,
    # retried at retry_at)
    state: str = "starting"
    failures: int = 0  # failed starts in a row
    retry_at: float = 0.0
    error: str = ""

    def as_dict(self, now: float) -> dict:
        return {
            "state": self.state,
            "address": self.address,
            "failures": self.failures,
            "error": self.error,
            "retry_in_s": round(max(0.0, self.retry_at - now), 1) if self.state == "waiting" else None,
        }


class Supervisor:
    def __init__(
        self,
        template: ReplicaConfig,
        replicas: int,
        use_gpu: bool,
        index: PrefixIndex,
        check_s: float = 1.0,
        start_timeout_s: float = 600.0,
        backoff_s: tuple[float, float] = (1.0, 60.0),
        on_ready: Callable[[str, str, float], None] | None = None,
        environment: dict[str, str] | None = None,
        replica_prefix: str = "replica",
        ray_resource: str | None = None,
    ):
        """``replica_prefix``: replicas are ``<prefix>-0`` .. ``<prefix>-N-1`` (a deployment of
        several models names them by model, so a replica id says which model it serves).
        ``ray_resource``: a custom resource each replica takes one of (its model's nodes)."""
        self.template = template  # every replica's config; the supervisor names each one
        self.environment = environment or {}  # the replica processes' own (their Redis user)
        self.use_gpu = use_gpu
        self.index = index
        self.check_s = check_s
        self.start_timeout_s = start_timeout_s
        self.backoff_s = backoff_s  # first retry after backoff_s[0], doubling up to backoff_s[1]
        self.on_ready = on_ready  # (replica id, address, seconds it took)
        self.replica_prefix = replica_prefix
        self.ray_resource = ray_resource
        self.slots = {f"{replica_prefix}-{i}": Slot(f"{replica_prefix}-{i}") for i in range(replicas)}
        self.restarts = 0
        self.reattached = 0
        self.watch_errors = 0  # checks that failed unexpectedly (the watch went on)
        self._loops = BackgroundLoops()
        self._starts: set[asyncio.Task] = set()  # replacements and retries under way
        # Whether it issues each replica an index user of its own (None: not tried yet; False:
        # its index user is not the admin, and replicas use the role's user from their environment).
        self.issues_users: bool | None = None

    @property
    def actors(self) -> dict[str, ray.actor.ActorHandle]:
        return {rid: s.actor for rid, s in self.slots.items() if s.actor is not None}

    @property
    def addresses(self) -> dict[str, str]:
        return {rid: s.address for rid, s in self.slots.items() if s.state == "ready"}

    def actor_name(self, replica_id: str) -> str:
        model = self.template.model_id or self.template.model_dir.rstrip("/").rsplit("/", 1)[-1]
        return f"{model}/{replica_id}"

    def config_of(self, replica_id: str) -> ReplicaConfig:
        return dataclasses.replace(self.template, replica_id=replica_id)

    async def start(self) -> dict[str, str]:
        """Attach to or start every replica (in parallel); a replica that cannot start is a
        ReplicaStartError here (a first start is not retried: its error is the user's to fix).
        Then keep watching them; returns their addresses."""
        self._retire_extra_actors()
        results = await asyncio.gather(
            *(self._ensure(s) for s in self.slots.values()), return_exceptions=True
        )
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        self._loops.start(self._watch, "kvmesh-supervisor")
        await self._publish()
        return self.addresses

    async def _ensure(self, slot: Slot) -> None:
        """Re-attach to a live replica with the same settings, else start one."""
        actor = self._named(slot.replica_id)
        if actor is not None:
            try:
                same = await asyncio.wait_for(actor.config.remote(), 10) == self.config_of(slot.replica_id)
                address = await asyncio.wait_for(actor.address.remote(), 10) if same else ""
            except (RayError, TimeoutError):
                same, address = False, ""
            if same and address:
                slot.actor, slot.address, slot.state = actor, address, "ready"
                self.reattached += 1
                log.info("replica re-attached", extra={"replica_id": slot.replica_id, "address": address})
                return
            self._kill(actor)
        try:
            await self._launch(slot)
        except START_ERRORS as exc:
            raise start_error(slot.replica_id, exc) from None

    async def _launch(self, slot: Slot) -> None:
        """Create the named actor and wait for it to serve."""
        started = time.monotonic()
        await self._name_released(slot.replica_id)
        cls = replica_actor_class(self.use_gpu).options(
            name=self.actor_name(slot.replica_id),
            namespace=RAY_NAMESPACE,
            lifetime="detached",
            **({"runtime_env": {"env_vars": self.environment}} if self.environment else {}),
            **({"resources": {self.ray_resource: 1}} if self.ray_resource else {}),
        )
        user = await self._issue_user(slot.replica_id)
        slot.actor, slot.state = cls.remote(self.config_of(slot.replica_id), user), "starting"
        slot.address = await asyncio.wait_for(slot.actor.start.remote(), self.start_timeout_s)
        slot.state, slot.failures, slot.error = "ready", 0, ""
        seconds = time.monotonic() - started
        log.info("replica started", extra={"replica_id": slot.replica_id, "address": slot.address})
        if self.on_ready:
            self.on_ready(slot.replica_id, slot.address, seconds)

    async def _issue_user(self, replica_id: str) -> tuple[str, str] | None:
        """A new password for ``replica_id``'s own index user (rotated at every start), or
        None where this supervisor may not make users."""
        client = getattr(self.index, "client", None)
        if self.issues_users is False or client is None:
            return None
        unanswered: Exception | None = None
        for _ in range(ISSUE_ATTEMPTS):
            try:
                user = await issue_replica_user(client, self.index.digest, replica_id)
            except NoPermissionError:
                log.warning("not the index's admin: replicas use the replica role's user, not one each")
                self.issues_users = False
                return None
            except ValueError as exc:  # an id that cannot stand in a key pattern
                log.warning("replica uses the replica role's index user", extra={"why": str(exc)})
                return None
            except INDEX_ERRORS as exc:  # Redis slow or away: the start waits for it a while
                unanswered = exc
                await asyncio.sleep(1.0)
            else:
                self.issues_users = True
                return user
        raise ReplicaStartError(
            f"{replica_id} failed to start: the index did not answer to issue its user ({unanswered})"
        )

    async def _renew_lost_users(self) -> None:
        """Replicas whose own index user the server no longer has (it restarted without its
        runtime users) get it again, with a new password."""
        if not self.issues_users:
            return
        have = await replica_users(self.index.client)
        for slot in self.slots.values():
            if slot.state == "ready" and replica_user(self.index.digest, slot.replica_id) not in have:
                user, password = await issue_replica_user(
                    self.index.client, self.index.digest, slot.replica_id
                )
                await asyncio.wait_for(slot.actor.use_index_user.remote(user, password), 10)
                log.warning("replica's index user renewed", extra={"replica_id": slot.replica_id})

    async def _name_released(self, replica_id: str, timeout_s: float = 10.0) -> None:
        """A killed actor gives its name back a moment later; a new one cannot take it before."""
        deadline = time.monotonic() + timeout_s
        while self._named(replica_id) is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    def _named(self, replica_id: str) -> ray.actor.ActorHandle | None:
        try:
            return ray.get_actor(self.actor_name(replica_id), namespace=RAY_NAMESPACE)
        except ValueError:  # no such actor
            return None

    def _retire_extra_actors(self) -> None:
        """Replicas left from a larger deployment of this model (the count went down)."""
        prefix = self.actor_name(f"{self.replica_prefix}-")
        wanted = {self.actor_name(rid) for rid in self.slots}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"]
            if entry["namespace"] == RAY_NAMESPACE and name.startswith(prefix) and name not in wanted:
                with contextlib.suppress(ValueError):
                    self._kill(ray.get_actor(name, namespace=RAY_NAMESPACE))
                log.info("extra replica stopped", extra={"actor": name})

    @staticmethod
    def _kill(actor: ray.actor.ActorHandle) -> None:
        with contextlib.suppress(RayError, ValueError):
            ray.kill(actor, no_restart=True)

    async def _watch(self) -> None:
        while self._loops.running:
            await asyncio.sleep(self.check_s)
            try:
                await self._check()
            except Exception:  # a bug or a Ray hiccup: counted, logged, and the next check runs
                self.watch_errors += 1
                log.exception("supervisor check failed; watching on")

    async def _check(self) -> None:
        now = time.monotonic()
        ready = [s for s in self.slots.values() if s.state == "ready"]
        verdicts = await asyncio.gather(*(self._why_unfit(s) for s in ready))
        for slot, why in zip(ready, verdicts, strict=True):
            if why is not None:
                self._start_in_background(slot, self._replace(slot, why))
        for slot in self.slots.values():
            if slot.state == "waiting" and now >= slot.retry_at:
                self._start_in_background(slot, self._restart(slot))
        with contextlib.suppress(*INDEX_ERRORS):
            # One cheap function call, which (as the index's admin, the one user that may)
            # loads the functions again on a server that restarted without them: routers and
            # replicas wait for exactly that.
            await self.index.has_settings()
            await self._renew_lost_users()
        await self._publish()

    async def _why_unfit(self, slot: Slot) -> str | None:
        """None while the replica answers healthy, else why it must be replaced."""
        try:
            health = await asyncio.wait_for(slot.actor.health.remote(), timeout=max(2.0, self.check_s * 5))
        except (RayError, TimeoutError) as exc:
            return f"died ({type(exc).__name__})"
        if health.get("status") == "unhealthy":
            return f"unhealthy ({health.get('reason', 'no reason given')})"
        return None

    def _start_in_background(self, slot: Slot, start) -> None:
        slot.state = "starting"  # no other check touches it until this ends

        async def start_then_publish() -> None:
            await start
            await self._publish()

        task = asyncio.create_task(start_then_publish(), name=f"kvmesh-start-{slot.replica_id}")
        self._starts.add(task)
        task.add_done_callback(self._starts.discard)

    async def _replace(self, slot: Slot, why: str) -> None:
        log.warning("replica is being replaced", extra={"replica_id": slot.replica_id, "why": why})
        with contextlib.suppress(*INDEX_ERRORS):  # Redis may be away too: its TTL retires it then
            await self.index.retire(slot.replica_id)
        self._kill(slot.actor)
        self.restarts += 1
        await self._restart(slot)

    async def _restart(self, slot: Slot) -> None:
        try:
            await self._launch(slot)
        except Exception as exc:  # any failed start (not only START_ERRORS) waits and is retried
            self._kill(slot.actor)
            slot.failures += 1
            slot.error = str(start_error(slot.replica_id, exc))
            low, high = self.backoff_s
            slot.retry_at = time.monotonic() + min(high, low * 2 ** (slot.failures - 1))
            slot.state = "waiting"
            log.error(
                "replica restart failed, retrying later",
                extra={"replica_id": slot.replica_id, "failures": slot.failures, "error": slot.error},
            )

    async def _publish(self) -> None:
        """Each slot's state, for ``kvmesh status`` (best effort: Redis may be away)."""
        now = time.monotonic()
        states = {rid: s.as_dict(now) for rid, s in self.slots.items()}
        with contextlib.suppress(*INDEX_ERRORS):
            await self.index.set_controller_state(json.dumps(states))

    async def stop(self, grace: float, keep_replicas: bool = False) -> None:
        """Stop watching; then stop the replicas, unless they are to outlive this process
        (the chart's controller: a new controller re-attaches to them)."""
        await self._loops.stop()
        for task in list(self._starts):
            task.cancel()
        await asyncio.gather(*self._starts, return_exceptions=True)
        if keep_replicas:
            return
        actors = list(self.actors.values())
        stops = [asyncio.wait_for(actor.stop.remote(grace), grace + 10) for actor in actors]
        await asyncio.gather(*stops, return_exceptions=True)
        for actor in actors:
            self._kill(actor)
        for slot in self.slots.values():
            slot.actor, slot.state = None, "stopped"
        with contextlib.suppress(*INDEX_ERRORS):
            await self.index.set_controller_state("{}")
