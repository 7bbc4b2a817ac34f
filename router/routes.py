"""The models one router serves: each its own route (tokenizer, index, replicas, routing core).

A route is one model's whole routing path, as a one-model router had it: the model folder's
tokenizer, chat template and sampling defaults, the model's prefix index and block size
(learned from its replicas under block size "auto"), its replica registry and shared load,
and its ``RouterCore`` (policies, speculative entries, trust states). Routes share the
router's front ends and its one metrics registry (each labelled ``model_name``); nothing else.
A request names its model (OpenAI's ``model``, gRPC's ``GenerateRequest.model``) by served
name or id; a router of one model also takes a request that names none.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence

from kvmesh.kvcache.index.api import check_settings, own_settings
from kvmesh.kvcache.index.redis import INDEX_ERRORS, IndexSettingsError
from kvmesh.router.config import RouterConfig
from kvmesh.router.core import RouterCore
from kvmesh.router.decision import RoutingOptions
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.registry import ReplicaRegistry
from kvmesh.router.shared_load import FleetLoad
from kvmesh.serving.errors import InvalidRequest, NotFound, Unavailable, shown
from kvmesh.serving.index_connection import RedisCredentials, connect_index
from kvmesh.serving.metrics import MetricsRegistry
from kvmesh.serving.model_info import ModelInfo, model_id_of
from kvmesh.serving.model_lock import reading_model
from kvmesh.serving.options import effective_config

log = logging.getLogger(__name__)


class ModelRoute:
    """One model's routing path; ``core`` is None until its block size is known."""

    def __init__(self, config: RouterConfig, metrics: MetricsRegistry, redis: RedisCredentials | None):
        self.config = config
        self.metrics_registry = metrics
        self.model_id = model_id_of(config.model_dir, config.model_id)
        self.effective_config = json.dumps(effective_config(config))  # GetModelInfo's, secrets left out
        with reading_model(config.model_dir):  # no download swaps the folder while it is read
            self.tokenizer = config.api.load_tokenizer(config.model_dir)
            self.defaults = config.api.load_defaults(config.model_dir)
        # With block size "auto" the model's hash namespace is known once a replica stored it.
        self.model = self._model_info(config.block_size) if config.block_size else None
        seed = self.model.hash_seed if self.model else None
        self.index = connect_index(
            config.redis_url, self.model_id, config.block_size, seed, config.deployment, redis
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
            prices=config.balance.prices(),
            alarm=config.balance.alarm(),
        )
        self.core: RouterCore | None = None

    @property
    def names(self) -> set[str]:
        """What a request may call this model: its served name and its id."""
        return {self.api_name, self.model_id}

    @property
    def api_name(self) -> str:
        return self.config.api.served_model_name or self.model_id

    def _model_info(self, block_size: int) -> ModelInfo:
        c = self.config
        with reading_model(c.model_dir):
            return ModelInfo.from_folder(
                c.model_dir, self.model_id, block_size, c.max_model_len, c.api.served_model_name
            )

    async def start(self, on_live_change: Callable[[int], Awaitable[None]]) -> None:
        """Learn the block size (auto) or check it, then route: the core, shared load, registry."""
        if self.model is None:
            self.model = await self._learn_block_size()
        else:
            await self._check_settings()
        c = self.config
        options = RoutingOptions(
            c.policy,
            c.limits,
            self.defaults,
            speculative_ttl_s=c.speculative_ttl_s,
            index_trust=c.index_trust,
            saturation_steps=c.balance.saturation_steps,
            flow=c.flow,
        )
        metrics = RouterMetrics(self.model.api_name, self.metrics_registry)
        self.index.untrusted.on_skip = lambda kind: metrics.index_skipped.labels(kind).inc()
        self.core = RouterCore(self.model, self.tokenizer, self.index, self.registry, options, metrics)
        self.registry.on_change(on_live_change)
        self.registry.alarm_listeners.append(metrics.count_share_alarm)
        if self.fleet is not None:
            self.fleet.on_synced = metrics.fleet_sync.observe
            metrics.fleet_routers.set_function(lambda: self.fleet.routers)
            await self.fleet.start()
        await self.registry.start()

    async def _check_settings(self) -> None:
        """A router of a known block size refuses to start if the index holds other settings
        (it would hash no prompt as the replicas do). It never stores them: the admin or the
        first replica does, and a router's user may not write them."""
        try:
            stored = await self.index.settings()
        except INDEX_ERRORS as exc:  # Redis away at start: serve anyway, the registry keeps trying
            log.warning("prefix index unreachable at start", extra={"error": str(exc)})
            return
        if stored:
            i = self.index
            check_settings(own_settings(i.model_id, i.deployment, i.block_size, i.hash_seed), stored)

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
            block_size = _positive(settings.get("block_size")) if settings else None
            if settings and block_size is None and not said:
                log.warning(
                    "the index's stored block size is not one; waiting for the admin to store it again"
                )
                said = True
            if block_size is not None:
                model = self._model_info(block_size)
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

    @property
    def live(self) -> int:
        return len(self.registry.live()) if self.core else 0

    async def stop(self) -> None:
        if self.core:
            await self.core.stop()
        if self.fleet is not None:
            await self.fleet.stop()
        await self.registry.stop()
        await self.index.close()


class ModelRoutes:
    """Every model of one router, found by the name a request gives."""

    def __init__(self, configs: Sequence[RouterConfig], redis: RedisCredentials | None = None):
        self.metrics = MetricsRegistry()
        self.routes = [ModelRoute(c, self.metrics, redis) for c in configs]
        self._by_name: dict[str, ModelRoute] = {}
        for route in self.routes:
            for name in route.names:
                other = self._by_name.setdefault(name, route)
                if other is not route:
                    raise ValueError(
                        f"two models answer to {name!r} ({other.config.model_dir}, {route.config.model_dir}): "
                        "give each its own model-id or served-model-name"
                    )

    def route(self, name: str | None) -> ModelRoute:
        """The route a request's model field names (none: the only model's); NotFound else."""
        if not name:
            if len(self.routes) == 1:
                return self.routes[0]
            raise InvalidRequest(
                f"model: this router serves several models, name one of {', '.join(self.api_names)}", "model"
            )
        route = self._by_name.get(name)
        if route is None:
            raise NotFound(
                f"model {shown(name)} is not served here; this router serves {', '.join(self.api_names)}"
            )
        return route

    def ready(self, name: str | None) -> ModelRoute:
        """The route of the model ``name``, routing; UNAVAILABLE while it waits for its block size."""
        route = self.route(name)
        if route.core is None:
            raise Unavailable(
                f"router starting: waiting for a replica of {route.api_name!r} to register the block size"
            )
        return route

    def backend(self, name: str | None) -> RouterCore:
        """The routing core (the front ends' backend) of the model ``name`` (see ``ready``)."""
        return self.ready(name).core

    @property
    def api_names(self) -> list[str]:
        return [r.api_name for r in self.routes]

    def serving(self) -> list[RouterCore]:
        """The models a client can use now (started, a replica live): /v1/models lists these."""
        return [r.core for r in self.routes if r.live]

    @property
    def cores(self) -> list[RouterCore]:
        return [r.core for r in self.routes if r.core is not None]

    def render_metrics(self) -> bytes:
        return self.metrics.render()


def _positive(text: str | None) -> int | None:
    """A stored block size, None unless it is a positive whole number."""
    try:
        value = int(text or "")
    except ValueError:
        return None
    return value if value > 0 else None
