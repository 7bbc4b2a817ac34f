"""``kvmesh router``: the router alone (Kubernetes), over an existing Redis."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvmesh.cluster.flags import FlagTable
from kvmesh.router.config import RouterConfig
from kvmesh.serving import event_loop
from kvmesh.serving.options import option


@dataclass
class Logging:
    verbose: bool = option(False, help="info-level logs")


FLAGS = FlagTable([RouterConfig, Logging])


def register(commands) -> None:
    router = commands.add_parser("router", help="the router alone (Kubernetes), over an existing Redis")
    FLAGS.add_to(router)
    router.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.cluster.commands.checks import check_files, check_model_folder
    from kvmesh.cluster.errors import UsageError
    from kvmesh.cluster.logs import setup_logging
    from kvmesh.serving.grpc_server import ListenError

    config, logging = FLAGS.build(args)
    if not config.redis_url:
        raise UsageError(
            "--redis-url is required (or set KVMESH_REDIS_URL): the router serves over an existing index"
        )
    check_model_folder(config.model_dir)
    check_files(config)
    setup_logging(logging.verbose)
    try:
        event_loop.run(serve_router(config))
    except ListenError as exc:
        raise UsageError(str(exc)) from None
    return 0


async def serve_router(config: RouterConfig) -> None:
    """The router alone (Kubernetes), until a signal; never loads torch or Ray."""
    from kvmesh.cluster.signals import wait_for_signal
    from kvmesh.router.process import RouterServer

    router = RouterServer(config)
    if config.block_size is None:
        print(
            f"kvmesh router: waiting for a replica of {router.model_id} (deployment {config.deployment}) "
            "to store its block size",
            flush=True,
        )
    try:
        await router.start()
        print(
            f"kvmesh router: gRPC {router.address}, HTTP port {router.http_port}, "
            f"deployment {config.deployment}, event loop {event_loop.loop_name()}",
            flush=True,
        )
        await wait_for_signal()
    finally:
        await router.stop()
