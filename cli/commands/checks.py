"""Checks of what a serving command was given that no config can make on its own (files)."""

from __future__ import annotations

import sys
from pathlib import Path

from kvmesh.cli.extras import require_extra
from kvmesh.cluster.errors import UsageError
from kvmesh.replica.config import ReplicaConfig
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


def check_engine(replica: ReplicaConfig, local: bool) -> None:
    """engine=vllm with replicas on this machine (``local``): kvmesh's side of it installed,
    and vLLM where ``--vllm-python`` says; one line, exit 2, naming the extra, if not. On a
    Ray cluster the workers' image holds vLLM, not the controller's: each replica checks."""
    if replica.engine_kind != "vllm" or not local:
        return
    require_extra("vllm", "zmq", "httpx", "msgpack")
    from kvmesh.replica.vllm.server import VllmMissing, check_vllm

    try:
        check_vllm(replica.vllm_python or sys.executable)
    except VllmMissing as exc:
        raise UsageError(str(exc)) from None
