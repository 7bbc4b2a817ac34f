"""What the HTTP door (``serving/http_door.BoundedHttpProtocol``) costs a request, against
uvicorn's plain httptools protocol: one server process serves the same app through each on
its own port; this process sends keep-alive requests to one, then the other, in alternating
order for several rounds, and reads the server process's CPU time before and after each
batch (from the app itself). Reported per kind of request: each one's median CPU per
request (us), and the median of what the door added within a round (where both ran beside
the same other load).

    kvmesh bench http-door [--requests 2000] [--rounds 6] [--out FILE]
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import socket
import statistics
import time

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvmesh.bench.measure.common import environment, target, write_result
from kvmesh.serving.connections import ConnectionLimits
from kvmesh.serving.http_door import BoundedHttpProtocol
from kvmesh.serving.http_server import SecondTickServer

PROTOCOLS = {
    "plain": HttpToolsProtocol,
    "door": functools.partial(BoundedHttpProtocol, limits=ConnectionLimits()),
}
BODY = json.dumps({"prompt": "the cache block " * 60, "max_tokens": 16}).encode()  # ~1 KiB
KINDS = {
    "GET": b"GET /v1/models HTTP/1.1\r\nHost: b\r\nUser-Agent: bench\r\nAccept: */*\r\n\r\n",
    "POST 1 KiB": b"POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%b" % (len(BODY), BODY),
}


async def _app(scope, receive, send) -> None:
    """Reads the body; answers ``/cpu`` with this process's CPU seconds, anything else with ok."""
    while (await receive()).get("more_body"):
        pass
    body = repr(time.process_time()).encode() if scope["path"] == "/cpu" else b"ok"
    headers = [(b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _serve(ports: multiprocessing.connection.Connection) -> None:
    """Both protocols' servers, on 127.0.0.1; sends their ports, stops when told to."""

    async def main() -> None:
        servers, socks = [], {}
        for name, protocol in PROTOCOLS.items():
            config = uvicorn.Config(
                _app, host="127.0.0.1", port=0, http=protocol, log_level="warning", lifespan="off"
            )
            socks[name] = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            socks[name].bind(("127.0.0.1", 0))
            servers.append(SecondTickServer(config))
        serving = [
            asyncio.create_task(s.serve(sockets=[socks[n]])) for s, n in zip(servers, socks, strict=True)
        ]
        while not all(server.started for server in servers):
            await asyncio.sleep(0.01)
        ports.send({name: sock.getsockname()[1] for name, sock in socks.items()})
        await asyncio.get_running_loop().run_in_executor(None, ports.recv)  # until told to stop
        for server in servers:
            server.exit_now()
        await asyncio.gather(*serving)

    asyncio.run(main())


class _Client:
    """One keep-alive connection; each response is read whole (Content-Length framed)."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def request(self, raw: bytes) -> bytes:
        self.sock.sendall(raw)
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self.sock.recv(65536)
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += self.sock.recv(65536)
        self.buffer = rest[length:]
        return rest[:length]

    def server_cpu(self) -> float:
        return float(self.request(b"GET /cpu HTTP/1.1\r\nHost: b\r\n\r\n"))


def measure(requests: int, rounds: int) -> dict:
    """Median server CPU per request (us) of each protocol, per kind of request."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    server = context.Process(target=_serve, args=(theirs,), daemon=True)
    server.start()
    try:
        clients = {name: _Client(port) for name, port in ours.recv().items()}
        result = {}
        for kind, raw in KINDS.items():
            samples: dict[str, list[float]] = {name: [] for name in clients}
            for round_ in range(rounds):
                order = list(clients) if round_ % 2 == 0 else list(reversed(clients))
                for name in order:
                    client = clients[name]
                    before = client.server_cpu()
                    for _ in range(requests):
                        client.request(raw)
                    samples[name].append((client.server_cpu() - before) / requests * 1e6)
            added = [door - plain for plain, door in zip(samples["plain"], samples["door"], strict=True)]
            result[kind] = {name: round(statistics.median(s), 1) for name, s in samples.items()} | {
                "added_us": round(statistics.median(added), 1),  # within a round: the same load beside
                "rounds_us": {name: [round(x, 1) for x in s] for name, s in samples.items()},
            }
        return result
    finally:
        ours.send("stop")
        server.join(10)


# The door's server CPU a request over the plain protocol's, at most (a small GET; a 1 KiB POST
# is handed to the parser in two parts, head and body, and may cost a little more).
MAX_RATIO = {"GET": 1.25, "POST 1 KiB": 1.35}


def main(out: str, requests: int, rounds: int) -> int:
    kinds = measure(requests, rounds)
    result = {
        "benchmark": "http_door",
        "requests_per_batch": requests,
        "rounds": rounds,
        "environment": environment(),
        "kinds": kinds,
        "targets": [
            target(
                f"{kind}: server CPU a request, door / plain httptools (medians)",
                round(kinds[kind]["door"] / kinds[kind]["plain"], 3),
                "<=",
                bound,
            )
            for kind, bound in MAX_RATIO.items()
        ],
    }
    print(
        json.dumps({kind: {k: v for k, v in row.items() if k != "rounds_us"} for kind, row in kinds.items()})
    )
    write_result(out, result)
    return 0
