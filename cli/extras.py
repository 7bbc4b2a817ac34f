"""Commands that need an optional extra say so in one line instead of a traceback."""

from __future__ import annotations

import importlib

from kvmesh.cluster.errors import UsageError


def require_extra(extra: str, *modules: str) -> None:
    """UsageError (exit 2) with the install hint when any of ``modules`` cannot be imported."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UsageError(f"this command needs {', '.join(missing)}: pip install 'kvmesh[{extra}]'")
