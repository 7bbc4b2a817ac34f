"""What a reviewer checks of the chart's pods: probes, drains, spread, resources, security
contexts, bounded volumes, GPUs, selectors; drains, disruption budgets and images."""

import yaml
from helm_chart import (
    CHART,
    ROOT,
    _pre_stop,
    _selects,
    by_kind,
    container,
    flag,
    kvmesh_pods,
    pods,
    render,
    values_of,
)


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
