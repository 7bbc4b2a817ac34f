"""``kvmesh router``: the router alone (Kubernetes), over an existing Redis."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvmesh.cli.flags import FlagTable
from kvmesh.router.config import RouterConfig
from kvmesh.serving import event_loop
from kvmesh.serving.options import option


@dataclass
class Logging:
    verbose: bool = option(False, help="info-level logs")


FLAGS = FlagTable([RouterConfig, Logging], several_models=True)


def register(commands) -> None:
    router = commands.add_parser("router", help="the router alone (Kubernetes), over an existing Redis")
    FLAGS.add_to(router)
    router.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.cli.commands.checks import check_files, check_model_folder
    from kvmesh.cli.logs import setup_logging
    from kvmesh.cluster.errors import UsageError
    from kvmesh.kvcache.index.api import IndexSettingsError
    from kvmesh.serving.grpc_server import ListenError

    built = FLAGS.build_models(args)
    configs, logging = [config for config, _ in built], built[0][1]
    if not configs[0].redis_url:
        raise UsageError(
            "--redis-url is required (or set KVMESH_REDIS_URL): the router serves over an existing index"
        )
    for config in configs:
        check_model_folder(config.model_dir)
        check_files(config)
    setup_logging(logging.verbose)
    try:
        event_loop.run(serve_router(configs))
    except (ListenError, IndexSettingsError) as exc:  # a port taken; settings the index has otherwise
        raise UsageError(str(exc)) from None
    return 0


async def serve_router(configs: list[RouterConfig]) -> None:
    """The router alone (Kubernetes), until a signal; never loads torch or Ray."""
    from kvmesh.cluster.errors import UsageError
    from kvmesh.cluster.signals import wait_for_signal
    from kvmesh.router.process import RouterServer

    try:
        router = RouterServer(configs)
    except ValueError as exc:  # models that clash: two answer to one name, or differ router-wide
        raise UsageError(str(exc)) from None
    config = router.config
    waiting = [route.model_id for route in router.models.routes if route.config.block_size is None]
    if waiting:
        print(
            f"kvmesh router: waiting for a replica of {', '.join(waiting)} (deployment {config.deployment}) "
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
