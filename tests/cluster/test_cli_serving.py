"""``kvmesh up``, ``status``, ``router`` and ``demo`` as users run them."""

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvmesh.protos import pb, pb_grpc

pytestmark = pytest.mark.servers  # starts Redis, Ray, servers or kvmesh processes

KVMESH = str(Path(sys.executable).with_name("kvmesh"))


def run(*args, timeout=120, env=None):
    """``env``: variables added to this process's environment."""
    return subprocess.run(
        [KVMESH, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def bench_serve(run_file: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict, list[dict]]:
    """``kvmesh bench serve ARGS -q --out RUN_FILE``: the process, the run's meta line and records."""
    serve = run("bench", "serve", *args, "-q", "--out", str(run_file), timeout=300)
    assert serve.returncode == 0, serve.stderr[-2000:]
    lines = run_file.read_text().splitlines()
    return serve, json.loads(lines[0])["meta"], [json.loads(line) for line in lines[1:]]


def index_reader(up_output: str) -> dict[str, str]:
    """The environment that lets ``kvmesh status`` read the index of a ``kvmesh up`` (as its
    router's user), from the password-file folder it printed."""
    folder = re.search(r"password files redis-<role> in (\S+)", up_output).group(1)
    return {"KVMESH_REDIS_USERNAME": "kvmesh-router", "KVMESH_REDIS_PASSWORD_FILE": f"{folder}/redis-router"}


@pytest.mark.parametrize(
    "args",
    [
        ("up", "--model", "/nonexistent"),
        ("up", "--model", "{model}", "--policy", "fastest"),
        ("up", "--model", "{model}", "--replicas", "0"),
        ("up", "--model", "{model}", "--port", "70000"),
        ("router", "--model", "{model}"),
        ("status", "--redis-url", "redis://127.0.0.1:1"),
    ],
    ids=["no-model", "bad-policy", "zero-replicas", "bad-port", "router-needs-redis", "redis-unreachable"],
)
def test_serving_commands_reject_bad_input_in_one_line(args, qwen3_dir):
    out = run(*[a.format(model=qwen3_dir) for a in args])
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in out.stderr


@pytest.mark.heavy  # a whole deployment (kvmesh up, or the demo's) as local processes
def test_up_serves_reports_status_and_stops_on_sigint(qwen3_dir, tmp_path):
    proc = subprocess.Popen(
        [
            KVMESH,
            "up",
            "--model",
            str(qwen3_dir),
            "--replicas",
            "2",
            "--port",
            "0",
            "--http-port",
            "-1",
            "--num-kv-blocks",
            "128",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C" in line:
                break
        text = "".join(lines)
        assert "Ctrl-C" in text, text + proc.stderr.read() if proc.poll() is not None else text
        address = re.search(r"router gRPC\s+(\S+)", text).group(1)
        redis_url = re.search(r"redis\s+(\S+)", text).group(1)
        assert "replica-0 serving at" in text and "replica-1 serving at" in text  # progress while loading

        with grpc.insecure_channel(address) as channel:
            request = pb.GenerateRequest(
                text="the cache", sampling=pb.SamplingParams(temperature=0, max_tokens=3)
            )
            responses = list(pb_grpc.RouterStub(channel).Generate(request, timeout=60))
        assert responses[-1].complete.usage.completion_tokens <= 3

        refused = run("status", "--redis-url", redis_url)  # the embedded index has no anonymous user
        assert refused.returncode == 2 and "Authentication required" in refused.stderr
        folder = re.search(r"password files redis-<role> in (\S+)", text).group(1)
        reader = {
            "KVMESH_REDIS_USERNAME": "kvmesh-router",
            "KVMESH_REDIS_PASSWORD_FILE": f"{folder}/redis-router",
        }
        status = run("status", "--redis-url", redis_url, env=reader)
        assert status.returncode == 0, status.stderr
        assert (
            "replicas live: 2" in status.stdout
            and "replica-0" in status.stdout
            and "replica-1" in status.stdout
        )
        via_router = run("status", "--address", address, "--json")  # the default reads a router
        assert via_router.returncode == 0, via_router.stderr
        (model,) = json.loads(via_router.stdout)
        assert model["router"] == address and len(model["replicas"]) == 2
        assert {s["state"] for s in model["controller"].values()} == {"ready"}
        nobody = run("status", "--address", "127.0.0.1:1")
        assert nobody.returncode == 2 and "cannot read the router at 127.0.0.1:1" in nobody.stderr

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "draining" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.heavy  # a whole deployment (kvmesh up, or the demo's) as local processes
def test_up_serves_two_models_of_two_architectures_behind_one_router(qwen3_dir, tmp_path):
    """Issue 31's done-when: a tiny Qwen3 and a tiny Llama with a tokenizer of its own, one
    replica each, one router: each request lands on its model's replica, a prefix shared in
    text never crosses models, /v1/models, the metrics and ``kvmesh status`` show both."""
    import httpx
    from conftest import tiny_model_dir

    llama_dir = tiny_model_dir("llama", vocab_size=640, seed=1)
    err = tmp_path / "stderr"
    proc = subprocess.Popen(
        [
            KVMESH,
            "up",
            "--model",
            f"{qwen3_dir},replicas=1",
            "--model",
            f"{llama_dir},model-id=llama,replicas=1,num-kv-blocks=48",
            "--port",
            "0",
            "--http-port",
            "0",
            "--num-kv-blocks",
            "96",
        ],
        stdout=subprocess.PIPE,
        stderr=err.open("w"),
        text=True,
    )
    try:
        text = wait_for_ctrl_c(proc, err)
        assert f"1 replicas of {qwen3_dir}" in text and f"1 replicas of {llama_dir}" in text
        assert "qwen3-0 serving at" in text and "llama-0 serving at" in text
        address = re.search(r"router gRPC\s+(\S+)", text).group(1)
        http_url = re.search(r"router HTTP\s+(\S+)/v1", text).group(1)
        cards = httpx.get(f"{http_url}/v1/models", timeout=30).json()["data"]
        assert sorted(c["id"] for c in cards) == ["llama", "qwen3"]

        shared = "one system prompt sent to both models, word for word, " * 4

        def generate(model: str) -> pb.Complete:
            request = pb.GenerateRequest(
                text=shared, model=model, sampling=pb.SamplingParams(temperature=0, max_tokens=2)
            )
            with grpc.insecure_channel(address) as channel:
                return list(pb_grpc.RouterStub(channel).Generate(request, timeout=60))[-1].complete

        first, again, llama = generate("qwen3"), generate("qwen3"), generate("llama")
        assert (first.replica_id, again.replica_id, llama.replica_id) == ("qwen3-0", "qwen3-0", "llama-0")
        assert again.usage.cached_tokens > 0  # qwen3's replica holds the prefix now
        assert llama.usage.cached_tokens == 0 and llama.predicted_cached_tokens == 0  # never crosses
        tokens = {
            m: httpx.post(f"{http_url}/tokenize", json={"model": m, "prompt": shared}, timeout=30).json()[
                "tokens"
            ]
            for m in ("qwen3", "llama")
        }
        assert tokens["qwen3"] != tokens["llama"]  # two tokenizers
        metrics = httpx.get(f"{http_url}/metrics", timeout=30).text
        assert 'kvmesh_router_routing_decisions_total{model_name="qwen3",replica="qwen3-0"} 2.0' in metrics
        assert 'kvmesh_router_routing_decisions_total{model_name="llama",replica="llama-0"} 1.0' in metrics

        status = run("status", "--address", address, "--json")
        assert status.returncode == 0, status.stderr
        assert {
            m["model_id"]: [r["replica_id"] for r in m["replicas"]] for m in json.loads(status.stdout)
        } == {
            "qwen3": ["qwen3-0"],
            "llama": ["llama-0"],
        }
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.heavy  # a whole deployment (kvmesh up, or the demo's) as local processes
async def test_demo_runs_and_writes_results(ray_cluster, tmp_path):
    from kvmesh.bench import demo

    results = await demo.run(
        tmp_path,
        replicas=2,
        cache_dir=Path(__file__).resolve().parents[2] / ".cache" / "tiny-models",
        verbose=False,
    )
    written = json.loads((tmp_path / "demo.json").read_text())
    assert set(written) >= {"round_robin", "prefix", "elapsed_s"}
    for policy in ("round_robin", "prefix"):
        summary = written[policy]["summary"]
        assert summary["errors"] == 0 and summary["requests"] == 64
        assert sum(summary["requests_per_replica"].values()) == 64
    assert results["prefix"]["summary"]["hit_rate"] > results["round_robin"]["summary"]["hit_rate"]
    assert (tmp_path / "demo.png").stat().st_size > 10_000


@pytest.mark.bench  # a benchmark command end to end: make test-bench
def test_bench_serve_then_report(qwen3_dir, tmp_path):
    run_file = tmp_path / "run.jsonl"
    flags = (
        "--replicas 2 --workload shared_prefix --num-groups 2 --prompts-per-group 4 --system-prompt-len 64"
    )
    more = "--question-len 8 --output-len 4 --rate 20 --policy prefix"
    _, meta, records = bench_serve(run_file, "--model", str(qwen3_dir), *flags.split(), *more.split())
    assert meta["workload"] == "shared_prefix" and meta["policy"] == "prefix" and len(records) == 8
    assert all(r["error"] is None and r["completion_tokens"] == 4 and r["replica_id"] for r in records)
    assert all(r["first_token_s"] >= r["sent_s"] and r["router_decision_us"] > 0 for r in records)
    assert sum(r["cached_tokens"] for r in records) > 0

    out_dir = tmp_path / "report"
    rep = run("report", str(run_file), "--out-dir", str(out_dir), "--slo-ttft-ms", "5000")
    assert rep.returncode == 0, rep.stderr
    table = (out_dir / "report.md").read_text()
    assert "shared_prefix / prefix @ 20.0/s" in table and "hit rate" in table
    assert (out_dir / "policies.png").is_file() and (out_dir / "run-load.png").is_file()
    missing = run("report", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "no such run file" in missing.stderr


@pytest.mark.bench  # a benchmark command end to end: make test-bench
def test_bench_serve_runs_a_mix_of_models_and_reports_each(qwen3_dir, llama_dir, tmp_path):
    """Two models on one local cluster, 3:1 of the arrivals, each its own workload: every
    request names its model and lands on that model's replica; the summary is per model too."""
    run_file = tmp_path / "mix.jsonl"
    models = [
        "--model",
        f"{qwen3_dir},share=3,replicas=1",
        "--model",
        f"{llama_dir},share=1,replicas=1,workload=no_sharing",
    ]
    flags = (
        "--workload shared_prefix --num-groups 2 --prompts-per-group 4 --system-prompt-len 64 --output-len 4"
    )
    serve, meta, records = bench_serve(run_file, *models, *flags.split(), "--requests", "6", "--rate", "8")
    assert [(m["name"], m["share"]) for m in meta["models"]] == [("qwen3", 0.75), ("llama", 0.25)]
    assert meta["workload"] == "shared_prefix+no_sharing" and set(meta["hit_rate_ceiling"]) == {
        "qwen3",
        "llama",
    }
    assert sorted(collections.Counter(r["model"] for r in records).items()) == [("llama", 6), ("qwen3", 6)]
    assert all(r["error"] is None and r["replica_id"] == f"{r['model']}-0" for r in records)
    summary = json.loads(serve.stdout[: serve.stdout.index("\nwrote")])
    assert (
        summary["all"]["requests"] == 12 and summary["qwen3"]["requests"] == summary["llama"]["requests"] == 6
    )


@pytest.mark.heavy  # a whole deployment (kvmesh up, or the demo's) as local processes
def test_up_without_router_is_the_charts_controller(qwen3_dir):
    proc = subprocess.Popen(
        [KVMESH, "up", "--no-router", "--model", str(qwen3_dir), "--replicas", "1", "--num-kv-blocks", "64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        text = ""
        deadline = time.monotonic() + 180
        while "Ctrl-C" not in text and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            text += line
        assert "Ctrl-C" in text and "router gRPC" not in text, text
        redis_url = re.search(r"redis\s+(\S+)", text).group(1)
        status = run("status", "--redis-url", redis_url, env=index_reader(text))
        assert "replicas live: 1" in status.stdout
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_replicas_listening_everywhere_advertise_their_node_ip(ray_cluster):
    from kvmesh.replica.config import ReplicaConfig
    from kvmesh.replica.process import advertised_host

    assert advertised_host(ReplicaConfig("m", "r", "redis://x", host="127.0.0.1")) == "127.0.0.1"
    assert (
        advertised_host(ReplicaConfig("m", "r", "redis://x", host="0.0.0.0", advertise_host="10.1.2.3"))
        == "10.1.2.3"
    )
    node_ip = advertised_host(ReplicaConfig("m", "r", "redis://x", host="0.0.0.0"))
    assert node_ip == ray_cluster.util.get_node_ip_address() and node_ip != "0.0.0.0"


def test_a_taken_port_is_one_line_not_a_traceback(qwen3_dir, valkey_server):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags in (["--port", str(port)], ["--port", "0", "--http-port", str(port)]):
            out = run("router", "--model", str(qwen3_dir), "--redis-url", valkey_server.url, *flags)
            lines = out.stderr.strip().splitlines()
            assert (
                out.returncode == 2 and len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0]
            ), out.stderr


@pytest.mark.heavy  # a whole deployment (kvmesh up, or the demo's) as local processes
def test_a_replica_that_cannot_start_is_one_line_and_up_prints_progress(qwen3_dir, tmp_path):
    import shutil

    odd = tmp_path / "gpt2-ish"
    shutil.copytree(qwen3_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(
        json.dumps({**config, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    out = run("up", "--model", str(odd), "--replicas", "1", "--port", "0", "--http-port", "-1", timeout=180)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[-1].startswith("kvmesh: error: replica-0 failed to start:"), (
        out.stderr[-2000:]
    )
    assert "Traceback" not in out.stderr
    assert "starting 1 replica(s)" in out.stdout  # progress before the failure


SHARED_PREFIX = "You are a careful assistant. Answer briefly and cite the cache. " * 3


@pytest.mark.heavy  # a whole deployment (kvmesh up, or the demo's) as local processes
def test_two_ups_of_one_model_on_one_redis_never_collide(qwen3_dir, tmp_path):
    """Issue 25: two ``kvmesh up`` of the same model on one external Redis, each with its
    replica (``replica-0`` in both) and its router. Each router lists only its own replica,
    under an incarnation that stays (one deployment no longer retires the other's), serves
    a shared prefix and trusts the index (EXACT); ``kvmesh status`` lists both deployments."""
    from kvmesh.cluster.embedded_redis import EmbeddedRedis

    with EmbeddedRedis() as redis:
        ups = {}
        for name in ("a", "b"):  # both load at once
            ups[name] = subprocess.Popen(
                [
                    KVMESH,
                    "up",
                    "--model",
                    str(qwen3_dir),
                    "--redis-url",
                    redis.url,
                    "--replicas",
                    "1",
                    "--port",
                    "0",
                    "--http-port",
                    "-1",
                    "--replica-http-port",
                    "-1",
                    "--num-kv-blocks",
                    "64",
                    "--torch-threads",
                    "1",
                ],
                stdout=subprocess.PIPE,
                stderr=(tmp_path / f"{name}.err").open("w"),
                text=True,
            )
        try:
            seen = {}
            for name, proc in ups.items():
                text = wait_for_ctrl_c(proc, tmp_path / f"{name}.err")
                seen[name] = {
                    "router": re.search(r"router gRPC\s+(\S+)", text).group(1),
                    "replica": re.search(r"replica-0 serving at (\S+)", text).group(1),
                    "deployment": re.search(r"deployment\s+(\S+)", text).group(1),
                }
            a, b = seen["a"], seen["b"]
            assert re.fullmatch(r"up-[0-9a-f]{8}", a["deployment"]) and a["deployment"] != b["deployment"]
            assert a["replica"] != b["replica"]

            channels = {name: grpc.insecure_channel(s["router"]) for name, s in seen.items()}
            stubs = {name: pb_grpc.RouterStub(channel) for name, channel in channels.items()}
            started = time.monotonic()
            first = {
                name: stub.ListReplicas(pb.ListReplicasRequest(), timeout=10) for name, stub in stubs.items()
            }
            for i in range(4):  # one shared prefix: predicted hits, checked against each replica's answer
                for stub in stubs.values():
                    request = pb.GenerateRequest(
                        text=f"{SHARED_PREFIX} question {i}",
                        sampling=pb.SamplingParams(temperature=0, max_tokens=2),
                    )
                    complete = list(stub.Generate(request, timeout=60))[-1].complete
                    assert complete.replica_id == "replica-0" and complete.usage.completion_tokens <= 2
            time.sleep(max(0.0, 3.0 - (time.monotonic() - started)))  # a few heartbeats: a collision shows
            for name, stub in stubs.items():
                listing = stub.ListReplicas(pb.ListReplicasRequest(), timeout=10)
                (replica,) = listing.replicas
                assert replica.address == seen[name]["replica"], (name, listing)  # its own, not the other's
                kept = first[name].replicas[0].incarnation
                assert replica.incarnation == kept, (name, listing)  # never retired by the other deployment
                assert (listing.index_state, replica.index_state) == ("EXACT", "EXACT"), (name, listing)
                info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
                assert json.loads(info.effective_config)["deployment"] == seen[name]["deployment"]
            for channel in channels.values():
                channel.close()

            status = run("status", "--redis-url", redis.url, "--json")
            assert status.returncode == 0, status.stderr
            models = json.loads(status.stdout)
            assert {m["deployment"]: [r["address"] for r in m["replicas"]] for m in models} == {
                a["deployment"]: [a["replica"]],
                b["deployment"]: [b["replica"]],
            }
            assert {m["model_id"] for m in models} == {qwen3_dir.name}
        finally:
            for proc in ups.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            for proc in ups.values():
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


def wait_for_ctrl_c(proc: subprocess.Popen, err: Path, timeout: float = 240) -> str:
    """``kvmesh up``'s output until its banner ends (or it exits)."""
    text, deadline = "", time.monotonic() + timeout
    while "Ctrl-C" not in text and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        text += line
    assert "Ctrl-C" in text, text + err.read_text()
    return text


def test_a_router_whose_settings_differ_from_the_index_refuses_to_start_in_one_line(qwen3_dir, valkey_server):
    """Issue 48: the index's stored settings are authoritative; a router configured otherwise
    says so in one line (exit 2) instead of a traceback, and never overwrites them."""
    import asyncio

    from kvmesh.kvcache import namespace_seed
    from kvmesh.kvcache.index.redis import RedisPrefixIndex

    model_id = Path(qwen3_dir).name

    async def store_then_read(index: RedisPrefixIndex):
        await index.ensure_settings()
        return await index.settings()

    stored = RedisPrefixIndex.from_url(
        valkey_server.url, model_id, 16, namespace_seed(model_id, 16), "settled"
    )
    before = asyncio.run(store_then_read(stored))
    out = run(
        "router",
        "--model",
        str(qwen3_dir),
        "--redis-url",
        valkey_server.url,
        "--deployment",
        "settled",
        "--block-size",
        "32",
        "--port",
        "0",
        "--http-port",
        "-1",
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    [line] = out.stderr.strip().splitlines()[-1:]
    assert "settings differ" in line and "block_size" in line and "Traceback" not in out.stderr
    again = RedisPrefixIndex.from_url(
        valkey_server.url, model_id, 16, namespace_seed(model_id, 16), "settled"
    )
    assert asyncio.run(store_then_read(again)) == before
