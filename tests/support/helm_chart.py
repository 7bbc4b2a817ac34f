"""The Helm chart as the deploy tests read it: loading and rendering it (Helm's Go SDK),
the values files, and helpers that find pods, containers, flags, secrets and policies in a
render."""

import copy
import json
import re
from pathlib import Path

import kubernetes_validate
import yaml

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


def _selects(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
            return False
        if expr["operator"] not in ("In",):
            raise AssertionError(f"operator {expr['operator']} not modelled here")
    return True


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


def _pre_stop(c: dict) -> list[str]:
    return c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])


SECRET_ENV = {"KVMESH_REDIS_USERNAME", "KVMESH_REDIS_PASSWORD_FILE", "KVMESH_REDIS_CA"}


def _agreed(config) -> tuple:
    """What a router and a replica must agree on about their model (router or replica config)."""
    block_size = config.block_size if hasattr(config, "block_size") else config.engine.block_size
    max_model_len = config.max_model_len if hasattr(config, "max_model_len") else config.engine.max_model_len
    return (config.model_dir, config.model_id, block_size, max_model_len, config.api)


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


VALKEY_UNITS = {"mb": 2**20, "gb": 2**30, "m": 10**6, "g": 10**9}


KUBE_UNITS = {"Mi": 2**20, "Gi": 2**30, "M": 10**6, "G": 10**9}


def in_bytes(size: str, units: dict[str, int]) -> int:
    number, unit = re.fullmatch(r"([0-9]+)([A-Za-z]+)", size).groups()
    return int(number) * units[unit]


def kvmesh_pods(docs) -> dict[str, dict]:
    """The pods running kvmesh's serving processes: router, controller, Ray."""
    return {owner: spec for owner, _, spec in pods(docs) if not owner.endswith(("-valkey", "-make-secrets"))}


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
