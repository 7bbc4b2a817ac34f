"""Every setting given on ``kvmesh up``'s (and ``kvmesh router``'s) command line arrives in the
running router and in every running replica, read back over gRPC from the processes
themselves (``GetModelInfo`` / ``GetStats`` carry a redacted effective config).

What is checked comes from the same flag table the CLI is built from, so a new setting
without a value here fails the test instead of going unchecked.
"""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvmesh.cli.commands import router as router_command
from kvmesh.cli.commands import up as up_command
from kvmesh.cluster.embedded_redis import EmbeddedRedis, free_port
from kvmesh.protos import pb, pb_grpc

pytestmark = pytest.mark.servers  # starts Redis, Ray, servers or kvmesh processes

KVMESH = str(Path(sys.executable).with_name("kvmesh"))

# flag -> (command-line value, value expected in the effective config); every one differs
# from its default. Paths, ports and URLs are filled in per test.
VALUES = {
    "model-id": ("roundtrip-model", "roundtrip-model"),
    "deployment": ("roundtrip/deploy-1.0", "roundtrip/deploy-1.0"),
    "block-size": ("32", 32),
    "max-model-len": ("2000", 2000),
    "host": ("localhost", "localhost"),
    "policy": ("least_loaded", "least_loaded"),
    "registry-refresh": ("0.3", 0.3),
    "speculative-ttl": ("1.5", 1.5),
    "shared-load": ("off", "off"),
    "index-trust-window": ("30", 30),
    "index-trust-max-age": ("45.0", 45.0),
    "index-trust-min-samples": ("5", 5),
    "index-degraded-rate": ("0.3", 0.3),
    "index-load-only-rate": ("0.7", 0.7),
    "index-lag-tolerance": ("3.0", 3.0),
    "price-spread": ("1.2", 1.2),
    "price-half-life": ("20.0", 20.0),
    "saturation-steps": ("3.0", 3.0),
    "share-alarm-factor": ("2.5", 2.5),
    "share-alarm-window": ("30.0", 30.0),
    "share-alarm-min-per-replica": ("8", 8),
    "index-resync-interval": ("20.0", 20.0),
    "max-inflight": ("77", 77),
    "migration-limit": ("2", 2),
    "flow-control": ("off", "off"),
    "priority-bands": ("gold:9:5,lead:7:4:sheddable", "gold:9:5,lead:7:4:sheddable"),
    "default-band": ("lead", "lead"),
    "priority-header": ("x-roundtrip-band", "x-roundtrip-band"),
    "tenant-header": ("x-roundtrip-team", "x-roundtrip-team"),
    "tenants": ("ants,bees", "ants,bees"),
    "max-queue-delay": ("4.5", 4.5),
    "max-prompt-tokens": ("1500", 1500),
    "max-tokens-limit": ("300", 300),
    "max-message-bytes": ("65536", 65536),
    "drain-timeout": ("7.5", 7.5),
    "tls-client-auth": (None, True),  # a switch: --tls-client-auth
    "tls-server-name": ("kvmesh-replica", "kvmesh-replica"),
    "replica-host": ("localhost", "localhost"),
    "replica-http-port": ("-1", -1),
    "replica-advertise-host": ("127.0.0.1", "127.0.0.1"),
    "heartbeat-interval": ("0.4", 0.4),
    "heartbeat-ttl": ("3.5", 3.5),
    "torch-threads": ("1", 1),
    "num-kv-blocks": ("96", 96),
    "kv-cache-memory": ("123456789", 123456789),
    "host-kv-gib": ("0.01", 0.01),
    "gpu-memory-utilization": ("0.5", 0.5),
    "max-num-seqs": ("7", 7),
    "max-num-batched-tokens": ("333", 333),
    "max-queued-requests": ("55", 55),
    "dtype": ("float32", "float32"),
    "device": ("cpu", "cpu"),
    "seed": ("5", 5),
    "attention-backend": ("torch", "torch"),
    "enforce-eager": (None, True),
    "async-scheduling": (None, True),
    "check-invariants": (None, True),
    "served-model-name": ("roundtrip-served", "roundtrip-served"),
    "generation-config": ("vllm", "vllm"),
    "tokenizer-cache-bytes": ("8388608", 8388608),
    "max-batch-prompts": ("33", 33),
    "max-choices": ("44", 44),
    "max-messages": ("55", 55),
    "max-stop": ("9", 9),
    "max-stop-chars": ("99", 99),
    "max-stop-token-ids": ("66", 66),
    "max-logit-bias": ("77", 77),
    "max-template-bytes": ("4096", 4096),
    "max-request-id-chars": ("100", 100),
    "max-session-key-bytes": ("128", 128),
    "stream-write-timeout": ("12.5", 12.5),
    "grpc-max-streams": ("64", 64),
    "grpc-keepalive": ("20.0", 20.0),
    "grpc-keepalive-timeout": ("5.0", 5.0),
    "http-max-head-bytes": ("16384", 16384),
    "http-max-headers": ("64", 64),
    "http-head-timeout": ("8.0", 8.0),
    "http-body-timeout": ("25.0", 25.0),
    "http-idle-timeout": ("4.0", 4.0),
    "http-max-connections": ("512", 512),
    "engine-stall-timeout": ("90.0", 90.0),
    "ray-resource": ("roundtrip-node", "roundtrip-node"),  # the launcher's: its local Ray offers it
}
# Flags the round trip cannot vary here, and why.
NOT_VARIED = {
    "replica-port": "two replicas on one machine cannot share a fixed port (replica-http-port takes the same path)",
    "replicas": "the launcher's own setting: the number of replicas read back is the check",
    "ray-address": "joining another Ray cluster: the chart's controller path",
    "router": "the launcher's own setting: --no-router is test_cli_serving's controller test",
    "keep-replicas": "the launcher's own setting: test_supervisor restarts a controller that keeps them",
    "verbose": "logging only",
    "otlp-endpoint": "needs an OpenTelemetry collector; test_tracing checks the traces in-process",
    "engine": "engine=vllm starts real vLLM servers: tests/test_vllm_replicas.py, and bench peers --engine vllm",
    "vllm-python": "engine=vllm only (tests/test_vllm_replicas.py, test_cli's missing-vLLM line)",
    "vllm-args": "engine=vllm only: passed to vllm serve as given",
}


