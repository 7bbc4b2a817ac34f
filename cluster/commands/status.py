"""``kvmesh status``: live replicas, load and hit rates, read from the index."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvmesh.cluster.flags import FlagTable
from kvmesh.serving.options import option


@dataclass
class StatusConfig:
    redis_url: str = option(help="Redis/Valkey URL of the prefix index")


FLAGS = FlagTable([StatusConfig])


def register(commands) -> None:
    status = commands.add_parser("status", help="live replicas, load and hit rates from the index")
    FLAGS.add_to(status)
    status.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from kvmesh.cluster.errors import UsageError
    from kvmesh.cluster.status import main as status_main
    from kvmesh.serving.options import redacted_url

    (config,) = FLAGS.build(args)
    try:
        return status_main(config.redis_url)
    except (RedisError, OSError, ValueError) as exc:
        raise UsageError(f"cannot read the index at {redacted_url(config.redis_url)}: {exc}") from None
