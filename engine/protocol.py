"""The face a replica needs of an engine: what ``kvmesh.replica`` (its request path, index
publisher, health watch and metrics) calls, and the values it gets back. kvmesh's engine
(``AsyncLLMEngine``) and the vLLM adapter (``replica/vllm``) both keep it; a third engine
implements ``ServingEngine`` and produces these types, and a replica hosts it unchanged.
No torch here: the adapter imports this and never the engine's internals.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.request import PrefixFacts, RequestOutput, RequestTimes
from kvmesh.kvcache import KVCacheStats, KVEvent
from kvmesh.kvcache.events import CachedBlocks
from kvmesh.serving.sampling_params import SamplingParams
from kvmesh.serving.step_costs import StepCosts

__all__ = [
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineStats",
    "HostTierStats",
    "PrefixFacts",
    "RequestOutput",
    "RequestTimes",
    "ServingEngine",
    "TokenLogprob",
]


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability, its rank (1: the most likely), and, best first, the ``k``
    most likely alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class HostTierStats:
    """The host tier: its size, what it holds, and the copies in and out of it."""

    num_blocks: int
    num_used_blocks: int
    bytes: int
    offloaded_blocks: int  # copied in from the device pool
    restored_blocks: int  # copied back
    restore_seconds: float  # the restores' measured copy time
    hit_tokens: int  # prompt tokens served from it (counted as cached)
    restore_block_s: float | None = None  # a block's restore lately, measured (None: none yet)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_failed_requests: int  # ended by their own failure in a step, or by a failed step
    prompt_tokens: int  # admitted prompt tokens, all requests so far
    generation_tokens: int  # sampled tokens, all requests so far
    kv: KVCacheStats
    step_costs: StepCosts  # what a step costs here, measured (engine/step_costs.py)
    step_cost_samples: int  # steps that fit has seen
    graph_capture_seconds: float = 0.0  # the start's CUDA-graph capture (0: none captured)
    graph_capture_bytes: int = 0  # device memory the captured graphs hold
    graph_replays: int = 0  # decode steps replayed from a graph
    host: HostTierStats | None = None  # None: no host tier


class EngineDeadError(RuntimeError):
    """The engine thread failed; requests in flight were ended with this error."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: refused at once instead of queueing without bound."""


class ServingEngine(Protocol):
    """An engine as a replica hosts it. Requests stream deltas; the KV cache is reported as
    events (stored, removed, cleared) that the replica publishes to the index, with a
    snapshot for a resync; health and stats are read from the replica's loop, any time."""

    config: EngineConfig  # what a replica sizes its admission by (max_num_seqs, max_queued_requests)

    def generate(
        self, prompt: list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's deltas. Refusals (``ValueError`` for bad input,
        ``EngineOverloadedError`` for a full queue, ``EngineDeadError`` while the engine
        cannot serve) are raised before any delta."""
        ...

    def abort(self, request_id: str) -> bool:
        """Abort a streaming request; False if there is none by that id."""
        ...

    def num_streams(self) -> int: ...

    def stats(self) -> EngineStats: ...

    def health(self) -> str | None:
        """None while the engine serves, else why it does not."""
        ...

    def fail_streams(self, reason: str) -> None:
        """End every streaming request with ``EngineDeadError(reason)``."""
        ...

    async def snapshot_cached_blocks(self) -> CachedBlocks:
        """Every cached block's hash with its chain's root, per tier, consistent with the
        events drained after it."""
        ...

    async def cached_hashes(self) -> set[int]: ...

    def drain_kv_events(self) -> list[KVEvent]: ...

    async def wait_kv_events(self, timeout: float) -> None:
        """Return when events are pending, or after ``timeout`` seconds."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    async def recount_cache(self) -> None:
        """Make the cache's account exact before a resync (a no-op where the ledger is the cache)."""
        ...

    async def stop(self) -> None: ...
