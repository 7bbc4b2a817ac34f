"""Command-line flags derived from config dataclasses, with ``KVMESH_<FLAG>`` environment defaults.

Every ``option(...)`` field of a command's configs (nested configs included) becomes one
flag, named after the field or its ``flag=`` override. Fields that share a flag name across
the configs share the flag: its value goes to every one of them, so ``kvmesh up --model``
reaches the router and every replica. Where such fields differ in their defaults, the
flag shows the command's own field's (``kvmesh up --deployment``), else the first config's,
and a field keeps its own default while neither the flag nor its environment variable is set.

Several models (``kvmesh up``, ``kvmesh router``): ``--model`` may be repeated, each as
``DIR[,KEY=VALUE...]``, where each KEY is a per-model flag (``option(per_model=True)``:
``--replicas``, ``--block-size``, the engine's, ...) that overrides the command line's for
that model alone; ``build_models`` builds one set of configs per model. ``KVMESH_MODEL``
holds the same, the models separated by ``;`` or new lines.

Precedence: the flag, then ``KVMESH_<FLAG>`` (``kvmesh.serving.options`` has the one rule
for reading it), then the field's default. A renamed flag's former name (``option(former=)``)
is still read, flag and variable, in the unit it had, with a warning; giving both names is a
usage error. No flag carries a secret: tokens and passwords
are files, and their flags name the file (``--api-key-file``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.cluster.errors import UsageError
from kvmesh.serving.options import env_name, parse_bool, read_env

log = logging.getLogger(__name__)
Path = tuple[object, ...]  # (root index, field name, field name, ...)


@dataclass
class Flag:
    name: str  # without the dashes
    kind: type  # bool, int, float or str
    optional: bool  # ``X | None``: for numbers, 0 means unset too
    required: bool  # no default anywhere: the flag or its environment variable must be given
    default: Any
    help: str
    choices: tuple[str, ...] | None
    per_model: bool = False  # each model may override it in its --model spec
    targets: list[Path] = field(default_factory=list)
    former: str | None = None  # its earlier name, still read
    former_unit: int = 1  # one of the former name's units, in this flag's
    zero_unset: bool = True  # optional numbers: 0 means unset (False: 0 is a value of its own)

    @property
    def env(self) -> str:
        return env_name(self.name)

    @property
    def dest(self) -> str:
        return "cfg_" + self.name.replace("-", "_")

    @property
    def former_dest(self) -> str:
        return f"{self.dest}__former"

    def parse(self, text: str) -> Any:
        """One rule for flag and environment values; ValueError names the flag."""
        if self.kind is bool:
            return parse_bool(text, f"--{self.name}")
        if self.optional and text == "":
            return None
        if self.kind in (int, float):
            if self.optional and text.strip().lower() == "auto":
                return None
            try:
                value = self.kind(text)
            except ValueError:
                what = "an integer" if self.kind is int else "a number"
                raise ValueError(f"--{self.name} expects {what}, got {text!r}") from None
            return None if self.optional and self.zero_unset and value == 0 else value
        if self.choices and text not in self.choices:
            raise ValueError(f"--{self.name} must be one of {', '.join(self.choices)}, got {text!r}")
        return text

    def parse_former(self, text: str) -> Any:
        """A value given under the former name, in this flag's unit."""
        value = self.parse(text)
        return value * self.former_unit if self.former_unit != 1 and value is not None else value


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of ``X`` or ``X | None``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(annotation))
    return annotation, False


MODEL_FLAG = "model"
MODEL_SEPARATORS = re.compile(r"[;\n]")  # between the models in KVMESH_MODEL


