"""Who may do what to the index: one Redis/Valkey ACL user per role.

- ``admin`` (``kvmesh up``, the chart's controller): everything, and it alone loads the index
  functions, flushes or reconfigures the server.
- ``router``: reads everything; writes only what routers own (its incarnation and shared
  load, speculative entries, resync claims, the settings a router told its block size stores).
- ``replica``: reads everything; writes only what replicas own (registration, heartbeats,
  their slots, published and swept block keys, the settings).

Functions run with the caller's rights, so a router that calls ``register`` is refused like
one that writes the keys itself: no router can pose as a replica, no replica can steer
routing through shared load or speculation, and neither can load code or flush. The key
patterns follow the layout in ``index.py``/``index.lua``: control keys ``{k:<8 hex>}<name>``,
published blocks ``{<8 hex>.<4 hex>}<8 bytes>``, speculative ones ``{<8 hex>.<4 hex>}~<parity><8 bytes>``.
"""

from __future__ import annotations

import hashlib

ROLES = ("admin", "router", "replica")
USERS = {role: f"kvmesh-{role}" for role in ROLES}

_CONTROL = "{k:????????}"  # alone: the control functions' declared key, never written itself
_TAG = "{????????.????}"  # a function's declared key (a chain's hash tag); never written itself
_BLOCK = _TAG + "????????"
_SPECULATIVE = _TAG + "~?????????"
_ROUTER_KEYS = ("next", "ri*", "routers", "load", "w*", "settings", "resync:*")
_REPLICA_KEYS = ("next", "r:*", "i*", "slots", "dead", "replicas", "settings")

# Every role may read, write (within its keys), call functions and manage its connection;
# nothing dangerous (FLUSHALL, CONFIG, KEYS, DEBUG, ...) and no FUNCTION but LIST; TIME (the
# functions' clock) back. A Redis
# Cluster client also asks for the slot map and command table.
_SERVING_COMMANDS = (
    "-@all +@read +@write +@scripting +@connection -@dangerous -@admin -function +function|list "
    "+time +cluster|slots +cluster|shards +cluster|myid +command +readonly +readwrite"
)


def acl_rules(role: str) -> str:
    """The ACL rules of ``role``, without its password (ACL SETUSER / ACL file syntax)."""
    if role == "admin":
        return "~* &* +@all"
    if role == "router":
        keys = [_CONTROL + k for k in ("", *_ROUTER_KEYS)] + [_TAG, _SPECULATIVE]
    elif role == "replica":
        keys = [_CONTROL + k for k in ("", *_REPLICA_KEYS)] + [_TAG, _BLOCK]
    else:
        raise ValueError(f"unknown index role {role!r}; known: {', '.join(ROLES)}")
    return " ".join(["resetchannels", "%R~*", *(f"~{k}" for k in keys), _SERVING_COMMANDS])


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
