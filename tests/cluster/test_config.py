"""Config defined once: flags and KVMESH_* environment defaults derived from the dataclasses,
one truth rule for booleans, secrets only from the environment, and ``kvmesh up``'s shared
flags reaching the router and the replicas alike. No servers here; the round trip through
running processes is ``test_config_roundtrip.py``."""

import argparse
import dataclasses
import json
import re
import subprocess

import pytest
from helpers import vllm_python

from kvmesh.cli.commands import router as router_command
from kvmesh.cli.commands import up as up_command
from kvmesh.cli.flags import FlagTable
from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.errors import UsageError
from kvmesh.engine.config import EngineConfig
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.vllm.launch import vllm_options
from kvmesh.replica.vllm.server import VllmServer
from kvmesh.router.config import RouterConfig
from kvmesh.serving.options import effective_config, parse_bool

TABLES = {"up": up_command.FLAGS, "router": router_command.FLAGS}


def build(table: FlagTable, *argv: str):
    parser = argparse.ArgumentParser(exit_on_error=False)
    table.add_to(parser)
    return table.build(parser.parse_args(argv))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests set exactly the KVMESH_* variables they mean (a developer's shell may have some)."""
    import os

    for name in [n for n in os.environ if n.startswith("KVMESH_")]:
        monkeypatch.delenv(name)


def test_every_field_of_every_config_is_declared_with_help():
    for config in (RouterConfig, ReplicaConfig, EngineConfig, ClusterConfig):
        for f in dataclasses.fields(config):
            assert f.metadata.get("help"), f"{config.__name__}.{f.name} has no help"
    assert len(TABLES["up"].flags) > 40 and "api-key-file" in TABLES["router"].flags


def test_flag_beats_environment_beats_default(monkeypatch, tmp_path):
    ((router,),) = [build(TABLES["router"], "--model", str(tmp_path))[:1]]
    assert router.port == 50051
    monkeypatch.setenv("KVMESH_PORT", "6001")
    assert build(TABLES["router"], "--model", str(tmp_path))[0].port == 6001
    assert build(TABLES["router"], "--model", str(tmp_path), "--port", "6002")[0].port == 6002


def test_required_flag_may_come_from_the_environment(monkeypatch, tmp_path):
    with pytest.raises(UsageError, match="--model is required \\(or set KVMESH_MODEL\\)"):
        build(TABLES["router"])
    monkeypatch.setenv("KVMESH_MODEL", str(tmp_path))
    assert build(TABLES["router"])[0].model_dir == str(tmp_path)


@pytest.mark.parametrize("text", ["1", "true", "YES", "on", " True "])
def test_one_truth_rule_true(text):
    assert parse_bool(text, "x") is True


@pytest.mark.parametrize("text", ["0", "false", "No", "off"])
def test_one_truth_rule_false(text):
    assert parse_bool(text, "x") is False


def test_a_bad_boolean_is_a_usage_error_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_TLS_CLIENT_AUTH", "maybe")
    with pytest.raises(UsageError, match="KVMESH_TLS_CLIENT_AUTH: --tls-client-auth must be one of"):
        build(TABLES["router"], "--model", str(tmp_path))
    monkeypatch.setenv("KVMESH_TLS_CLIENT_AUTH", "yes")
    monkeypatch.setenv("KVMESH_TLS_CA", "/ca.pem")
    assert build(TABLES["router"], "--model", str(tmp_path))[0].tls.client_auth is True


def test_zero_or_empty_means_unset_where_unset_exists(monkeypatch, tmp_path):
    """The chart writes KVMESH_MAX_MODEL_LEN=0 for "the model's own"; a port of 0 stays 0 (any port)."""
    monkeypatch.setenv("KVMESH_MAX_MODEL_LEN", "0")
    monkeypatch.setenv("KVMESH_MODEL_ID", "")
    monkeypatch.setenv("KVMESH_PORT", "0")
    config = build(TABLES["router"], "--model", str(tmp_path))[0]
    assert config.max_model_len is None and config.model_id is None and config.port == 0
    assert build(TABLES["router"], "--model", str(tmp_path), "--max-model-len", "0")[0].max_model_len is None


def test_bad_values_are_usage_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_MAX_INFLIGHT", "lots")
    with pytest.raises(UsageError, match="KVMESH_MAX_INFLIGHT: --max-inflight expects an integer"):
        build(TABLES["router"], "--model", str(tmp_path))
    monkeypatch.delenv("KVMESH_MAX_INFLIGHT")
    monkeypatch.setenv("KVMESH_POLICY", "fastest")
    with pytest.raises(UsageError, match="KVMESH_POLICY: --policy must be one of prefix, round_robin"):
        build(TABLES["router"], "--model", str(tmp_path))
    monkeypatch.delenv("KVMESH_POLICY")
    with pytest.raises(ValueError, match="policy 'fastest' is unknown"):  # the config checks too
        RouterConfig(str(tmp_path), policy="fastest")
    with pytest.raises(UsageError, match="max_inflight must be positive"):
        build(TABLES["router"], "--model", str(tmp_path), "--max-inflight", "-3")


def test_secrets_come_from_files_only_and_never_leave(monkeypatch, tmp_path):
    from kvmesh.cli.main import build_parser

    for flag in ("--api-key", "--auth-token"):  # a token on the command line shows in ps
        with pytest.raises(SystemExit) as refused:  # (nor is --api-key taken for --api-key-file)
            build_parser().parse_args(["router", "--model", str(tmp_path), flag, "x"])
        assert refused.value.code == 2
    monkeypatch.setenv("KVMESH_AUTH_TOKEN", "t0ken")  # nor is one read from the environment
    config = build(TABLES["router"], "--model", str(tmp_path), "--redis-url", "redis://u:pw@r:6379/0")[0]
    assert config.client_token() is None and config.replica_token() is None
    shown = json.dumps(effective_config(config))
    assert "pw" not in shown and "redis://u:***@r:6379/0" in shown
    (tmp_path / "key").write_text("from-file\n")
    (tmp_path / "replica-key").write_text("replica-secret\n")
    by_file = build(TABLES["router"], "--model", str(tmp_path), "--api-key-file", str(tmp_path / "key"))[0]
    assert by_file.client_token() == "from-file" == by_file.replica_token()  # presented to replicas too
    both = build(
        TABLES["router"],
        "--model",
        str(tmp_path),
        "--api-key-file",
        str(tmp_path / "key"),
        "--replica-api-key-file",
        str(tmp_path / "replica-key"),
    )[0]
    assert (both.client_token(), both.replica_token()) == ("from-file", "replica-secret")
    assert "from-file" not in json.dumps(effective_config(both))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"--api-key-file .* is empty"):
        RouterConfig(str(tmp_path), api_key_file=str(tmp_path / "empty")).client_token()
    with pytest.raises(ValueError, match="cannot read --replica-api-key-file"):
        RouterConfig(str(tmp_path), replica_api_key_file=str(tmp_path / "missing")).replica_token()


