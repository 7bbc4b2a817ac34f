"""Secrets that stay put: create each missing Kubernetes Secret once, with random values, and
never touch one that exists (``kvmesh make-secrets``, the chart's pre-install/pre-upgrade
hook Job).

A Secret generated in a template (``randAlphaNum``, ``lookup``) changes on every render
(``helm template``, Argo CD, ``--dry-run``) and so with every sync; a Job that creates what
is missing, the way the GitLab chart's shared-secrets job does, renders the same manifests
every time and keeps the values across upgrades.

A small client of the Kubernetes REST API on the standard library alone (the image needs no
Kubernetes package): the pod's service-account token and CA, ``GET`` a Secret, ``POST`` it
when the answer is 404. A 409 on the ``POST`` means another writer created it first: kept,
like any Secret that exists. The Job's Role grants ``get`` and ``create`` on Secrets only,
so this never updates, patches, lists or deletes.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_FILE = SERVICE_ACCOUNT / "token"
CA_FILE = SERVICE_ACCOUNT / "ca.crt"
NAMESPACE_FILE = SERVICE_ACCOUNT / "namespace"

# What the API server accepts: a Secret's name is a DNS subdomain, a key a config key.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_LABEL_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
RANDOM_BYTES = 32  # secrets.token_urlsafe: 43 characters, no whitespace


class KubeError(Exception):
    """The API server refused or could not be reached (one line, never a value)."""


@dataclass(frozen=True)
class SecretSpec:
    """A Secret to have: its name and the keys it must hold."""

    name: str
    keys: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> SecretSpec:
        """``NAME=KEY[,KEY...]``; ValueError naming what is wrong."""
        name, sep, keys = text.partition("=")
        if not sep:
            raise ValueError(f"{text!r}: expected NAME=KEY[,KEY...]")
        check_name(name)
        parts = tuple(k for k in keys.split(","))
        if not keys or any(not k for k in parts):
            raise ValueError(f"{text!r}: expected NAME=KEY[,KEY...] (no empty key)")
        for key in parts:
            if len(key) > 253 or not _KEY.match(key):
                raise ValueError(f"{text!r}: key {key!r} is not a valid Secret key ([-._a-zA-Z0-9]+)")
        if len(set(parts)) != len(parts):
            raise ValueError(f"{text!r}: a key is named twice")
        return cls(name, parts)


def check_name(name: str, what: str = "Secret name") -> str:
    if len(name) > 253 or not _NAME.match(name):
        raise ValueError(f"{what} {name!r} is not a DNS subdomain (lower case, digits, '-', '.')")
    return name


def parse_label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not _LABEL_NAME.match(key) or len(value) > 63 or not _LABEL_VALUE.match(value):
        raise ValueError(f"label {text!r}: expected KEY=VALUE with a valid label key and value")
    return key, value


def random_values(keys: Iterable[str]) -> dict[str, str]:
    """A fresh random value per key (URL-safe base64 text: a token, a password)."""
    return {key: secrets.token_urlsafe(RANDOM_BYTES) for key in keys}


def default_api_server() -> str:
    """The in-cluster API server, from the variables Kubernetes gives every pod."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


@dataclass
class KubeClient:
    """Secrets in one namespace, through the REST API at ``server`` (``https://...``; plain
    ``http://`` only for a test server on this machine)."""

    server: str
    namespace: str
    token: str
    ca_file: str | None = None
    timeout_s: float = 10.0
    _context: ssl.SSLContext | None = field(default=None, repr=False)

    @classmethod
    def from_files(
        cls, server: str, namespace: str, token_file: str | Path, ca_file: str | Path | None
    ) -> KubeClient:
        """ValueError (one line, naming the file) when the token cannot be read."""
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(
                f"cannot read the service-account token {str(token_file)!r}: {exc.strerror}"
            ) from None
        if not token:
            raise ValueError(f"the service-account token {str(token_file)!r} is empty")
        client = cls(
            server.rstrip("/"), check_name(namespace, "namespace"), token, str(ca_file) if ca_file else None
        )
        if client.server.startswith("https://"):
            try:
                client._context = ssl.create_default_context(cafile=client.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"cannot read the CA {client.ca_file!r}: {exc}") from None
        elif not client.server.startswith("http://"):
            raise ValueError(f"API server {server!r}: expected https://HOST[:PORT]")
        return client

    def _path(self, name: str | None = None) -> str:
        path = f"/api/v1/namespaces/{quote(self.namespace)}/secrets"
        return f"{path}/{quote(name)}" if name else path

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.server + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._context) as reply:
                return reply.status, _json(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json(exc.read())
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise KubeError(f"cannot reach the API server {self.server}: {reason}") from None

    def get_secret(self, name: str) -> dict | None:
        """The Secret, or None when there is none."""
        status, body = self._call("GET", self._path(name))
        if status == 404:
            return None
        if status != 200:
            raise KubeError(f"GET secret {self.namespace}/{name}: {_refusal(status, body)}")
        return body

    def create_secret(self, name: str, values: dict[str, str], labels: dict[str, str]) -> bool:
        """POST the Secret; False when it exists already (409: created meanwhile)."""
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": self.namespace, "labels": labels},
            "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in values.items()},
        }
        status, reply = self._call("POST", self._path(), body)
        if status == 409:
            return False
        if status not in (200, 201):
            raise KubeError(f"POST secret {self.namespace}/{name}: {_refusal(status, reply)}")
        return True


def _json(raw: bytes) -> dict:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _refusal(status: int, body: dict) -> str:
    message = str(body.get("message") or body.get("reason") or "").splitlines()
    return f"HTTP {status}" + (f": {message[0]}" if message else "")


def ensure(client: KubeClient, spec: SecretSpec, labels: dict[str, str]) -> str:
    """Make sure the Secret exists with its keys: "created" or "kept". KubeError when one that
    exists lacks a key (this never changes an existing Secret: add the key or delete it)."""
    existing = client.get_secret(spec.name)
    if existing is None:
        if client.create_secret(spec.name, random_values(spec.keys), labels):
            return "created"
        existing = client.get_secret(spec.name)  # a 409: someone else's, checked like any other
        if existing is None:
            raise KubeError(f"secret {client.namespace}/{spec.name}: the API server said it exists, then not")
    missing = [k for k in spec.keys if k not in (existing.get("data") or {})]
    if missing:
        raise KubeError(
            f"secret {client.namespace}/{spec.name} exists without the key(s) {', '.join(missing)}: "
            "add them, or delete the secret to have it made again (this never changes an existing secret)"
        )
    return "kept"
