"""Child processes a kvmesh process starts beside itself (an embedded Redis, a vLLM server):
loopback ports picked before they bind, and children that die with their parent."""

from __future__ import annotations

import collections
import socket
import sys

# Ports this process handed out lately (bounded: a long sweep picks hundreds).
_GIVEN_PORTS: collections.deque[int] = collections.deque(maxlen=1024)


def free_port() -> int:
    """A loopback port free now that this process has not handed out lately: a port stays
    free until whoever got it binds it, so picks made before binding (a server's two ports,
    a Ray node's six) could otherwise get the same one from the kernel twice."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.append(port)
            return port


# A fresh single-threaded interpreter sets PR_SET_PDEATHSIG (kept across exec), then becomes
# the server. preexec_fn would run Python between fork and exec in a process full of gRPC and
# Ray threads, which can crash the child (seen: SIGSEGV restarting Redis under load).
_EXEC_DYING_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
os.execv(sys.argv[1], sys.argv[1:])
"""


def dying_with_parent(args: list[str]) -> list[str]:
    """``args`` run so that the kernel ends them when this process dies (Linux; as is elsewhere)."""
    if not sys.platform.startswith("linux"):
        return args
    return [sys.executable, "-S", "-c", _EXEC_DYING_WITH_PARENT, *args]
