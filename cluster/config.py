"""``kvmesh up``'s settings: the router's, every replica's, and the launcher's own.

The router and replica parts are the very objects ``kvmesh router`` and the replica actor
use; ``kvmesh up`` derives its flags from all three, and one flag given on the command line
(``--model``, ``--block-size``, ``--tls-ca``, ...) sets every field of that name.
"""

from __future__ import annotations

import dataclasses
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvmesh.engine.config import EngineConfig
from kvmesh.replica.config import ReplicaConfig
from kvmesh.router.config import RouterConfig
from kvmesh.serving.auth import is_loopback_host
from kvmesh.serving.deployment import DEFAULT_DEPLOYMENT, check_deployment
from kvmesh.serving.model_info import model_id_of
from kvmesh.serving.options import option

# Settings the router and the replicas must agree on, or their block hashes (and so every
# prefix match) would disagree: (router field, replica field path).
SHARED = (
    ("model_dir", ("model_dir",)),
    ("model_id", ("model_id",)),
    ("redis_url", ("redis_url",)),
    ("block_size", ("engine", "block_size")),
)


def new_deployment_name() -> str:
    """A fresh deployment name, ``up-<8 hex>`` (``kvmesh up`` without ``--deployment``)."""
    return f"up-{secrets.token_hex(4)}"


