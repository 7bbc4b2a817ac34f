"""``kvmesh valkey-acl``: the index's ACL file (one user per role) from the roles' password
files; the chart's Valkey reads it (its init container runs this), and a user with their own
Redis sees the rules to create the same users."""

from __future__ import annotations

import argparse


def register(commands) -> None:
    acl = commands.add_parser(
        "valkey-acl", help="write the index's Valkey/Redis ACL file (admin, router and replica users)"
    )
    acl.add_argument(
        "--passwords-dir",
        required=True,
        help="folder with the files admin, router and replica, one password each",
    )
    acl.add_argument("--out", required=True, help="the ACL file to write (mode 0600; Valkey's aclfile)")
    acl.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from kvmesh.cluster.errors import UsageError
    from kvmesh.kvcache.index.acl import ROLES, acl_file
    from kvmesh.serving.auth import read_token_file

    try:
        passwords = {
            role: read_token_file(str(Path(args.passwords_dir) / role), "--passwords-dir") for role in ROLES
        }
        text = acl_file(passwords)
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return 0
