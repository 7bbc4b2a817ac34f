"""Connecting to the prefix index with the credentials this process was given.

Redis secrets never travel in flags, URLs, the environment or configs shipped to other
processes: each process reads its user name and the path of its password file from its own
environment, ``KVMESH_REDIS_USERNAME`` and ``KVMESH_REDIS_PASSWORD_FILE`` (and
``KVMESH_REDIS_CA`` for ``rediss://``); on Kubernetes, the password is a Secret volume.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis.asyncio as aioredis

from kvmesh.kvcache.index.redis import RedisPrefixIndex, connect
from kvmesh.serving.auth import read_token_file
from kvmesh.serving.options import env_name, read_env


@dataclass(frozen=True)
class RedisCredentials:
    """Who this process is to Redis: an ACL user (or the default one) and its password file,
    or the password itself where its supervisor issued it (a replica's own user)."""

    username: str | None = None
    password_file: str | None = None
    ca_file: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls) -> RedisCredentials:
        return cls(read_env("redis-username"), read_env("redis-password-file"), read_env("redis-ca"))

    def connect_kwargs(self) -> dict[str, str | None]:
        """What ``kvcache.index.connect`` takes (the password read from its file now)."""
        password = self.password or (
            read_token_file(self.password_file, env_name("redis-password-file"))
            if self.password_file
            else None
        )
        return {"username": self.username, "password": password, "ca_file": self.ca_file}

    def environment(self) -> dict[str, str]:
        """The same credentials for a child process's environment (names and paths only)."""
        values = {
            "redis-username": self.username,
            "redis-password-file": self.password_file,
            "redis-ca": self.ca_file,
        }
        return {env_name(name): value for name, value in values.items() if value}


def connect_redis(url: str, credentials: RedisCredentials | None = None) -> aioredis.Redis:
    """``credentials``: default, this process's environment."""
    return connect(url, **(credentials or RedisCredentials.from_env()).connect_kwargs())


def connect_index(
    url: str,
    model_id: str,
    block_size: int | None,
    hash_seed: int | None,
    deployment: str,
    credentials: RedisCredentials | None = None,
) -> RedisPrefixIndex:
    """``deployment``: which deployment of the model (``kvmesh.serving.deployment``); every
    caller names it, so no process falls back to another deployment's keys unawares.
    ``credentials``: default, this process's environment."""
    kwargs = (credentials or RedisCredentials.from_env()).connect_kwargs()
    return RedisPrefixIndex.from_url(url, model_id, block_size, hash_seed, deployment, **kwargs)
