"""Config fields declared once, and the one environment rule.

Every setting of a kvmesh process is a dataclass field declared with ``option(...)``: its
type, its default and a one-line help. ``kvmesh.cli.flags`` derives the command-line
flags and their ``KVMESH_<FLAG>`` environment defaults from these fields, so a setting
cannot be parsed in one place and lost on its way to another.

Environment values follow one rule everywhere (flags included):
  - empty means unset (the field keeps its default);
  - booleans are ``1/true/yes/on`` or ``0/false/no/off`` (any case), anything else is an error;
  - for an optional number (``int | None``), ``0`` and ``auto`` mean unset too: the chart
    writes ``KVMESH_MAX_MODEL_LEN=0`` for "the model's own", ``KVMESH_BLOCK_SIZE=auto``;
    except where 0 is a setting of its own (``zero_unset=False``: ``--host-kv-gib 0`` is off,
    unset is a default that may be on).
No field holds a secret: tokens and passwords are files, and a field names the file.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ENV_PREFIX = "KVMESH_"
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    cli: bool = True,
    per_model: bool = False,
    factory: Any = dataclasses.MISSING,
    former: str | None = None,
    former_unit: int = 1,
    zero_unset: bool = True,
) -> Any:
    """A config field: ``flag`` overrides the flag name derived from the field name (and so
    its ``KVMESH_<FLAG>`` variable); ``cli=False`` keeps it off the command line (set by the
    launcher); ``per_model``: each model of a several-model deployment may set its own
    (``--model DIR,KEY=VALUE``; on a nested config, every field in it). ``former``: the
    flag's earlier name, still accepted (flag and variable) with a warning, so no deployment
    that sets it breaks; ``former_unit``: what one of its units is in this flag's (a MiB
    flag that became bytes: ``1 << 20``)."""
    metadata = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "cli": cli,
        "per_model": per_model,
        "former": former,
        "former_unit": former_unit,
        "zero_unset": zero_unset,
    }
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def env_name(flag: str) -> str:
    """``max-model-len`` -> ``KVMESH_MAX_MODEL_LEN``."""
    return ENV_PREFIX + flag.upper().replace("-", "_")


def read_env(flag: str) -> str | None:
    """The environment value for ``flag`` (``KVMESH_<FLAG>``), None when unset or empty."""
    value = os.environ.get(env_name(flag), "").strip()
    return value or None


def parse_bool(text: str, what: str) -> bool:
    word = text.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ValueError(f"{what} must be one of 1/true/yes/on or 0/false/no/off, got {text!r}")


def redacted_url(url: str | None) -> str | None:
    """A URL without its password (never print or export secrets)."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def effective_config(config: Any) -> dict:
    """A config as plain data for operators and tests, URL passwords masked."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            value = effective_config(value)
        elif f.name.endswith("_url"):
            value = redacted_url(value)
        out[f.name] = value
    return out
