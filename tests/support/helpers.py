"""Small shared test helpers."""

import asyncio
import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


async def eventually(predicate, timeout: float = 10.0) -> bool:
    """Poll an async predicate until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.05)
    return False


def metric(server, name: str, **labels: str) -> float:
    """A metric of ``server`` (anything with ``render_metrics``: a router's core, a replica's
    backend), summed over the label values not given."""
    from kvmesh.serving.metrics import read_samples

    samples = read_samples(server.render_metrics().decode())
    return sum(v for (n, have), v in samples.items() if n == name and labels.items() <= dict(have).items())


async def live_replicas_are(router, n: int) -> bool:
    """Whether ``router`` sees ``n`` live replicas after reading the index now."""
    await router.registry.refresh()
    return len(router.registry.live()) == n


def local_router_config(model_dir, redis_url: str, **overrides):
    """A router for tests: any free ports (HTTP on: pass http_port=-1 for none), a quick
    registry refresh, block size 16 (the CPU replicas'; "auto" would wait for a replica to
    store it); everything else as given."""
    from kvmesh.router.config import RouterConfig

    defaults = {"port": 0, "http_port": 0, "refresh_s": 0.1, "block_size": 16}
    return RouterConfig(str(model_dir), redis_url, **{**defaults, **overrides})


def another_router(cluster, model_dir, **overrides):
    """One more router of a ``LocalCluster``'s deployment, as a second router pod would be:
    its own ports, the cluster's index user for routers and the replicas' token."""
    from kvmesh.router.process import RouterServer

    config = local_router_config(
        model_dir,
        cluster.redis_url,
        replica_api_key_file=cluster.config.router.replica_api_key_file,
        **overrides,
    )
    return RouterServer(config, redis_credentials=cluster.router_redis)


async def started_router(router):
    """``router`` started, once it sees a live replica (its registry refreshed at once, not
    on its timer)."""
    await router.start()
    for _ in range(100):
        if router.registry.live():
            break
        await router.registry.refresh()
    return router


def vllm_python() -> str:
    """`make vllm`'s interpreter (or $KVMESH_VLLM_PYTHON); a missing one fails, never skips."""
    python = os.environ.get("KVMESH_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).is_file():
        pytest.fail(f"no vLLM at {python}: run `make vllm` (make test does)")
    return python