@dataclass
class ClusterConfig:
    router: RouterConfig = option(help="the router's settings")
    replica: ReplicaConfig = option(help="every replica's settings (the supervisor names each one)")
    replicas: int = option(2, per_model=True, help="replica actors (one GPU each where present)")
    ray_address: str | None = option(None, help="join this Ray cluster instead of starting a local one")
    ray_resource: str | None = option(
        None,
        per_model=True,
        help="a custom Ray resource every replica takes one of, so it runs only on the nodes that "
        "offer it (the chart: each model's worker group offers its own; a local Ray offers it)",
    )
    with_router: bool = option(
        True,
        flag="router",
        help="run the router (--no-router: replicas and supervisor only, the chart's controller)",
    )
    keep_replicas: bool = option(
        False, help="leave the replicas running when this process stops (the chart's controller re-attaches)"
    )
    verbose: bool = option(False, help="info-level logs")
    deployment: str | None = option(
        None,
        help="which deployment of the model this is, for the router and every replica "
        "(default: a new up-<8 hex> each run: two kvmesh up on one Redis never collide)",
    )

    def __post_init__(self) -> None:
        if self.replicas <= 0:
            raise ValueError(f"replicas must be positive, got {self.replicas}")
        if self.deployment is None:
            if self.keep_replicas:  # a fresh name would never find them again
                raise ValueError(
                    "--keep-replicas needs --deployment: a restarted controller re-attaches only to "
                    "the replicas of its own deployment"
                )
            self.deployment = new_deployment_name()
        # The launcher's deployment is the router's and every replica's (they would not see
        # each other in the index otherwise).
        check_deployment(self.deployment)
        self.router = dataclasses.replace(self.router, deployment=self.deployment)
        self.replica = dataclasses.replace(self.replica, deployment=self.deployment)
        if self._remote_ray and is_loopback(self.router.redis_url):
            raise ValueError(
                f"--ray-address {self.ray_address} puts replicas on other machines, which cannot reach "
                f"{'an embedded Redis' if self.router.redis_url is None else 'a Redis on loopback'} here: "
                "give --redis-url of a Redis they can reach"
            )
        if (
            self.replica.api_key_file is None
            and self.router.replica_api_key_file is None
            and self.router.api_key_file
        ):
            self.replica = dataclasses.replace(
                self.replica, api_key_file=self.router.api_key_file
            )  # as the router presents
        if self.replica.api_key_file is None and (self.keep_replicas or self._remote_ray):
            raise ValueError(
                "replicas that outlive this process or run on other machines need a token file they "
                "can all read: give --replica-api-key-file"
            )
        if self.replica.engine.block_size is None and self.router.block_size is not None:
            # a router told its block size: the replicas hash with the same (auto may differ on a GPU)
            engine = dataclasses.replace(self.replica.engine, block_size=self.router.block_size)
            self.replica = dataclasses.replace(self.replica, engine=engine)
        for router_field, path in SHARED:
            mine, theirs = getattr(self.router, router_field), _get(self.replica, path)
            if mine != theirs and not (router_field == "block_size" and mine is None):  # auto learns theirs
                raise ValueError(
                    f"the router and the replicas disagree on {router_field} ({mine!r} vs {theirs!r})"
                )

    @classmethod
    def for_model(
        cls,
        model_dir: str,
        replicas: int = 2,
        *,
        engine: dict[str, Any] | None = None,
        router: dict[str, Any] | None = None,
        replica: dict[str, Any] | None = None,
        deployment: str = DEFAULT_DEPLOYMENT,
        **launcher: Any,
    ) -> ClusterConfig:
        """One model folder for the router and every replica, as ``--model`` does (the demo,
        benchmarks and tests build their clusters this way). Unlike ``kvmesh up``'s, their
        deployment is ``default`` unless given: a router they add without one sees the replicas."""
        return cls(
            router=RouterConfig(model_dir, **(router or {})),
            replica=ReplicaConfig(
                model_dir, engine=EngineConfig.from_kwargs(**(engine or {})), **(replica or {})
            ),
            replicas=replicas,
            deployment=deployment,
            **launcher,
        )

    @staticmethod
    def together(configs: Sequence[ClusterConfig]) -> list[ClusterConfig]:
        """Several models' configs as one deployment (``kvmesh up --model A --model B``): one
        deployment name for all (the first's), the launcher's own settings alike, and each
        model its own id."""
        first = configs[0]
        together = [first] + [dataclasses.replace(c, deployment=first.deployment) for c in configs[1:]]
        for name in ("ray_address", "with_router", "keep_replicas", "verbose"):
            if len({getattr(c, name) for c in together}) > 1:
                raise ValueError(f"the models of one deployment differ in {name}")
        ids = [c.model_id for c in together]
        if len(set(ids)) < len(ids):
            raise ValueError(
                f"two models have one id ({', '.join(ids)}): give each its own, --model DIR,model-id=NAME"
            )
        return together

    @property
    def model_id(self) -> str:
        """The model's name in the index (its id, else its folder's name)."""
        return model_id_of(self.replica.model_dir, self.replica.model_id)

    @property
    def _remote_ray(self) -> bool:
        return bool(self.ray_address) and not on_this_machine(self.ray_address)

    def with_replica_token(self, path: str) -> ClusterConfig:
        """The same cluster with every replica requiring the token in ``path`` (and the router
        presenting it)."""
        return dataclasses.replace(
            self,
            router=dataclasses.replace(self.router, replica_api_key_file=path),
            replica=dataclasses.replace(self.replica, api_key_file=path),
        )

    def with_redis(self, url: str) -> ClusterConfig:
        """The same cluster over the index at ``url`` (the launcher's embedded Valkey)."""
        return dataclasses.replace(
            self,
            router=dataclasses.replace(self.router, redis_url=url),
            replica=dataclasses.replace(self.replica, redis_url=url),
        )


def _host(address: str) -> str:
    return urlsplit(address if "://" in address else f"//{address}").hostname or ""


def is_loopback(address: str | None) -> bool:
    """Whether only this machine can reach an address (None: the embedded Redis)."""
    if address is None:
        return True
    return is_loopback_host(_host(address))


def on_this_machine(address: str) -> bool:
    """Whether a Ray address is this machine's (loopback, or an address it can bind)."""
    if address in ("auto", "local") or is_loopback(address):
        return True
    try:
        with socket.socket(socket.AF_INET6 if ":" in _host(address) else socket.AF_INET) as probe:
            probe.bind((_host(address), 0))
    except OSError:  # not one of ours, or not resolvable here
        return False
    return True


def _get(obj: object, path: tuple[str, ...]) -> object:
    for name in path:
        obj = getattr(obj, name)
    return obj