def test_up_shares_one_flag_between_the_router_and_every_replica(tmp_path):
    (config,) = build(
        TABLES["up"],
        "--model",
        str(tmp_path),
        "--block-size",
        "32",
        "--max-model-len",
        "900",
        "--model-id",
        "m",
        "--max-message-bytes",
        "2048",
        "--tls-ca",
        "/ca.pem",
        "--drain-timeout",
        "3",
    )
    router, replica = config.router, config.replica
    assert router.model_dir == replica.model_dir == str(tmp_path)
    assert router.block_size == replica.engine.block_size == 32
    assert router.max_model_len == replica.engine.max_model_len == 900
    assert router.model_id == replica.model_id == "m"
    assert router.tls.ca == replica.tls.ca == "/ca.pem"
    assert router.drain_timeout_s == replica.drain_timeout_s == 3.0
    assert router.max_message_bytes == 2048  # parsed, and kept (it used to be dropped on the way)


def test_up_defaults_match_kvmesh_router_and_block_size_is_auto(tmp_path, monkeypatch):
    (up,) = build(TABLES["up"], "--model", str(tmp_path))
    alone = build(TABLES["router"], "--model", str(tmp_path))[0]
    assert dataclasses.replace(up.router, deployment="default") == alone  # up's deployment is its own
    assert up.replica.engine.block_size is None and up.router.block_size is None  # the engine decides
    assert up.with_router and up.replicas == 2
    monkeypatch.setenv("KVMESH_BLOCK_SIZE", "auto")  # what the chart writes by default
    assert build(TABLES["up"], "--model", str(tmp_path))[0].router.block_size is None
    (told,) = build(TABLES["up"], "--model", str(tmp_path), "--block-size", "32")
    assert told.router.block_size == told.replica.engine.block_size == 32
    coded = ClusterConfig.for_model(str(tmp_path), router={"block_size": 64})
    assert coded.replica.engine.block_size == 64  # replicas follow a router told its block size


