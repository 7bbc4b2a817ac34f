"""Who may do what to the index: one Redis/Valkey ACL user per role.

- ``admin`` (``kvmesh up``, the chart's controller): everything, and it alone loads the index
  functions, flushes or reconfigures the server.
- ``router``: reads everything; writes only what routers own (its incarnation and shared
  load, speculative entries, resync claims). Never the settings: a misconfigured router that
  stored its own after a restart of the server kept every replica out.
- ``replica``: reads everything; writes only what replicas own (registration, heartbeats,
  their slots, published and swept block keys, the settings when none are stored: a replica
  whose block size is "auto" is the first to know it).

Redis checks each command a function runs against its caller's ACL user, so a key a role's
functions write is one the role can write raw: the functions and every reader treat such
keys as untrusted (``kvcache/index/untrusted.py``), and a bad entry costs only itself.

Each replica may also have a user of its own (``replica_user``; the supervisor, as admin,
issues one with a fresh password each time it starts a replica): the replica role's rights,
but only its own record and liveness key, so no replica can register as another, move
another's address or end another's incarnation. The role's shared user stays for
deployments whose supervisor is not the index's admin.

Functions run with the caller's rights, so a router that calls ``register`` is refused like
one that writes the keys itself: no router can pose as a replica, no replica can steer
routing through shared load or speculation, and neither can load code or flush. The key
patterns follow the layout in ``redis.py``/``redis.lua``: control keys ``{k:<8 hex>}<name>``,
published blocks ``{<8 hex>.<4 hex>}<8 bytes>`` (``...}h<8 bytes>`` in host tiers), speculative
ones ``{<8 hex>.<4 hex>}~<parity><8 bytes>``.
"""

from __future__ import annotations

import hashlib
import re
import secrets

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

ROLES = ("admin", "router", "replica")
_PLAIN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_DIGEST = re.compile(r"[0-9a-f]{8}")
USERS = {role: f"kvmesh-{role}" for role in ROLES}

_CONTROL = "{k:????????}"  # alone: the control functions' declared key, never written itself
_TAG = "{????????.????}"  # a function's declared key (a chain's hash tag); never written itself
_BLOCK = _TAG + "????????"
_HOST_BLOCK = _TAG + "h????????"
_SPECULATIVE = _TAG + "~?????????"
_ROUTER_KEYS = ("next", "ri*", "routers", "load", "w*", "resync:*")
_REPLICA_KEYS = ("next", "slots", "dead", "replicas", "settings")
_OWN_KEYS = ("r:", "l:")  # a replica's record and liveness key: + its id

# Every role may read, write (within its keys), call functions and manage its connection;
# nothing dangerous (FLUSHALL, CONFIG, KEYS, DEBUG, ...) and no FUNCTION but LIST; TIME (the
# functions' clock) back. A Redis
# Cluster client also asks for the slot map and command table.
_SERVING_COMMANDS = (
    "-@all +@read +@write +@scripting +@connection -@dangerous -@admin -function +function|list "
    "+time +cluster|slots +cluster|shards +cluster|myid +command +readonly +readwrite"
)


def acl_rules(role: str, replica: tuple[str, str] | None = None) -> str:
    """The ACL rules of ``role``, without its password (ACL SETUSER / ACL file syntax);
    ``replica``: (deployment digest, replica id) for the rules of that one replica's own user
    (role "replica"): its deployment's keys only, and of the replicas' own, its own."""
    if role == "admin":
        return "~* &* +@all"
    if role == "router":
        keys = [_CONTROL + k for k in ("", *_ROUTER_KEYS)] + [_TAG, _SPECULATIVE]
    elif role == "replica" and replica is None:
        keys = [_CONTROL + k for k in ("", *_REPLICA_KEYS, *(k + "*" for k in _OWN_KEYS))] + [
            _TAG,
            _BLOCK,
            _HOST_BLOCK,
        ]
    elif role == "replica":
        digest, own = _check_digest(replica[0]), check_replica_id(replica[1])
        control, tag = "{k:" + digest + "}", "{" + digest + ".????}"
        keys = [control + k for k in ("", *_REPLICA_KEYS, *(k + own for k in _OWN_KEYS))]
        keys += [tag, tag + "????????", tag + "h????????"]
    else:
        raise ValueError(f"unknown index role {role!r}; known: {', '.join(ROLES)}")
    return " ".join(["resetchannels", "%R~*", *(f"~{k}" for k in keys), _SERVING_COMMANDS])


def replica_user(digest: str, replica_id: str) -> str:
    """The name of one replica's own index user (``digest``: its deployment's, as the index's
    keys carry it: two deployments on one server each have their ``replica-0``)."""
    return f"{USERS['replica']}.{_check_digest(digest)}.{check_replica_id(replica_id)}"


def check_replica_id(replica_id: str) -> str:
    """``replica_id`` if it can stand in a key pattern as itself (no glob characters)."""
    if not _PLAIN_ID.fullmatch(replica_id):
        raise ValueError(
            f"a replica id with its own index user is letters, digits, '.', '_', '-': {replica_id!r:.80}"
        )
    return replica_id


async def issue_replica_user(client: Redis | RedisCluster, digest: str, replica_id: str) -> tuple[str, str]:
    """Create (or reset) the own user of ``replica_id`` of the deployment ``digest`` names,
    with a new password, on every node of a cluster (ACL users are per node); returns (user,
    password). Needs the admin's rights."""
    user, password = replica_user(digest, replica_id), secrets.token_urlsafe(32)
    rules = acl_rules("replica", (digest, replica_id)).split()
    command = ("ACL", "SETUSER", user, "reset", "on", f">{password}", *rules)
    if isinstance(client, RedisCluster):
        await client.execute_command(*command, target_nodes=RedisCluster.ALL_NODES)
    else:
        await client.execute_command(*command)
    return user, password


async def replica_users(client: Redis | RedisCluster) -> set[str]:
    """The replicas' own users the server has (on a cluster: those on every node)."""
    if isinstance(client, RedisCluster):
        per_node = await client.execute_command("ACL", "USERS", target_nodes=RedisCluster.ALL_NODES)
        names = set.intersection(*({_text(u) for u in users} for users in per_node.values()))
    else:
        names = {_text(u) for u in await client.execute_command("ACL", "USERS")}
    return {name for name in names if name.startswith(USERS["replica"] + ".")}


def _check_digest(digest: str) -> str:
    if not _DIGEST.fullmatch(digest):
        raise ValueError(f"not a deployment digest (8 hex digits): {digest!r:.40}")
    return digest


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def acl_file(passwords: dict[str, str]) -> str:
    """A Valkey/Redis ACL file: the default user off, one user per role with its password
    stored as a SHA-256 (the file never holds a password)."""
    missing = sorted(set(ROLES) - set(passwords))
    if missing:
        raise ValueError(f"no password for the index role(s) {', '.join(missing)}")
    lines = ["user default off resetkeys resetchannels -@all"]
    for role in ROLES:
        if not passwords[role] or any(c.isspace() for c in passwords[role]):
            raise ValueError(f"the {role} password must be non-empty, without spaces")
        digest = hashlib.sha256(passwords[role].encode()).hexdigest()
        lines.append(f"user {USERS[role]} on #{digest} {acl_rules(role)}")
    return "\n".join(lines) + "\n"