PER_RUN = {
    "model",
    "redis-url",
    "port",
    "http-port",
    "tls-cert",
    "tls-key",
    "tls-ca",
    "api-key-file",
    "replica-api-key-file",
    "tokenizer",
    "chat-template",
    "pod-metrics-port",
    "metrics-port",
}


def per_run_values(
    pki, qwen3_dir, redis_url: str, token_file: str, replica_token_file: str
) -> dict[str, tuple]:
    cert, key = pki["server"]
    port, http_port, pod_metrics_port, metrics_port = free_port(), free_port(), free_port(), free_port()
    return {
        **VALUES,
        "pod-metrics-port": (str(pod_metrics_port), pod_metrics_port),
        "model": (str(qwen3_dir), str(qwen3_dir)),
        "redis-url": (redis_url, redis_url),
        "port": (str(port), port),
        "http-port": (str(http_port), http_port),
        "tls-cert": (cert, cert),
        "tls-key": (key, key),
        "tls-ca": (pki["ca"], pki["ca"]),
        "api-key-file": (token_file, token_file),
        "replica-api-key-file": (replica_token_file, replica_token_file),
        "metrics-port": (str(metrics_port), metrics_port),
        "tokenizer": (str(qwen3_dir), str(qwen3_dir)),
        "chat-template": (str(qwen3_dir / "chat_template.jinja"), str(qwen3_dir / "chat_template.jinja")),
    }


def command_line(values: dict[str, tuple], flags) -> list[str]:
    argv = []
    for name in flags:
        if name in values:
            text, _ = values[name]
            argv += [f"--{name}"] if text is None else [f"--{name}={text}"]
    return argv


def credentials(pki) -> grpc.ChannelCredentials:
    cert, key = (Path(p).read_bytes() for p in pki["client"])
    return grpc.ssl_channel_credentials(Path(pki["ca"]).read_bytes(), key, cert)


def lookup(config: dict, path: tuple[str, ...]):
    for name in path:
        config = config[name]
    return config


def wait_for_line(proc: subprocess.Popen, marker: str, timeout: float = 240) -> str:
    text, deadline = "", time.monotonic() + timeout
    while marker not in text and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        text += line
    assert marker in text, text + (proc.stderr.read() if proc.poll() is not None else "")
    return text


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_every_flag_of_up_is_varied_or_excused():
    assert set(up_command.FLAGS.flags) - PER_RUN == set(VALUES) | set(NOT_VARIED)