def test_router_and_replicas_that_disagree_are_refused(tmp_path):
    engine = EngineConfig(block_size=32)
    with pytest.raises(ValueError, match="disagree on block_size"):
        ClusterConfig(RouterConfig(str(tmp_path), block_size=16), ReplicaConfig(str(tmp_path), engine=engine))
    with pytest.raises(ValueError, match="disagree on redis_url"):
        ClusterConfig.for_model(str(tmp_path), router={"redis_url": "redis://a"})


def test_router_only_and_replica_only_flags_do_not_cross(tmp_path):
    (config,) = build(
        TABLES["up"], "--model", str(tmp_path), "--host", "10.0.0.1", "--replica-host", "0.0.0.0"
    )
    assert config.router.host == "10.0.0.1" and config.replica.host == "0.0.0.0"
    assert "policy" not in {f.name for f in dataclasses.fields(ReplicaConfig)}


def test_deployment_reaches_the_router_and_every_replica(tmp_path, monkeypatch):
    """``--deployment`` (or KVMESH_DEPLOYMENT) names the deployment for every part; alone, a
    router or replica is in ``default``; ``kvmesh up`` without one takes a fresh name per run,
    so two of them on one Redis never share the index's keys."""
    alone = build(TABLES["router"], "--model", str(tmp_path))[0]
    assert alone.deployment == "default" == ReplicaConfig(str(tmp_path)).deployment
    assert build(TABLES["router"], "--model", str(tmp_path), "--deployment", "ns.r")[0].deployment == "ns.r"
    (up,) = build(TABLES["up"], "--model", str(tmp_path), "--deployment", "team-a/llm_1.0")
    assert up.deployment == up.router.deployment == up.replica.deployment == "team-a/llm_1.0"
    first, second = (build(TABLES["up"], "--model", str(tmp_path))[0] for _ in range(2))
    for up in (first, second):
        assert re.fullmatch(r"up-[0-9a-f]{8}", up.deployment)
        assert up.router.deployment == up.replica.deployment == up.deployment
    assert first.deployment != second.deployment
    assert ClusterConfig.for_model(str(tmp_path)).replica.deployment == "default"  # tests, benchmarks
    with pytest.raises(UsageError, match="--keep-replicas needs --deployment"):  # it could never re-attach
        build(TABLES["up"], "--model", str(tmp_path), "--keep-replicas")
    monkeypatch.setenv("KVMESH_DEPLOYMENT", "from-env")
    with pytest.raises(UsageError, match="--replica-api-key-file"):  # a later router could not reach them
        build(TABLES["up"], "--model", str(tmp_path), "--keep-replicas")
    monkeypatch.setenv("KVMESH_REPLICA_API_KEY_FILE", str(tmp_path / "token"))
    (kept,) = build(TABLES["up"], "--model", str(tmp_path), "--keep-replicas")
    assert kept.router.replica_api_key_file == kept.replica.api_key_file == str(tmp_path / "token")
    assert kept.keep_replicas and kept.router.deployment == kept.replica.deployment == "from-env"


@pytest.mark.parametrize("name", ["", "two words", "x" * 129, "a:b", "naïve", "tab\t"])
def test_a_bad_deployment_is_a_usage_error(name, tmp_path):
    for table in TABLES.values():
        with pytest.raises(UsageError, match="deployment must be 1 to 128 characters of A-Z a-z 0-9"):
            build(table, "--model", str(tmp_path), "--deployment", name)
    with pytest.raises(ValueError, match="deployment must be"):
        ReplicaConfig(str(tmp_path), deployment=name)


def build_models(table: FlagTable, *argv: str):
    parser = argparse.ArgumentParser(exit_on_error=False)
    table.add_to(parser)
    return table.build_models(parser.parse_args(argv))


