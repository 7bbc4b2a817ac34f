"""The Ray actor that hosts one replica (one GPU where there are GPUs)."""

from __future__ import annotations

import os
import time

import ray

from kvmesh.replica.process import ReplicaConfig, ReplicaServer


class ReplicaActor:
    """Ray async actor around ReplicaServer; create with ``replica_actor_class(...)``."""

    def __init__(self, config: ReplicaConfig, index_user: tuple[str, str] | None = None):
        """``index_user``: (user, password) of this replica's own index user, where its
        supervisor issued one (else the process's environment names the role's user)."""
        # A node's drain (kvmesh drain-replicas) ends this process once the replica drained:
        # the supervisor sees it gone and starts a replacement where Ray can place it.
        self.server = ReplicaServer(config, on_drained=lambda: os._exit(0), index_user=index_user)

    def config(self) -> ReplicaConfig:
        """The settings it runs with (a controller re-attaches only to replicas with its own)."""
        return self.server.config

    async def start(self) -> str:
        return await self.server.start()

    async def stop(self, grace: float = 5.0) -> None:
        await self.server.stop(grace)

    async def cached_hashes(self) -> list[int]:
        """The engine's hittable hashes now (for checks against the index)."""
        return sorted(await self.server.engine.cached_hashes())

    async def index_state(self) -> dict:
        incarnation, dirty = self.server.index_state()
        return {"incarnation": incarnation, "dirty": dirty, "syncs": self.server.publisher.syncs}

    def address(self) -> str:
        return self.server.address

    def health(self) -> dict:
        """The replica's health (its engine's, while not draining): the supervisor's check."""
        return self.server.health()

    async def use_index_user(self, user: str, password: str) -> None:
        """Its own index user's new password (the server lost its users, or it was rotated)."""
        await self.server.use_index_user(user, password)

    def pid(self) -> int:
        return os.getpid()

    async def inject_step_delay(self, seconds: float) -> None:
        """Fault injection (tests, chaos drills): every engine step takes ``seconds`` longer,
        inside its timed compute, as on slower hardware (its measured step costs show it)."""

        def slow_down(engine) -> None:
            run = engine._run

            def delayed_run(scheduled):
                time.sleep(seconds)
                return run(scheduled)

            engine._run = delayed_run

        await self.server.engine.call(slow_down)

    async def inject_forward_failure(self) -> None:
        """Fault injection: every forward from now on raises, as on a device that stays unusable."""

        def fail(*args):
            raise RuntimeError("injected device failure")

        def break_forward(engine) -> None:
            engine.runner._forward_layout = fail

        await self.server.engine.call(break_forward)

    async def inject_event_loss(self) -> None:
        """Fault injection (engine=vllm): the next block vLLM stores never reaches the index,
        as if its event were lost unseen."""
        self.server.engine.drop_next_stored_event()

    def kill_engine(self) -> None:
        """Fault injection (engine=vllm): the vLLM server dies, as on an out-of-memory kill."""
        self.server.engine.server.kill()


def replica_actor_class(use_gpu: bool, num_cpus: float = 1):
    """The remote class with its resources: one GPU per replica when CUDA is present."""
    return ray.remote(num_cpus=num_cpus, num_gpus=1 if use_gpu else 0, max_concurrency=1000)(ReplicaActor)


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0
