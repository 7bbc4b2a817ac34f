"""A supervisor issues each replica its index user before starting it; Redis slow at that
moment delays the start instead of crashing the controller (seen in the chart's containers
under load: a connect timeout while issuing killed `kvmesh up`)."""

from types import SimpleNamespace

import pytest
from redis.exceptions import TimeoutError as RedisTimeout

from kvmesh.cluster import supervisor as supervisor_module
from kvmesh.cluster.supervisor import ReplicaStartError, Supervisor
from kvmesh.replica.config import ReplicaConfig


class SlowAdmin:
    """An admin Redis client whose first ``slow`` calls time out."""

    def __init__(self, slow: int):
        self.slow, self.calls = slow, []

    async def execute_command(self, *command):
        self.calls.append(command[:3])
        if len(self.calls) <= self.slow:
            raise RedisTimeout("Timeout connecting to server")
        return b"OK"


def supervisor_with(client, tmp_path) -> Supervisor:
    index = SimpleNamespace(client=client, digest="0123abcd")
    return Supervisor(ReplicaConfig(str(tmp_path)), 1, False, index)


async def test_a_slow_index_delays_issuing_a_replicas_user(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor_module, "ISSUE_ATTEMPTS", 4)
    client = SlowAdmin(slow=2)
    user, password = await supervisor_with(client, tmp_path)._issue_user("replica-0")
    assert user == "kvmesh-replica.0123abcd.replica-0" and password
    assert len(client.calls) == 3 and client.calls[-1] == ("ACL", "SETUSER", user)


async def test_an_index_that_never_answers_fails_the_start_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor_module, "ISSUE_ATTEMPTS", 2)
    with pytest.raises(
        ReplicaStartError, match="replica-0 failed to start: the index did not answer"
    ) as caught:
        await supervisor_with(SlowAdmin(slow=99), tmp_path)._issue_user("replica-0")
    assert "\n" not in str(caught.value)
