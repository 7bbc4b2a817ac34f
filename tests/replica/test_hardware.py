"""The hardware name in a replica's index record."""


def test_the_hardware_a_replica_reports_is_a_name_its_readers_accept(monkeypatch):
    """Readers skip a record whose hardware is not short printable ASCII: a GPU's own name
    must never make its replica invisible."""
    import torch

    from kvmesh.kvcache.index.redis import _NAME
    from kvmesh.replica.hardware import hardware_name

    monkeypatch.setattr(
        torch.cuda, "get_device_name", lambda device: "NVIDIA \uff28200\n" + "x" * 100
    )  # a full-width H
    name = hardware_name(torch.device("cuda", 0))
    assert name.startswith("NVIDIA ?200?") and len(name) == 64 and _NAME.fullmatch(name)
    assert hardware_name(torch.device("cpu")) == "cpu"
