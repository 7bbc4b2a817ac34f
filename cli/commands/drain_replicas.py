"""``kvmesh drain-replicas``: drain every replica on this machine and wait until they are done
(the Ray pods' preStop: a node drain then loses no request)."""

from __future__ import annotations

import argparse


def register(commands) -> None:
    drain = commands.add_parser(
        "drain-replicas", help="drain every replica on this machine, then return (a Ray pod's preStop)"
    )
    drain.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait (the replicas' drain timeout plus a margin)",
    )
    drain.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kvmesh.cluster.errors import UsageError
    from kvmesh.cluster.node_drain import drain_local_replicas

    if not args.timeout > 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")
    drained, left = asyncio.run(drain_local_replicas(args.timeout))
    print(
        f"drained {len(drained)} replica(s)"
        + (f"; not within {args.timeout:g} s: {', '.join(left)}" if left else "")
    )
    return 1 if left else 0
