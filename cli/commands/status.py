"""``kvmesh status``: live replicas, load and the controller's replica slots, from a router
(default: the local one) or from the index."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvmesh.cli.flags import FlagTable
from kvmesh.serving.options import option


@dataclass
class StatusConfig:
    address: str = option("127.0.0.1:50051", help="a router's gRPC address (ListReplicas)")
    redis_url: str | None = option(None, help="read the index instead: every model served through this Redis")
    json: bool = option(False, help="print JSON")
    tls_ca: str | None = option(None, help="CA to verify a TLS router with")
    api_key_file: str | None = option(None, help="file holding the router's bearer token, if it requires one")


FLAGS = FlagTable([StatusConfig])


def register(commands) -> None:
    status = commands.add_parser("status", help="live replicas, load and replica slots (router or index)")
    FLAGS.add_to(status)
    status.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import grpc
    from redis.exceptions import RedisError

    from kvmesh.cli.status import main as status_main
    from kvmesh.cluster.errors import UsageError
    from kvmesh.serving.auth import read_token_file
    from kvmesh.serving.options import redacted_url

    (config,) = FLAGS.build(args)
    if FLAGS.given(args, "address") and not FLAGS.given(args, "redis-url"):
        # a router named on the command line is asked, even where the environment names the
        # index (every chart pod has KVMESH_REDIS_URL: `kubectl exec ... kvmesh status --address`)
        config.redis_url = None
    source = redacted_url(config.redis_url) if config.redis_url else f"the router at {config.address}"
    try:
        token = read_token_file(config.api_key_file, "--api-key-file") if config.api_key_file else None
        return status_main(config.address, config.redis_url, config.json, config.tls_ca, token)
    except grpc.aio.AioRpcError as exc:
        raise UsageError(f"cannot read {source}: {exc.code().name}: {exc.details()}") from None
    except (RedisError, OSError, ValueError) as exc:
        raise UsageError(f"cannot read {source}: {exc}") from None
