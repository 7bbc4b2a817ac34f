"""A mix of models behind one router: each model its own workload and share of the arrivals.

``--model NAME[,share=S][,workload=W][,replicas=N]`` (repeated) is the one shape every command
that takes a mix reads (``kvmesh simulate``; ``kvmesh bench serve``, where NAME is the model
folder): the same ``DIR,KEY=VALUE`` form ``kvmesh up`` takes. Shares are of the arrival rate
(``--rate`` in all, each model's Poisson stream at its share of it; equal when none is given);
each model's workload defaults to the command's ``--workload`` and its content to its own seed,
so two models never send the same prompts unless told to.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvmesh.bench.measure.workloads import WORKLOADS, WorkloadRequest

KEYS = ("share", "workload", "replicas")


@dataclass(frozen=True)
class ModelLoad:
    name: str  # the model's name in requests (or its folder, for a local cluster)
    share: float  # of the arrivals, the shares summing to 1
    workload: str | None = None  # its own generated workload (default: the command's)
    replicas: int | None = None  # its own replica count (default: the command's)


def parse_models(specs: Iterable[str]) -> list[ModelLoad]:
    """``NAME[,KEY=VALUE...]`` per model; ValueError (a usage error) naming what is wrong."""
    models, given = [], []
    for spec in specs:
        name, *pairs = spec.split(",")
        fields: dict[str, str] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in KEYS:
                raise ValueError(f"--model {spec}: {pair!r} is not one of {', '.join(k + '=' for k in KEYS)}")
            fields[key] = value
        if not name:
            raise ValueError(f"--model {spec}: the model comes first")
        share = _number(spec, "share", fields.get("share"), float)
        replicas = _number(spec, "replicas", fields.get("replicas"), int)
        workload = fields.get("workload")
        if workload is not None and (workload not in WORKLOADS or workload == "mooncake"):
            raise ValueError(f"--model {spec}: workload must be a generated one ({', '.join(_generated())})")
        given.append(share)
        models.append(ModelLoad(name, share or 0.0, workload, replicas))
    names = [m.name for m in models]
    if len(set(names)) < len(names):
        raise ValueError(f"--model: a model is named twice ({', '.join(names)})")
    if any(s is None for s in given) and any(s is not None for s in given):
        raise ValueError("--model: give every model a share=, or none (equal shares)")
    total = sum(m.share for m in models) or len(models)
    return [
        ModelLoad(m.name, (m.share or 1.0) / total, m.workload, m.replicas)
        for m in models  # equal shares when none is given
    ]


def _number(spec: str, key: str, text: str | None, kind: type) -> float | int | None:
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise ValueError(f"--model {spec}: {key} must be a positive {'integer' if kind is int else 'number'}")
    return value


def _generated() -> list[str]:
    return sorted(name for name in WORKLOADS if name != "mooncake")


def merge_by_arrival(streams: dict[str, Iterable[WorkloadRequest]]) -> Iterator[tuple[str, WorkloadRequest]]:
    """Every model's requests in one arrival order, each with its model's name."""
    tagged = [_tagged(name, stream) for name, stream in streams.items()]
    for _, name, request in heapq.merge(*tagged, key=lambda item: (item[0], item[1])):
        yield name, request


def _tagged(name: str, stream: Iterable[WorkloadRequest]) -> Iterator[tuple[float, str, WorkloadRequest]]:
    return ((r.arrival_s, name, r) for r in stream)