def test_up_settings_arrive_in_the_router_and_in_every_replica(pki, qwen3_dir, valkey_server, tmp_path):
    (tmp_path / "key").write_text("k3y-from-a-file\n")
    (tmp_path / "replica-key").write_text("replica-k3y\n")
    values = per_run_values(
        pki, qwen3_dir, valkey_server.url, str(tmp_path / "key"), str(tmp_path / "replica-key")
    )
    argv = [KVMESH, "up", "--replicas", "2", *command_line(values, up_command.FLAGS.flags)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(proc, "Ctrl-C")
        address = f"localhost:{values['port'][1]}"
        key = (("authorization", "Bearer k3y-from-a-file"),)
        with grpc.secure_channel(address, credentials(pki)) as channel:
            router = pb_grpc.RouterStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                router.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            info = router.GetModelInfo(pb.GetModelInfoRequest(), metadata=key, timeout=10)
            replicas = router.ListReplicas(pb.ListReplicasRequest(), metadata=key, timeout=10).replicas
            too_big = pb.GenerateRequest(text="x" * 70_000)
            with pytest.raises(grpc.RpcError) as err:
                list(router.Generate(too_big, metadata=key, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # --api-key-file is enforced
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # --max-message-bytes is enforced
        assert info.max_model_len == 2000 and info.block_size == 32 and info.model == "roundtrip-model"
        router_config = json.loads(info.effective_config)
        assert len(replicas) == 2 and all(r.address.startswith("127.0.0.1:") for r in replicas)
        replica_configs = []
        for r in replicas:
            with grpc.secure_channel(r.address, credentials(pki)) as channel:
                replica = pb_grpc.ReplicaStub(channel)
                with pytest.raises(grpc.RpcError) as refused:  # --replica-api-key-file is enforced
                    replica.GetStats(pb.GetStatsRequest(), metadata=key, timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                stats = replica.GetStats(
                    pb.GetStatsRequest(), metadata=(("authorization", "Bearer replica-k3y"),), timeout=10
                )
            replica_configs.append(json.loads(stats.effective_config))
            assert stats.num_blocks == 96 and stats.block_size == 32
        assert {c["replica_id"] for c in replica_configs} == {"replica-0", "replica-1"}
        for name, flag in up_command.FLAGS.flags.items():
            if name in NOT_VARIED or name == "api-key-file":  # enforced above, by the router
                continue
            expected = values[name][1]
            for _, part, *path in flag.targets:
                if not path:  # the launcher's own field (--deployment): it is the router's and replicas'
                    continue
                configs = [router_config] if part == "router" else replica_configs
                for config in configs:
                    assert lookup(config, path) == expected, (name, part, path)
    finally:
        stop(proc)


def test_router_settings_arrive_from_flags_and_environment(pki, qwen3_dir, tmp_path):
    """``kvmesh router`` alone: half the settings as flags, half as KVMESH_* variables; the
    token and the Redis password never show."""
    with EmbeddedRedis(extra_args=["--requirepass", "pa55word"]) as redis:
        url = redis.url.replace("redis://", "redis://:pa55word@")
        (tmp_path / "key").write_text("t0ken-xyz\n")
        (tmp_path / "replica-key").write_text("replica-t0ken\n")
        values = per_run_values(pki, qwen3_dir, url, str(tmp_path / "key"), str(tmp_path / "replica-key"))
        names = list(router_command.FLAGS.flags)
        assert set(names) - {"verbose", *NOT_VARIED} <= set(values)
        as_env = {n for i, n in enumerate(names) if i % 2 and n in values}
        env = {
            router_command.FLAGS.flags[n].env: "true" if values[n][0] is None else values[n][0]
            for n in as_env
        }
        argv = [KVMESH, "router", *command_line({n: v for n, v in values.items() if n not in as_env}, names)]
        import os

        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
        )
        try:
            wait_for_line(proc, "kvmesh router:", timeout=60)
            with grpc.secure_channel(f"localhost:{values['port'][1]}", credentials(pki)) as channel:
                info = pb_grpc.RouterStub(channel).GetModelInfo(
                    pb.GetModelInfoRequest(), metadata=(("authorization", "Bearer t0ken-xyz"),), timeout=10
                )
        finally:
            stop(proc)
    config = json.loads(info.effective_config)
    for name, flag in router_command.FLAGS.flags.items():
        if name in values and name != "redis-url":
            for _, *path in flag.targets:
                assert lookup(config, path) == values[name][1], name
    assert config["redis_url"] == re.sub(":pa55word@", ":***@", url)
    assert "t0ken-xyz" not in info.effective_config and "pa55word" not in info.effective_config
