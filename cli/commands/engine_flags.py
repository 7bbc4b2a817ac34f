"""``--engine`` and ``--vllm-python``: what the replicas a command starts run (the demo's and the
benchmarks' alike)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmesh.cluster.errors import UsageError


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=("kvmesh", "vllm"),
        default="kvmesh",
        help="what the replicas run: kvmesh's engine, or real vLLM servers (make vllm)",
    )
    parser.add_argument(
        "--vllm-python", default=".venv-vllm/bin/python", help="with --engine vllm: the Python that has vLLM"
    )


def vllm_python(args: argparse.Namespace) -> str | None:
    """``--engine vllm``: its Python, absolute (a venv's python is a link: not resolved); one
    line, exit 2, where there is none."""
    if args.engine != "vllm":
        return None
    if not Path(args.vllm_python).is_file():
        raise UsageError(f"--engine vllm: no Python at {args.vllm_python} (make vllm, or give --vllm-python)")
    return str(Path(args.vllm_python).absolute())
