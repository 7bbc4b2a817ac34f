"""The ``kvmesh`` command line: a table of commands, each in its own module (``commands/``).

Errors a user can fix (bad flags, missing files) print one line and exit 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvmesh.cli.commands import (
    bench,
    demo,
    download_model,
    drain_replicas,
    experiments,
    make_secrets,
    make_tiny_model,
    report,
    router,
    simulate,
    status,
    up,
    valkey_acl,
)
from kvmesh.cluster.errors import UsageError

EXIT_USAGE = 2
COMMANDS = (
    up,
    router,
    status,
    download_model,
    make_secrets,
    valkey_acl,
    drain_replicas,
    demo,
    bench,
    simulate,
    report,
    experiments,
    make_tiny_model,
)


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (``kvmesh: error: ...``) instead of usage + error,
    and no abbreviations (``--api-key`` is not ``--api-key-file``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvmesh", description="Distributed LLM serving with a shared prefix index.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # quiet by default (fork notices, ...)
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as exc:
        print(f"kvmesh: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvmesh: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