class FlagTable:
    """The flags of one command, derived from its config dataclasses (``roots``, in order).
    ``several_models``: ``--model`` may be repeated (``build_models``)."""

    def __init__(self, roots: Sequence[type], several_models: bool = False):
        self.roots = list(roots)
        self.several_models = several_models
        self.flags: dict[str, Flag] = {}
        self._warned: set[str] = set()  # former names already warned about
        for i, root in enumerate(self.roots):
            self._collect(root, (i,))

    def _collect(self, cls: type, path: Path, per_model: bool = False) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind, optional = _unwrap(hints[f.name])
            meta = f.metadata
            if "help" not in meta:
                raise TypeError(f"{cls.__name__}.{f.name} is not declared with option(...)")
            if dataclasses.is_dataclass(kind):
                self._collect(kind, (*path, f.name), per_model or meta.get("per_model", False))
                continue
            if not meta["cli"]:
                continue
            name = meta["flag"] or f.name.replace("_", "-")
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            flag = self.flags.get(name)
            if flag is None:
                flag = Flag(
                    name,
                    kind,
                    optional,
                    not has_default,
                    f.default if has_default else None,
                    meta["help"],
                    meta["choices"],
                    former=meta["former"],
                    former_unit=meta["former_unit"],
                    zero_unset=meta["zero_unset"],
                )
                self.flags[name] = flag
            elif flag.kind != kind:
                raise TypeError(f"--{name} is declared with two types ({flag.kind} and {kind})")
            elif len(path) < min(len(t) for t in flag.targets) - 1:  # the command's own field
                flag.help = meta["help"]
                flag.default = None if f.default is dataclasses.MISSING else f.default
            flag.required = flag.required and not has_default
            flag.per_model = flag.per_model or per_model or meta["per_model"]
            flag.targets.append((*path, f.name))

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        for flag in self.flags.values():
            shown = (
                "required; " if flag.required else "" if flag.default is None else f"default {flag.default}; "
            )
            was = f"; formerly --{flag.former}" if flag.former else ""
            text = f"{flag.help} [{shown}env {flag.env}{was}]".replace("%", "%%")
            names = [f"--{flag.name}"] + (["-v"] if flag.name == "verbose" else [])
            if flag.former:  # read, not shown
                kind = (
                    {"action": argparse.BooleanOptionalAction}
                    if flag.kind is bool
                    else {"type": _argparse_type(flag, former=True)}
                )
                parser.add_argument(
                    f"--{flag.former}",
                    dest=flag.former_dest,
                    default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS,
                    **kind,
                )
            if flag.name == MODEL_FLAG and self.several_models:
                parser.add_argument(
                    *names,
                    dest=flag.dest,
                    action="append",
                    default=argparse.SUPPRESS,
                    help=text,
                    metavar="DIR",
                )
            elif flag.kind is bool:
                parser.add_argument(
                    *names,
                    dest=flag.dest,
                    action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS,
                    help=text,
                )
            else:
                parser.add_argument(
                    *names,
                    dest=flag.dest,
                    type=_argparse_type(flag),
                    default=argparse.SUPPRESS,
                    help=text,
                    metavar={int: "N", float: "X"}.get(flag.kind, flag.name.split("-")[-1].upper()),
                )

    def given(self, args: argparse.Namespace, name: str) -> bool:
        """Whether ``--name`` was on the command line (not its environment variable or default)."""
        return hasattr(args, self.flags[name].dest)

    def build_models(self, args: argparse.Namespace) -> list[list[Any]]:
        """One list of configs (as ``build``) per ``--model`` spec, in the order given; a model
        named twice is a UsageError."""
        flag = self.flags[MODEL_FLAG]
        if hasattr(args, flag.dest):
            specs = list(getattr(args, flag.dest))
        elif (text := read_env(MODEL_FLAG)) is not None:
            specs = [s.strip() for s in MODEL_SEPARATORS.split(text) if s.strip()]
        else:
            raise UsageError(f"--{MODEL_FLAG} is required (or set {flag.env})")
        built = [self.build(args, self._model_spec(spec)) for spec in specs]
        folders = [spec.split(",", 1)[0] for spec in specs]
        if len(set(folders)) < len(folders):
            raise UsageError(f"--{MODEL_FLAG}: a model folder is given twice ({', '.join(folders)})")
        return built

    def _model_spec(self, spec: str) -> dict[str, Any]:
        """``DIR[,KEY=VALUE...]`` as flag overrides, parsed: {"model": DIR, KEY: value, ...}
        (a KEY may be a flag's former name)."""
        folder, *pairs = spec.split(",")
        overrides: dict[str, Any] = {MODEL_FLAG: folder}
        formers = {f.former: f for f in self.flags.values() if f.former}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            flag = self.flags.get(key) or formers.get(key)
            if not sep or flag is None or not flag.per_model or key == MODEL_FLAG:
                per_model = sorted(n for n, f in self.flags.items() if f.per_model and n != MODEL_FLAG)
                raise UsageError(
                    f"--{MODEL_FLAG} {spec}: {pair!r} is not KEY=VALUE with a per-model KEY "
                    f"({', '.join(per_model)})"
                )
            if flag.name in overrides:
                raise UsageError(
                    f"--{MODEL_FLAG} {spec}: {flag.name} is given twice (once by its former name)"
                )
            try:
                overrides[flag.name] = (
                    flag.parse(value)
                    if key == flag.name
                    else self._former(flag, value, f"{flag.former}=", f"{flag.name}=")
                )
            except ValueError as exc:
                raise UsageError(f"--{MODEL_FLAG} {spec}: {exc}") from None
        if not folder:
            raise UsageError(f"--{MODEL_FLAG} {spec}: the model folder comes first")
        return overrides

    def build(self, args: argparse.Namespace, overrides: dict[str, str] | None = None) -> list[Any]:
        """The configs, in the order of ``roots``: ``overrides`` (one model's spec), flags,
        then environment, then defaults. Bad values and configs that refuse them are
        UsageErrors (one line, exit 2). A command of several models: its one model's."""
        if self.several_models and overrides is None:
            built = self.build_models(args)
            if len(built) > 1:
                raise UsageError(f"one --{MODEL_FLAG} here, got {len(built)}")
            return built[0]
        values: dict[Path, Any] = {}
        for flag in self.flags.values():
            if overrides and flag.name in overrides:
                value = overrides[flag.name]
            elif (found := self._given(flag, args)) is not None:
                value = found[0]
            elif flag.required:
                raise UsageError(f"--{flag.name} is required (or set {flag.env})")
            else:
                continue
            for target in flag.targets:
                values[target] = value
        try:
            return [self._construct(root, (i,), values) for i, root in enumerate(self.roots)]
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    def _given(self, flag: Flag, args: argparse.Namespace) -> tuple[Any] | None:
        """``flag``'s value from the command line, else its variable, under its name or its
        former one ((value,); None: not given)."""
        named = hasattr(args, flag.dest)
        if flag.former and hasattr(args, flag.former_dest):
            if named:
                raise UsageError(f"--{flag.name} and its former name --{flag.former} are both given")
            self._warn_former(f"--{flag.former}", f"--{flag.name}", flag)
            return (getattr(args, flag.former_dest),)
        if named:
            return (getattr(args, flag.dest),)
        text, former_text = read_env(flag.name), read_env(flag.former) if flag.former else None
        if text is not None and former_text is not None:
            raise UsageError(f"{flag.env} and its former name {env_name(flag.former)} are both set")
        try:
            if text is not None:
                return (flag.parse(text),)
            if former_text is not None:
                return (self._former(flag, former_text, env_name(flag.former), flag.env),)
        except ValueError as exc:
            raise UsageError(f"{flag.env}: {exc}") from None
        return None

    def _former(self, flag: Flag, text: str, given: str, now: str) -> Any:
        """A value given under ``flag``'s former name (``given``; ``now``: the name it has)."""
        self._warn_former(given, now, flag)
        return flag.parse_former(text)

    def _warn_former(self, given: str, now: str, flag: Flag) -> None:
        if given in self._warned:  # once, not once per model
            return
        self._warned.add(given)
        unit = f" (its value times {flag.former_unit})" if flag.former_unit != 1 else ""
        log.warning(f"{given} is now {now}{unit}; the former name still works, for now")

    def _construct(self, cls: type, path: Path, values: dict[Path, Any]) -> Any:
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            kind, _ = _unwrap(hints[f.name])
            here = (*path, f.name)
            if dataclasses.is_dataclass(kind):
                kwargs[f.name] = self._construct(kind, here, values)
            elif here in values:
                kwargs[f.name] = values[here]
        return cls(**kwargs)


def _argparse_type(flag: Flag, former: bool = False):
    def parse(text: str) -> Any:
        try:
            return flag.parse_former(text) if former else flag.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--{flag.name} ")) from None

    parse.__name__ = flag.name  # argparse names the type in some messages
    return parse
