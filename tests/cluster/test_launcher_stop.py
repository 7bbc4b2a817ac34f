"""``kvmesh up``'s stop never aborts half way (issue 48: a background task's error crashed
the stop, which left the generated password folder behind and Valkey running)."""

from pathlib import Path

from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.launcher import LocalCluster
from kvmesh.engine.config import EngineConfig
from kvmesh.replica.config import ReplicaConfig
from kvmesh.router.config import RouterConfig


class FailingPart:
    def __init__(self) -> None:
        self.stopped = False

    async def stop(self, *args, **kwargs) -> None:
        self.stopped = True
        raise RuntimeError("a background task died earlier")


async def test_a_part_that_fails_to_stop_does_not_keep_the_rest_or_the_secrets(tmp_path):
    engine = EngineConfig(num_kv_blocks=16, block_size=16)
    cluster = LocalCluster(
        ClusterConfig(RouterConfig(str(tmp_path), block_size=16), ReplicaConfig(str(tmp_path), engine=engine))
    )
    token_file, _ = cluster._secrets.new("replica-token")
    router, supervisor = FailingPart(), FailingPart()
    cluster.router = router
    cluster.supervisors["m"] = supervisor
    await cluster.stop(grace=0)
    assert router.stopped and supervisor.stopped
    assert cluster.secrets_folder is None and not Path(token_file).exists()
