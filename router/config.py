"""The router's settings: one dataclass, from which ``kvmesh router`` and ``kvmesh up`` derive
their flags (and ``KVMESH_*`` environment defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.router.flow import FlowConfig
from kvmesh.router.index_trust.states import IndexTrustConfig
from kvmesh.router.policies import POLICIES, SATURATION_STEPS
from kvmesh.router.pricing import FleetPrices
from kvmesh.router.share_alarm import ShareAlarm
from kvmesh.serving.api_config import APIConfig
from kvmesh.serving.auth import read_token_file
from kvmesh.serving.connections import ConnectionLimits
from kvmesh.serving.deployment import DEFAULT_DEPLOYMENT, check_deployment
from kvmesh.serving.limits import InputLimits
from kvmesh.serving.options import option
from kvmesh.serving.tls import TLSConfig


def _check_port(name: str, value: int, off_allowed: bool = False) -> None:
    low = -1 if off_allowed else 0
    if not low <= value < 65536:
        extra = ", -1: off" if off_allowed else ""
        raise ValueError(f"{name} must be in [0, 65535] (0: any free port{extra}), got {value}")


def _check_positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


# Speculative entries live up to two TTLs in the index (two buckets of one TTL); the
# index frees a dead replica's slot 60 s after its death (kvcache/index/redis.lua QUARANTINE_MS).
MAX_SPECULATIVE_TTL_S = 10.0
MAX_MIGRATION_LIMIT = 8  # each move re-reads the whole prompt on a new replica


@dataclass(frozen=True)
class RouterLimits:
    """Bounds that keep one router from queueing without limit or taking oversized work."""

    max_inflight: int = option(1024, help="requests streaming through this router at once; beyond: 429")
    max_prompt_tokens: int | None = option(
        None, help="longest prompt accepted (default: max model length - 1)"
    )
    max_tokens: int | None = option(
        None, flag="max-tokens-limit", help="ceiling on max_tokens (default: max model length - 1)"
    )
    inputs: InputLimits = option(factory=InputLimits, help="bounds on what one request may ask for")
    migration_limit: int = option(
        1,
        help="times a stream whose replica fails midway moves to another replica, the tokens it "
        "sent as its prompt's end (0: it fails, as a failed stream did before)",
    )

    def __post_init__(self) -> None:
        _check_positive(self, "max_inflight", "max_prompt_tokens", "max_tokens")
        if not 0 <= self.migration_limit <= MAX_MIGRATION_LIMIT:
            raise ValueError(
                f"migration_limit must be in [0, {MAX_MIGRATION_LIMIT}], got {self.migration_limit}"
            )


@dataclass(frozen=True)
class BalanceConfig:
    """How the prefix policy keeps one replica from taking too much (``router/pricing.py``,
    ``router/share_alarm.py``, ``PrefixAware``)."""

    price_spread: float = option(
        1.0,
        help="largest ratio between the prices of two replicas on like hardware "
        "(1: priced alike, their queues still tell them apart)",
    )
    price_half_life_s: float = option(
        10.0, flag="price-half-life", help="seconds a replica's price takes to move halfway to a new fit"
    )
    saturation_steps: float = option(
        SATURATION_STEPS,
        help="a replica keeps a prefix it holds until its queued prefill exceeds this many full "
        "chunked-prefill steps; then the prefix spills to a second replica",
    )
    share_alarm_factor: float = option(
        2.0,
        help="share alarm: a replica over this many times its fair share of new prefixes (prompts it "
        "held none of) or of their prefill",
    )
    share_alarm_window_s: float = option(
        60.0, flag="share-alarm-window", help="seconds of routing the share alarm judges"
    )
    share_alarm_min_per_replica: int = option(
        5,
        help="new prefixes placed in the window, per live replica, before the share alarm judges "
        "anything (fewer: one replica's share is chance)",
    )

    def __post_init__(self) -> None:
        if self.price_spread < 1:
            raise ValueError(f"price_spread must be >= 1, got {self.price_spread}")
        if self.share_alarm_factor <= 1:
            raise ValueError(f"share_alarm_factor must be > 1, got {self.share_alarm_factor}")
        _check_positive(
            self,
            "price_half_life_s",
            "saturation_steps",
            "share_alarm_window_s",
            "share_alarm_min_per_replica",
        )

    def prices(self) -> FleetPrices:
        return FleetPrices(self.price_spread, self.price_half_life_s)

    def alarm(self) -> ShareAlarm:
        return ShareAlarm(
            self.share_alarm_factor, self.share_alarm_window_s, self.share_alarm_min_per_replica
        )


@dataclass(frozen=True)
class RouterConfig:
    model_dir: str = option(
        flag="model",
        per_model=True,
        help="local Hugging Face model folder; several models: repeat it, each as DIR[,KEY=VALUE...] "
        "with its own per-model settings (docs/configuration.md)",
    )
    redis_url: str | None = option(
        None, help="Redis/Valkey URL of the prefix index (kvmesh up: an embedded valkey-server if unset)"
    )
    model_id: str | None = option(
        None, per_model=True, help="name of the model in the index (default: the folder name)"
    )
    deployment: str = option(
        DEFAULT_DEPLOYMENT,
        help="which deployment of the model this is: deployments on one Redis keep their replicas and "
        "index entries apart",
    )
    block_size: int | None = option(
        None,
        per_model=True,
        help="KV block size in tokens; auto: the replicas' choice (256 where flash-attn runs, else 16)",
    )
    max_model_len: int | None = option(
        None, per_model=True, help="longest prompt + output (default: the model's)"
    )
    host: str = option("127.0.0.1", help="address the router listens on")
    port: int = option(50051, help="router gRPC port (0: any free port)")
    http_port: int = option(8000, help="router OpenAI HTTP port (0: any free port, -1: off)")
    policy: str = option("prefix", choices=tuple(POLICIES), help="default routing policy")
    # Once a second, like the replicas' heartbeats that change what it reads: on an idle
    # router each read costs ~0.5 ms of CPU (cold caches), twice a second was half its idle CPU.
    refresh_s: float = option(1.0, flag="registry-refresh", help="seconds between reads of the live replicas")
    speculative_ttl_s: float = option(2.0, flag="speculative-ttl", help="seconds a speculative entry lives")
    shared_load: str = option(
        "on",
        choices=("on", "off"),
        help="on: the policy sees every router's in-flight work (kept in the index); off: this router's own",
    )
    limits: RouterLimits = option(factory=RouterLimits, help="request limits")
    api: APIConfig = option(factory=APIConfig, per_model=True, help="how the model is presented to clients")
    balance: BalanceConfig = option(
        factory=BalanceConfig, help="how the prefix policy keeps one replica from taking too much"
    )
    index_trust: IndexTrustConfig = option(
        factory=IndexTrustConfig, help="when the router stops trusting the index for a replica"
    )
    flow: FlowConfig = option(
        factory=FlowConfig, help="flow control: tenants, priority bands and the queue of a saturated fleet"
    )
    max_message_bytes: int = option(4 << 20, help="largest request accepted (gRPC message, HTTP body)")
    drain_timeout_s: float = option(
        30.0, flag="drain-timeout", help="seconds in-flight requests get on SIGTERM"
    )
    tls: TLSConfig = option(factory=TLSConfig, help="TLS for serving and toward the replicas")
    connections: ConnectionLimits = option(
        factory=ConnectionLimits, help="what a slow, stuck or vanished client may hold"
    )
    api_key_file: str | None = option(
        None,
        help="file holding the bearer token clients must send (gRPC metadata, HTTP header); default: none",
    )
    replica_api_key_file: str | None = option(
        None,
        help="file holding the bearer token the replicas require; the router presents it (default: --api-key-file's)",
    )
    metrics_port: int = option(
        -1,
        help="plain-HTTP port with only /metrics and /health, for scrapers and probes: no token, no TLS (-1: off)",
    )
    otlp_endpoint: str | None = option(
        None,
        help="OpenTelemetry collector (OTLP/gRPC, e.g. http://otel-collector:4317) for traces; needs kvmesh[otel]",
    )

    def __post_init__(self) -> None:
        _check_positive(self, "block_size", "max_model_len", "max_message_bytes", "refresh_s")
        _check_port("port", self.port)
        _check_port("http_port", self.http_port, off_allowed=True)
        check_deployment(self.deployment)
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is unknown; known: {', '.join(sorted(POLICIES))}")
        if self.speculative_ttl_s < 0 or self.drain_timeout_s < 0:
            raise ValueError("speculative_ttl_s and drain_timeout_s must not be negative")
        if self.speculative_ttl_s > MAX_SPECULATIVE_TTL_S:
            raise ValueError(
                f"speculative_ttl_s must be at most {MAX_SPECULATIVE_TTL_S:g} s (the index frees a dead "
                f"replica's slot a minute after its speculative entries could last), got {self.speculative_ttl_s:g}"
            )
        if self.metrics_port != -1:
            _check_port("metrics_port", self.metrics_port)

    def client_token(self) -> str | None:
        """The bearer token clients must send, if any (read from its file now)."""
        return read_token_file(self.api_key_file, "--api-key-file") if self.api_key_file else None

    def replica_token(self) -> str | None:
        """The bearer token this router presents to the replicas."""
        if self.replica_api_key_file:
            return read_token_file(self.replica_api_key_file, "--replica-api-key-file")
        return self.client_token()

    @property
    def serves_http(self) -> bool:
        return self.http_port >= 0
