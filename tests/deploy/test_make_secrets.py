"""``kvmesh make-secrets`` (the chart's hook Job) against a stand-in Kubernetes API: a real
HTTP(S) server on 127.0.0.1 speaking the REST layout of Secrets (``GET`` one, ``POST`` to the
collection) and checking the bearer token. It creates what is missing with random values,
never changes what exists, takes a 409 as "someone else made it", and refuses bad input in
one line."""

import base64
import json
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from certs import CertificateAuthority

from kvmesh.cli.main import main

BIN = Path(sys.executable).parent
TOKEN = "service-account-token"


class FakeKube:
    """Secrets by (namespace, name); every request logged as (method, path)."""

    def __init__(self, tls: tuple[str, str] | None = None):
        self.secrets: dict[tuple[str, str], dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.racing: dict[tuple[str, str], dict] = {}  # created by "someone else" between GET and POST
        self.refuse: int | None = None  # answer every request with this status
        kube = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _route(self) -> tuple[str, str | None] | None:
                parts = self.path.strip("/").split("/")
                if (
                    parts[:3] != ["api", "v1", "namespaces"]
                    or len(parts) not in (5, 6)
                    or parts[4] != "secrets"
                ):
                    return None
                return parts[3], (parts[5] if len(parts) == 6 else None)

            def _allowed(self) -> bool:
                kube.requests.append((self.command, self.path))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._reply(401, {"kind": "Status", "message": "Unauthorized", "code": 401})
                    return False
                if kube.refuse:
                    self._reply(
                        kube.refuse, {"kind": "Status", "message": "secrets is forbidden: no", "code": 403}
                    )
                    return False
                return True

            def do_GET(self):
                if not self._allowed():
                    return
                route = self._route()
                if route is None or route[1] is None:
                    return self._reply(404, {"kind": "Status", "code": 404})
                secret = kube.secrets.get(route)
                if secret is None:
                    return self._reply(404, {"kind": "Status", "reason": "NotFound", "code": 404})
                self._reply(200, secret)

            def do_POST(self):
                if not self._allowed():
                    return
                route = self._route()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if route is None or route[1] is not None or body["metadata"]["namespace"] != route[0]:
                    return self._reply(400, {"kind": "Status", "code": 400})
                key = (route[0], body["metadata"]["name"])
                if key in kube.racing:
                    kube.secrets[key] = kube.racing.pop(key)
                if key in kube.secrets:
                    return self._reply(409, {"kind": "Status", "reason": "AlreadyExists", "code": 409})
                kube.secrets[key] = body
                self._reply(201, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def values(self, namespace: str, name: str) -> dict[str, str]:
        data = self.secrets[(namespace, name)]["data"]
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    def put(self, namespace: str, name: str, values: dict[str, str]) -> None:
        data = {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}
        self.secrets[(namespace, name)] = {"metadata": {"name": name, "namespace": namespace}, "data": data}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def kube():
    server = FakeKube()
    yield server
    server.close()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def make(kube, token_file, *specs, extra=()):
    argv = [
        "make-secrets",
        "--api-server",
        kube.url,
        "--token-file",
        str(token_file),
        "--namespace",
        "serving",
    ]
    return main([*argv, *extra, *specs])


@pytest.mark.servers
def test_creates_missing_secrets_with_random_values(kube, token_file, capsys):
    labels = ["--label", "app.kubernetes.io/instance=llm", "--label", "app.kubernetes.io/name=kvmesh"]
    assert make(kube, token_file, "llm-redis=admin,router,replica", "llm-ray=auth_token", extra=labels) == 0
    redis, ray = kube.values("serving", "llm-redis"), kube.values("serving", "llm-ray")
    assert set(redis) == {"admin", "router", "replica"} and set(ray) == {"auth_token"}
    values = [*redis.values(), *ray.values()]
    assert len(set(values)) == 4 and all(len(v) >= 43 and v.strip() == v and " " not in v for v in values)
    created = kube.secrets[("serving", "llm-redis")]
    assert created["type"] == "Opaque" and created["metadata"]["labels"] == {
        "app.kubernetes.io/instance": "llm",
        "app.kubernetes.io/name": "kvmesh",
    }
    out = capsys.readouterr().out
    assert "serving/llm-redis: created" in out and not any(v in out for v in values)  # names, never values
    assert ("POST", "/api/v1/namespaces/serving/secrets") in kube.requests


@pytest.mark.servers
def test_existing_secrets_are_kept_as_they_are(kube, token_file, capsys):
    kube.put("serving", "llm-ray", {"auth_token": "the-users-own", "extra": "x"})
    assert make(kube, token_file, "llm-ray=auth_token", "llm-replica=token") == 0
    assert kube.values("serving", "llm-ray") == {"auth_token": "the-users-own", "extra": "x"}
    assert [m for m, p in kube.requests if p.endswith("/llm-ray") or m == "POST"] == ["GET", "POST"]
    assert "serving/llm-ray: kept" in capsys.readouterr().out
    # again, as a later upgrade's hook: nothing changes, nothing is posted
    before = {k: dict(v) for k, v in kube.secrets.items()}
    kube.requests.clear()
    assert make(kube, token_file, "llm-ray=auth_token", "llm-replica=token") == 0
    assert kube.secrets == before and all(m == "GET" for m, _ in kube.requests)


@pytest.mark.servers
def test_a_secret_created_meanwhile_is_kept(kube, token_file, capsys):
    """GET says 404, another writer creates it, POST says 409: theirs stays, and this run succeeds."""
    other = {"token": "created-by-the-other-job"}
    kube.racing[("serving", "llm-replica")] = {
        "metadata": {"name": "llm-replica"},
        "data": {"token": base64.b64encode(other["token"].encode()).decode()},
    }
    assert make(kube, token_file, "llm-replica=token") == 0
    assert kube.values("serving", "llm-replica") == other
    assert [m for m, _ in kube.requests] == ["GET", "POST", "GET"]
    assert "kept" in capsys.readouterr().out


@pytest.mark.servers
def test_an_existing_secret_without_a_key_fails_and_is_not_changed(kube, token_file, capsys):
    kube.put("serving", "llm-redis", {"admin": "a", "router": "r"})
    assert make(kube, token_file, "llm-redis=admin,router,replica") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llm-redis" in err and "replica" in err
    assert kube.values("serving", "llm-redis") == {"admin": "a", "router": "r"}


@pytest.mark.servers
def test_api_refusals_are_one_line(kube, token_file, tmp_path, capsys):
    kube.refuse = 403
    assert make(kube, token_file, "llm-ray=auth_token") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HTTP 403" in err and "forbidden" in err
    kube.refuse = None
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    assert make(kube, wrong, "llm-ray=auth_token") == 1
    assert "HTTP 401" in capsys.readouterr().err and not kube.secrets


@pytest.mark.servers
def test_https_with_the_service_accounts_ca(tmp_path, token_file):
    ca = CertificateAuthority(tmp_path)
    server = FakeKube(tls=ca.issue("kube-apiserver", ips=["127.0.0.1"]))
    try:
        argv = [
            "make-secrets",
            "--api-server",
            server.url,
            "--token-file",
            str(token_file),
            "--namespace",
            "ns",
        ]
        assert main([*argv, "--ca-file", ca.path, "s=k"]) == 0
        assert set(server.values("ns", "s")) == {"k"}
        (tmp_path / "other").mkdir()
        other = CertificateAuthority(tmp_path / "other")
        assert main([*argv, "--ca-file", other.path, "t=k"]) == 1  # a server the CA did not sign
        assert ("ns", "t") not in server.secrets
    finally:
        server.close()


BAD = [
    (["llm-ray"], "expected NAME=KEY"),
    (["llm-ray="], "no empty key"),
    (["llm-ray=a,,b"], "no empty key"),
    (["Bad_Name=token"], "not a DNS subdomain"),
    (["llm-ray=to ken"], "not a valid Secret key"),
    (["llm-ray=a,a"], "named twice"),
    (["s=a", "s=b"], "named twice"),
    (["--label", "no-value", "s=a"], "label"),
    (["--namespace", "Serving", "s=a"], "namespace"),
    (["--api-server", "ftp://x", "s=a"], "expected https://"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_input_is_refused_in_one_line(args, message, tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    argv = ["make-secrets", "--token-file", str(token)]
    if "--api-server" not in args:
        argv += ["--api-server", "http://127.0.0.1:9"]  # never reached
    if "--namespace" not in args:
        argv += ["--namespace", "serving"]
    assert main([*argv, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvmesh: error:") and message in err, err


@pytest.mark.servers  # runs the kvmesh command as a process
def test_a_missing_token_file_is_one_line_and_exit_2(tmp_path):
    """As the Job's pod would run it: the real entry point, no traceback."""
    argv = [
        str(BIN / "kvmesh"),
        "make-secrets",
        "--api-server",
        "http://127.0.0.1:9",
        "--namespace",
        "serving",
    ]
    done = subprocess.run(
        [*argv, "--token-file", str(tmp_path / "absent"), "llm-ray=auth_token"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "absent" in done.stderr and "Traceback" not in done.stderr
    # outside a pod, with nothing given: no API server, one line
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [str(BIN / "kvmesh"), "make-secrets", "s=a"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "KUBERNETES_SERVICE_HOST" in done.stderr
