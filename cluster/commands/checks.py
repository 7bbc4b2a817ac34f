"""Checks of what a serving command was given that no config can make on its own (files)."""

from __future__ import annotations

from pathlib import Path

from kvmesh.cluster.errors import UsageError
from kvmesh.serving.tls import TLSConfig


def check_model_folder(model_dir: str) -> None:
    if not (Path(model_dir) / "config.json").is_file():
        raise UsageError(f"--model {model_dir!r} is not a model folder (no config.json)")


def check_tls_files(tls: TLSConfig) -> None:
    try:
        tls.check_files()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
