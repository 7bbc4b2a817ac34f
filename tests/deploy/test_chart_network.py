"""Who reaches which port: the chart's NetworkPolicies, checked rule by rule."""

from helm_chart import (
    CHART,
    SCRAPER,
    _selects,
    by_kind,
    container,
    flag,
    pods,
    reachable,
    render,
    values_of,
)


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
