"""Checks of what a serving command was given that no config can make on its own (files)."""

from __future__ import annotations

from pathlib import Path

from kvmesh.cluster.errors import UsageError
from kvmesh.cluster.extras import require_extra
from kvmesh.router.config import RouterConfig


def check_model_folder(model_dir: str) -> None:
    if not (Path(model_dir) / "config.json").is_file():
        raise UsageError(f"--model {model_dir!r} is not a model folder (no config.json)")


def check_files(router: RouterConfig) -> None:
    """The TLS files and the token files are there and readable (one line, exit 2, if not)."""
    try:
        router.tls.check_files()
        router.client_token()
        router.replica_token()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if router.otlp_endpoint:
        require_extra("otel", "opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc")
