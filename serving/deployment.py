"""A deployment's name: which deployment of a model a process belongs to.

Every process that opens the prefix index (router, replica, controller) names its
deployment; the index keeps each deployment of a model under keys of its own, so two
deployments of one model on one Redis (two ``kvmesh up``, two Helm releases) never see,
retire or route to each other's replicas. A standalone router or replica is in
``default``; ``kvmesh up`` picks a fresh name per run unless told one; the chart uses
``<namespace>.<release>``.
"""

from __future__ import annotations

import re

from kvmesh.kvcache.index.api import DEFAULT_DEPLOYMENT

__all__ = ["DEFAULT_DEPLOYMENT", "MAX_DEPLOYMENT_CHARS", "check_deployment"]

# A Kubernetes namespace (63) + "." + a Helm release name (53) fits.
MAX_DEPLOYMENT_CHARS = 128
_NAME = re.compile(r"[A-Za-z0-9._/-]+")


def check_deployment(name: object) -> None:
    """ValueError (one line) unless ``name`` is 1..MAX_DEPLOYMENT_CHARS of ``A-Za-z0-9._/-``."""
    if isinstance(name, str) and 0 < len(name) <= MAX_DEPLOYMENT_CHARS and _NAME.fullmatch(name):
        return
    shown = f"{len(name)} characters" if isinstance(name, str) and len(name) > 60 else repr(name)
    raise ValueError(
        f"deployment must be 1 to {MAX_DEPLOYMENT_CHARS} characters of A-Z a-z 0-9 . _ / -, got {shown}"
    )
