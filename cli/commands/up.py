"""``kvmesh up``: Ray, Redis (embedded unless given), N replicas of each model and the router, until
a signal. Several models: ``--model DIR[,KEY=VALUE...]`` repeated (``cli/flags.py``)."""

from __future__ import annotations

import argparse
import asyncio

from kvmesh.cli.flags import FlagTable
from kvmesh.cluster.config import ClusterConfig

FLAGS = FlagTable([ClusterConfig], several_models=True)


def register(commands) -> None:
    up = commands.add_parser(
        "up", help="serve one model or several: Ray, Redis, N replicas of each, and one router for all"
    )
    FLAGS.add_to(up)
    up.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.cli.commands.checks import check_engine, check_files, check_model_folder
    from kvmesh.cli.logs import setup_logging
    from kvmesh.cluster.errors import UsageError
    from kvmesh.serving.grpc_server import ListenError

    try:
        configs = ClusterConfig.together([config for (config,) in FLAGS.build_models(args)])
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for config in configs:
        if config.ray_address is None:  # with a Ray cluster, the model folders are on its workers
            check_model_folder(config.router.model_dir)
        check_files(config.router)
        check_engine(config.replica, local=config.ray_address is None)
    # Ray and torch only once the flags are known good: a usage error is answered at once.
    from kvmesh.cluster.launcher import serve_cluster
    from kvmesh.cluster.supervisor import ReplicaStartError
    from kvmesh.kvcache.index.api import IndexSettingsError

    setup_logging(configs[0].verbose)
    try:
        asyncio.run(serve_cluster(configs))
    except (ReplicaStartError, ListenError, IndexSettingsError) as exc:
        raise UsageError(str(exc)) from None
    return 0