def test_up_takes_several_models_each_with_its_own_per_model_settings():
    built = build_models(
        TABLES["up"],
        "--model",
        "/models/qwen3,replicas=3,block-size=32,kv-cache-memory=1000000",
        "--model",
        "/models/llama,model-id=llama,served-model-name=chat,max-model-len=512",
        "--replicas",
        "2",
        "--num-kv-blocks",
        "64",
        "--policy",
        "round_robin",
    )
    qwen, llama = ClusterConfig.together([config for (config,) in built])
    assert (qwen.replicas, llama.replicas) == (3, 2)  # its own, else the command line's
    assert (qwen.router.block_size, qwen.replica.engine.block_size, llama.router.block_size) == (32, 32, None)
    assert (qwen.replica.engine.kv_cache_memory, llama.replica.engine.num_kv_blocks) == (1000000, 64)
    assert (llama.model_id, llama.router.api.served_model_name, llama.replica.engine.max_model_len) == (
        "llama",
        "chat",
        512,
    )
    assert qwen.router.policy == llama.router.policy == "round_robin"  # router-wide: the same
    assert qwen.deployment == llama.deployment == qwen.router.deployment == llama.replica.deployment


def test_the_models_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVMESH_MODEL", "/models/a,block-size=32;\n/models/b")
    built = build_models(TABLES["router"])
    assert [(router.model_dir, router.block_size) for router, _ in built] == [
        ("/models/a", 32),
        ("/models/b", None),
    ]
    assert len(build_models(TABLES["router"], "--model", "/models/c")) == 1  # the flag wins


@pytest.mark.parametrize(
    "specs, message",
    [
        (["/m/a,port=1"], "'port=1' is not KEY=VALUE with a per-model KEY"),  # router-wide
        (["/m/a,replicas"], "'replicas' is not KEY=VALUE"),
        (["/m/a,replicas=two"], "--model /m/a,replicas=two: --replicas expects an integer, got 'two'"),
        (["/m/a", "/m/a,replicas=1"], "a model folder is given twice"),
        ([",replicas=1"], "the model folder comes first"),
        (["/m/a,tokenizer-cache-mb=1,tokenizer-cache-bytes=2"], "tokenizer-cache-bytes is given twice"),
    ],
)
def test_a_bad_model_spec_is_a_usage_error_that_says_why(specs, message):
    argv = [arg for spec in specs for arg in ("--model", spec)]
    with pytest.raises(UsageError, match=re.escape(message)):
        build_models(TABLES["up"], *argv)


def test_two_models_with_one_id_are_refused():
    built = build_models(TABLES["up"], "--model", "/a/m", "--model", "/b/m")
    with pytest.raises(ValueError, match="two models have one id"):
        ClusterConfig.together([config for (config,) in built])
    with pytest.raises(UsageError, match="one --model here, got 2"):
        build(TABLES["up"], "--model", "/a/m", "--model", "/b/m")


def test_a_renamed_flag_still_reads_its_former_name_in_its_former_unit(monkeypatch, tmp_path, caplog):
    """Deployments that set --index-health-window-s or --tokenizer-cache-mb (flag, variable
    or per-model key) keep working, warned; both names at once are refused."""
    model = str(tmp_path)
    # fresh tables: a table warns about each former name once, and other tests use them too
    tables = {name: FlagTable(t.roots, t.several_models) for name, t in TABLES.items()}
    new = build(
        tables["router"], "--model", model, "--tokenizer-cache-bytes", "1000", "--index-trust-max-age", "9"
    )[0]
    assert (new.api.tokenizer_cache_bytes, new.index_trust.max_age_s) == (1000, 9.0)
    old = build(
        tables["router"], "--model", model, "--tokenizer-cache-mb", "8", "--index-health-window-s", "9"
    )[0]
    assert (old.api.tokenizer_cache_bytes, old.index_trust.max_age_s) == (8 << 20, 9.0)
    assert "--tokenizer-cache-mb is now --tokenizer-cache-bytes (its value times 1048576)" in caplog.text
    build(tables["router"], "--model", model, "--tokenizer-cache-mb", "8")
    assert caplog.text.count("--tokenizer-cache-mb is now") == 1  # once a process, not once a build
    assert "--index-health-window-s is now --index-trust-max-age;" in caplog.text
    with pytest.raises(UsageError, match="--index-trust-window and its former name --index-health-window"):
        build(tables["router"], "--model", model, "--index-trust-window", "5", "--index-health-window", "6")

    monkeypatch.setenv("KVMESH_TOKENIZER_CACHE_MB", "2")
    monkeypatch.setenv("KVMESH_INDEX_HEALTH_MIN_SAMPLES", "7")
    from_env = build(tables["router"], "--model", model)[0]
    assert (from_env.api.tokenizer_cache_bytes, from_env.index_trust.min_samples) == (2 << 20, 7)
    assert "KVMESH_TOKENIZER_CACHE_MB is now KVMESH_TOKENIZER_CACHE_BYTES" in caplog.text
    monkeypatch.setenv("KVMESH_TOKENIZER_CACHE_BYTES", "3")
    with pytest.raises(
        UsageError, match="KVMESH_TOKENIZER_CACHE_BYTES and its former name KVMESH_TOKENIZER_CACHE_MB"
    ):
        build(tables["router"], "--model", model)
    monkeypatch.delenv("KVMESH_TOKENIZER_CACHE_BYTES")
    monkeypatch.delenv("KVMESH_TOKENIZER_CACHE_MB")

    [(cluster,)] = build_models(tables["up"], "--model", "/models/a,tokenizer-cache-mb=4")
    assert cluster.router.api.tokenizer_cache_bytes == cluster.replica.api.tokenizer_cache_bytes == 4 << 20
    assert "tokenizer-cache-mb= is now tokenizer-cache-bytes=" in caplog.text


