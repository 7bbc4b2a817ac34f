"""A local HTTP server in the Hugging Face hub's layout, for ``kvmesh download-model`` tests
(this machine cannot reach the hub). It answers what ``snapshot_download`` asks: the repo at
a revision (``/api/models/{repo}/revision/{rev}``), its file tree
(``/api/models/{repo}/tree/{rev}``) and each file (``/{repo}/resolve/{rev}/{path}``, HEAD
and GET, with the commit and ETag headers the client checks). Repos can require a bearer
token; a file can be made to fail, to test a download that breaks half way, and every file
can take a while (``delay_s``), to hold several downloads in flight at once."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Repo:
    revisions: dict[str, dict[str, bytes]]  # revision name -> {path: content}
    token: str | None = None  # the bearer token it requires, if private
    broken: set[str] = field(default_factory=set)  # paths whose download fails (with broken_status)
    # 500 is retried by huggingface_hub with backoff (about 23 s before it gives up); 403 is not
    broken_status: int = 500

    def commit(self, revision: str) -> str:
        files = self.revisions[revision]
        return hashlib.sha1(
            json.dumps(sorted((p, hashlib.sha1(c).hexdigest()) for p, c in files.items())).encode()
        ).hexdigest()

    def resolve(self, revision: str) -> dict[str, bytes] | None:
        if revision in self.revisions:
            return self.revisions[revision]
        return next((f for r, f in self.revisions.items() if self.commit(r) == revision), None)


def repo_from_folder(folder: Path, **kwargs) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[str] = []
        self.delay_s = 0.0  # before each file's content
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub.handle(self, body=False)

            def do_GET(self) -> None:
                hub.handle(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        self.requests.append(f"{h.command} {path}")
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
            repo, files = self._repo(h, m.group(1), m.group(2))
            if files is not None:
                info = {
                    "id": m.group(1),
                    "sha": repo.commit(self._name(repo, m.group(2))),
                    "siblings": [{"rfilename": p} for p in files],
                }
                self._send(h, 200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})
        elif m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path):
            repo, files = self._repo(h, m.group(1), m.group(2))
            if files is not None:
                tree = [
                    {"type": "file", "path": p, "size": len(c), "oid": hashlib.sha1(c).hexdigest()}
                    for p, c in files.items()
                ]
                self._send(h, 200, json.dumps(tree).encode(), body, {"Content-Type": "application/json"})
        elif m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, files = self._repo(h, m.group(1), m.group(2))
            if files is None:
                return
            name = m.group(3)
            if name not in files:
                self._send(h, 404, b"entry not found", body, {"X-Error-Code": "EntryNotFound"})
            elif name in repo.broken:
                self._send(h, repo.broken_status, b"storage backend failed", body)
            else:
                if body:
                    time.sleep(self.delay_s)
                content = files[name]
                headers = {
                    "X-Repo-Commit": repo.commit(self._name(repo, m.group(2))),
                    "ETag": f'"{hashlib.sha1(content).hexdigest()}"',
                    "Content-Type": "application/octet-stream",
                }
                self._send(h, 200, content, body, headers)
        else:
            self._send(h, 404, b"not found", body)

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str):
        repo = self.repos.get(repo_id)
        if repo is None:
            self._send(h, 404, b"Repository not found", True, {"X-Error-Code": "RepoNotFound"})
            return None, None
        if repo.token and h.headers.get("authorization") != f"Bearer {repo.token}":
            self._send(h, 401, b"Invalid credentials", True, {"X-Error-Code": "RepoNotFound"})
            return None, None
        files = repo.resolve(revision)
        if files is None:
            self._send(h, 404, b"Revision not found", True, {"X-Error-Code": "RevisionNotFound"})
        return repo, files

    @staticmethod
    def _name(repo: Repo, revision: str) -> str:
        return (
            revision
            if revision in repo.revisions
            else next(r for r in repo.revisions if repo.commit(r) == revision)
        )

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler, status: int, content: bytes, body: bool, headers: dict | None = None
    ) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(content)))
        h.end_headers()
        if body and h.command != "HEAD":
            h.wfile.write(content)
