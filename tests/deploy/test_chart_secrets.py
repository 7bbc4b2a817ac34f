"""The chart's secrets and configuration: files by reference, stable renders, the hook job
that makes missing secrets once, one ConfigMap for every command, TLS and the token."""

import argparse
import os
import re

import yaml
from helm_chart import (
    CHART,
    DEFAULT,
    ROOT,
    SECRET_ENV,
    SECRET_WORDS,
    _agreed,
    _pre_stop,
    by_kind,
    config_map,
    flag,
    kvmesh_pods,
    merge,
    pods,
    render,
    secret_of,
    values_of,
)


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
    assert '--python /opt/venv/bin/python . "ray[default]==${RAY_VERSION}"' in text  # no extras
    runs = [
        block
        for block in text.split("FROM ")
        if block.startswith("${BASE} AS run-") or "AS run-cuda" in block
    ]
    assert "ARG BASE=python:3.11-slim-bookworm" in text  # a stand-in only where it is passed
    assert len(runs) == 2 and all("wget" in block for block in runs)
    # flash-attn comes as a prebuilt wheel, never compiled in the build
    assert "FLASH_ATTN_WHEEL" in text and "--no-build-isolation" not in text and ".[gpu]" not in text
