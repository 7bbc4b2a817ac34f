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
    from kvmesh.cluster.commands.checks import check_model_folder, check_tls_files
    from kvmesh.cluster.launcher import serve_cluster
    from kvmesh.cluster.logs import setup_logging

    (config,) = FLAGS.build(args)
    check_model_folder(config.router.model_dir)
    check_tls_files(config.router.tls)
    setup_logging(config.verbose)
    asyncio.run(serve_cluster(config))
    return 0
