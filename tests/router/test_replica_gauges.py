"""The router's per-replica series read at each scrape: the info series the dashboard groups
replicas by (engine, hardware), bounded to known engines whatever a record holds."""

from kvmesh.router.metrics import ReplicaGauges, RouterMetrics
from kvmesh.serving.metrics import read_samples


def test_each_live_replica_has_one_info_series_by_engine_and_hardware():
    metrics = RouterMetrics("m")
    rows = [
        ReplicaGauges("a", 0, 0, 0, 0, 0, 0, engine="vllm", hardware="cpu/vllm"),
        ReplicaGauges("b", 0, 0, 0, 0, 0, 0, hardware="H200"),
    ]
    metrics.watch_replicas(lambda: rows, lambda: True)
    info = {
        labels: value
        for (name, labels), value in read_samples(metrics.render().decode()).items()
        if name == "kvmesh_router_replica_info"
    }
    assert info == {
        (("engine", "vllm"), ("hardware", "cpu/vllm"), ("replica", "a")): 1,
        (("engine", "kvmesh"), ("hardware", "H200"), ("replica", "b")): 1,
    }
    rows.pop()  # a replica gone is gone from the page at the next scrape
    assert (
        sum(1 for n, _ in read_samples(metrics.render().decode()) if n == "kvmesh_router_replica_info") == 1
    )


def test_an_engine_outside_the_known_kinds_is_labelled_other():
    from kvmesh.router.metrics import engine_label

    assert [engine_label(e) for e in ("vllm", "kvmesh", "", None, "x" * 64)] == [
        "vllm",
        "kvmesh",
        "kvmesh",
        "kvmesh",
        "other",
    ]
