"""Connecting to the prefix index with the credentials this process was given.

Redis secrets never travel in flags, URLs or configs shipped to other processes: each
process reads ``KVMESH_REDIS_PASSWORD`` / ``KVMESH_REDIS_USERNAME`` (and ``KVMESH_REDIS_CA``
for ``rediss://``) from its own environment (on Kubernetes, a ``secretKeyRef``).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from kvmesh.kvcache.index import RedisPrefixIndex, connect
from kvmesh.serving.options import read_env


def _credentials() -> dict[str, str | None]:
    return {
        "username": read_env("redis-username"),
        "password": read_env("redis-password"),
        "ca_file": read_env("redis-ca"),
    }


def connect_redis(url: str) -> aioredis.Redis:
    return connect(url, **_credentials())


def connect_index(
    url: str, model_id: str, block_size: int | None, hash_seed: int | None, deployment: str
) -> RedisPrefixIndex:
    """``deployment``: which deployment of the model (``kvmesh.serving.deployment``); every
    caller names it, so no process falls back to another deployment's keys unawares."""
    return RedisPrefixIndex.from_url(url, model_id, block_size, hash_seed, deployment, **_credentials())
