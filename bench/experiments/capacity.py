"""How fast a fleet can serve a workload: the rate behind ``kvmesh simulate --load``.

A replica's capacity is its throughput when it never runs out of work (the saturation
throughput vLLM's benchmarks measure with every request sent at once). The probe plays a
sample of the workload to a few replicas, every request there at the start, and counts the
completions over the middle half of the run (the warm-up and the drain left out). The sample
keeps the workload's sharing per replica: it takes whole groups (one shared prefix, one
conversation), as large a fraction of them as the probe's replicas are of the fleet, so each
replica sees as many prompts per cached prefix as in the full run (the probe's size follows the
number of requests drawn); a sample too small to keep the probe's batches full for a while is
repeated with new content.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import xxhash

from kvmesh.bench.experiments.cost_model import CostModel
from kvmesh.bench.measure.workloads import WorkloadRequest, with_new_content

PROBE_REPLICAS = 8
PROBE_BATCHES = 4  # full batches a probe replica works through: the middle half is steady


@dataclasses.dataclass(frozen=True)
class Capacity:
    per_replica_rps: float  # requests a second one saturated replica completes
    probe_requests: int
    probe_replicas: int


def draw_groups(workload: Iterable[WorkloadRequest], fraction: float) -> list[WorkloadRequest]:
    """The requests of a ``fraction`` of the workload's groups (chosen by a hash of the group's
    name, so the same on every run), in order, all arriving at the start."""
    cut = int(min(1.0, fraction) * 2**64)
    sample = [
        dataclasses.replace(r, arrival_s=0.0)
        for r in workload
        if fraction >= 1 or xxhash.xxh3_64_intdigest(r.group.encode()) < cut
    ]
    if not sample:
        raise ValueError("the capacity probe drew no requests from the workload (give more)")
    return sample


def with_copies(sample: list[WorkloadRequest], at_least: int) -> list[WorkloadRequest]:
    """``sample`` followed by copies of itself with new content, ``at_least`` requests in all."""
    copies = -(-at_least // len(sample))
    return sample + [with_new_content(r, copy) for copy in range(1, copies) for r in sample]


def measure_capacity(
    workload: Iterable[WorkloadRequest],
    total: int,
    replicas: int,
    policy: str,
    cost: CostModel,
    block_size: int,
    blocks_per_replica: int | None = None,
) -> Capacity:
    """One replica's saturation throughput on this workload (``total`` requests for the fleet
    of ``replicas``), from a probe of about ``PROBE_REPLICAS``: as many as give each of them
    the share of requests a replica of the fleet gets (the groups drawn vary in number)."""
    from kvmesh.bench.experiments.simulator import Simulation

    drawn = draw_groups(workload, PROBE_REPLICAS / replicas)
    probe = max(1, min(replicas, round(len(drawn) * replicas / total)))
    sample = with_copies(drawn, PROBE_BATCHES * cost.max_num_seqs * probe)
    sim = Simulation(
        sample, probe, policy, cost, block_size=block_size, blocks_per_replica=blocks_per_replica
    )
    sim.run()
    done = sorted(sim.results["done_s"])
    first, last = len(done) // 4, 3 * len(done) // 4
    return Capacity((last - first) / (done[last] - done[first]) / probe, len(sample), probe)