def test_a_former_name_is_read_but_not_shown(capsys):
    parser = argparse.ArgumentParser()
    TABLES["router"].add_to(parser)
    shown = parser.format_help()
    flat = " ".join(shown.split())  # argparse wraps the help
    assert "--tokenizer-cache-bytes" in flat and "formerly --tokenizer-cache-mb]" in flat
    assert "[--tokenizer-cache-mb" not in shown and "[--index-health-window" not in shown  # usage
    assert not re.search(r"^  --(tokenizer-cache-mb|index-health)", shown, re.M)  # an option of its own


def vllm_command(tmp_path, device: str, host_kv_gib: float | None) -> list[str]:
    config = ReplicaConfig(
        str(tmp_path), engine_kind="vllm", engine=EngineConfig(device=device, host_kv_gib=host_kv_gib)
    )
    return VllmServer(vllm_options(config, "m"), token=None).command()


def test_a_vllm_replicas_host_tier_is_vllms_own_offloading(tmp_path):
    """--host-kv-gib passes through as vLLM's --kv-offloading-size (native backend), with the
    self-describing events its CPU tier's view needs (vLLM's own parser takes them: below)."""
    command = vllm_command(tmp_path, "cuda", 4)
    at = command.index("--kv-offloading-size")
    assert command[at : at + 4] == ["--kv-offloading-size", "4", "--kv-offloading-backend", "native"]
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer == {"kv_connector_extra_config": {"self_describing_kv_events": True}}
    assert "--kv-offloading-size" not in vllm_command(tmp_path, "cuda", 0)
    default = vllm_command(tmp_path, "cuda", None)  # a GPU's default: a share of the node's memory
    assert float(default[default.index("--kv-offloading-size") + 1]) > 0
    assert "--kv-offloading-size" not in vllm_command(tmp_path, "cpu", None)
    with pytest.raises(ValueError, match=r"host_kv_gib: vLLM offloads KV to host memory only from a GPU"):
        vllm_command(tmp_path, "cpu", 4)


@pytest.mark.heavy  # imports vLLM (half a minute of CPU)
def test_vllms_own_parser_takes_the_offloading_flags(tmp_path):
    command = vllm_command(tmp_path, "cuda", 4)
    parse = (
        "import sys; from vllm.entrypoints.launchers.cli_args import make_arg_parser;"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser;"
        "a = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:]);"
        "print(a.kv_offloading_size, a.kv_offloading_backend, a.kv_transfer_config.kv_connector_extra_config)"
    )
    args = command[command.index("--model") :]
    out = subprocess.run([vllm_python(), "-c", parse, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "4.0 native {'self_describing_kv_events': True}"


def test_host_kv_gib_zero_is_off_not_the_default():
    """An optional number's 0 means unset (the chart's convention), except where 0 is a
    setting of its own: --host-kv-gib 0 turns the tier off, where unset may turn it on."""
    flag = TABLES["up"].flags["host-kv-gib"]
    assert (flag.parse("0"), flag.parse("2.5"), flag.parse(""), flag.parse("auto")) == (0, 2.5, None, None)
    assert TABLES["up"].flags["max-model-len"].parse("0") is None
