"""``kvmesh up``: Ray, Redis (embedded unless given), N replicas and the router, until a signal."""

from __future__ import annotations

import argparse
import asyncio

from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.flags import FlagTable

FLAGS = FlagTable([ClusterConfig])


def register(commands) -> None:
    up = commands.add_parser("up", help="serve a model: Ray, Redis, N replicas and the router")
    FLAGS.add_to(up)
    up.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.cluster.commands.checks import check_files, check_model_folder
    from kvmesh.cluster.errors import UsageError
    from kvmesh.cluster.logs import setup_logging
    from kvmesh.serving.grpc_server import ListenError

    (config,) = FLAGS.build(args)
    if config.ray_address is None:  # with a Ray cluster, the model folder is on its workers
        check_model_folder(config.router.model_dir)
    check_files(config.router)
    # Ray and torch only once the flags are known good: a usage error is answered at once.
    from kvmesh.cluster.launcher import serve_cluster
    from kvmesh.cluster.supervisor import ReplicaStartError

    setup_logging(config.verbose)
    try:
        asyncio.run(serve_cluster(config))
    except (ReplicaStartError, ListenError) as exc:
        raise UsageError(str(exc)) from None
    return 0
