"""The embedded server: starts on a free loopback port, restarts, and never outlives us."""

import collections
import socket
import subprocess
import sys
import time

import pytest
import redis

from kvmesh.cluster.embedded_redis import EmbeddedRedis, free_port
from kvmesh.serving import child_process

pytestmark = pytest.mark.servers  # starts Redis, Ray, servers or kvmesh processes


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_start_stop_restart_with_persistence_off():
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert (
            client.config_get("save")["save"] == "" and client.config_get("appendonly")["appendonly"] == "no"
        )
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        client.set("k", "v")
        server.stop()
        assert not port_open(server.port)
        server.start()  # same port, empty
        assert client.get("k") is None
        client.close()
    assert not port_open(server.port)


def test_server_dies_with_its_parent():
    code = (
        "from kvmesh.cluster.embedded_redis import EmbeddedRedis; import time, sys;"
        "s = EmbeddedRedis().start(); print(s.port, flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    port = int(parent.stdout.readline())
    assert port_open(port)
    parent.kill()  # SIGKILL: no atexit, no context manager
    parent.wait()
    deadline = time.monotonic() + 5
    while port_open(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not port_open(port)


def test_bad_binary_is_a_clear_error(tmp_path):
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: cannot start' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited at start: FATAL: cannot start"):
        EmbeddedRedis(binary=str(fake)).start()


def test_free_ports_picked_before_binding_are_never_the_same(monkeypatch):
    """The kernel may hand out a port again while whoever got it has not bound it yet."""
    offered = iter([41000, 41000, 41000, 41001])

    class Kernel:
        """A socket whose bind to port 0 gets the next scripted port (the fault: repeats)."""

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(child_process, "_GIVEN_PORTS", collections.deque(maxlen=8))
    monkeypatch.setattr(child_process.socket, "socket", Kernel)
    assert [free_port(), free_port()] == [41000, 41001]
