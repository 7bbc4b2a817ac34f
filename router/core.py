"""The routing path shared by the gRPC and HTTP front ends.

tokenize once -> hash the blocks -> ONE index lookup (+ speculative entries)
-> policy ranks the live replicas -> stream from the first; if it fails before its
first response, retry once on the next -> relay chunks, add the prediction to Complete.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from kvmesh.kvcache import block_hashes
from kvmesh.protos import pb
from kvmesh.replica.sampling_params import sampling_from_proto
from kvmesh.router.errors import InvalidRequest, Overloaded, RouterError, Unavailable, upstream_error
from kvmesh.router.index import PrefixIndex
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.policies import Policy, RequestWork, RouteRequest, make_policy
from kvmesh.router.prompt import prompt_ids
from kvmesh.router.registry import ReplicaRegistry
from kvmesh.router.speculative import SpeculativeOverlay
from kvmesh.router.tokenization import PromptTokenizer

log = logging.getLogger(__name__)
_FAILOVER_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    block_size: int
    max_model_len: int
    vocab_size: int
    hash_seed: int


@dataclass(frozen=True)
class RouterLimits:
    """Bounds that keep one router from queueing without limit or taking oversized work."""

    max_inflight: int = 1024  # requests streaming through this router; beyond: RESOURCE_EXHAUSTED
    max_prompt_tokens: int | None = None  # None: max_model_len - 1
    max_tokens: int | None = None  # ceiling on sampling.max_tokens; None: max_model_len - 1


@dataclass
class Decision:
    """Where a request goes and why (for the caller, metrics and experiments)."""

    request_id: str
    token_ids: list[int]
    block_hashes: list[int]
    max_tokens: int
    ranked: list[str]
    matched: dict[str, int]  # replica -> matched blocks (index + speculative)
    policy: str
    decision_s: float


class RouterCore:
    def __init__(
        self,
        model: ModelInfo,
        tokenizer: PromptTokenizer | None,
        index: PrefixIndex,
        registry: ReplicaRegistry,
        default_policy: str = "prefix",
        speculative_ttl_s: float = 2.0,
        lookup_timeout_s: float = 0.25,
        metrics: RouterMetrics | None = None,
        limits: RouterLimits | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.index = index
        self.registry = registry
        self.overlay = SpeculativeOverlay(ttl_s=speculative_ttl_s)
        self.lookup_timeout_s = lookup_timeout_s
        self.metrics = metrics or RouterMetrics()
        self.policies: dict[str, Policy] = {}
        self.default_policy = self.policy(default_policy).name
        self.limits = limits or RouterLimits()
        self.draining = False  # set on shutdown: new requests get UNAVAILABLE
        self.active = 0  # requests streaming through this router now
        self._inflight: dict[str, str] = {}  # request id -> replica id
        self._index_warned = False

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def policy(self, name: str) -> Policy:
        if name not in self.policies:
            self.policies[name] = make_policy(name, block_size=self.model.block_size)
        return self.policies[name]

    # ------------------------------------------------------------------ validation

    async def prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        return await prompt_ids(request, self.tokenizer, self.model.vocab_size)

    async def validate(self, request: pb.GenerateRequest) -> tuple[list[int], int, str]:
        """(prompt ids, max_tokens, policy name) or InvalidRequest with the reason."""
        ids = await self.prompt_ids(request)
        try:
            params = sampling_from_proto(request.sampling)
            policy = self.policy(request.policy or self.default_policy).name
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        max_prompt = self.limits.max_prompt_tokens or self.model.max_model_len - 1
        if len(ids) > max_prompt:
            raise InvalidRequest(f"prompt has {len(ids)} tokens, the limit is {max_prompt}")
        ceiling = self.limits.max_tokens or self.model.max_model_len - 1
        if params.max_tokens > ceiling:
            raise InvalidRequest(f"max_tokens {params.max_tokens} is above the limit {ceiling}")
        if len(ids) + params.max_tokens > self.model.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({self.model.max_model_len})"
            )
        return ids, params.max_tokens, policy

    # ------------------------------------------------------------------ routing

    async def lookup(self, hashes: list[int]) -> dict[str, int]:
        """Index matches, or {} when Redis is away (logged once per outage)."""
        if not hashes:
            return {}
        start = time.perf_counter()
        try:
            found = await asyncio.wait_for(self.index.lookup(hashes), self.lookup_timeout_s)
        except Exception as exc:
            self.metrics.index_errors.inc()
            if not self._index_warned:
                log.warning("prefix index lookup failed: routing by load only", extra={"error": str(exc)})
                self._index_warned = True
            return {}
        self._index_warned = False
        self.metrics.lookup.observe(time.perf_counter() - start)
        return found

    async def decide(self, request: pb.GenerateRequest) -> Decision:
        start = time.perf_counter()
        ids, max_tokens, policy_name = await self.validate(request)
        hashes = block_hashes(ids, self.model.block_size, self.model.hash_seed)
        if not self.registry.live():
            raise Unavailable("no live replica")
        matched = await self.lookup(hashes)
        for rid, depth in self.overlay.matched(hashes).items():
            matched[rid] = max(matched.get(rid, 0), depth)
        states = self.registry.states(matched)
        if not states:
            raise Unavailable("no live replica")
        route = RouteRequest(ids, hashes, max_tokens, request.affinity_key)
        ranked = self.policy(policy_name).rank(route, states)
        elapsed = time.perf_counter() - start
        self.metrics.decision.observe(elapsed)
        request_id = request.request_id or uuid.uuid4().hex
        return Decision(request_id, ids, hashes, max_tokens, ranked, matched, policy_name, elapsed)

    def predicted_cached_tokens(self, decision: Decision, replica_id: str) -> int:
        """What the replica should reuse: matched blocks, never the prompt's last block."""
        lookable = (len(decision.token_ids) - 1) // self.model.block_size
        return min(decision.matched.get(replica_id, 0), lookable) * self.model.block_size

    async def generate(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Route and stream. Raises RouterError before the first response; after it, too.

        ``timeout``: seconds the caller still waits (its deadline); the replica gets the same.
        """
        if self.draining:
            raise Unavailable("router is shutting down; retry on another router")
        if self.active >= self.limits.max_inflight:
            self.metrics.requests.labels(request.policy or self.default_policy, "overloaded").inc()
            raise Overloaded(f"router at its in-flight limit ({self.limits.max_inflight} requests)")
        self.active += 1
        try:
            started = time.perf_counter()
            decision = await self.decide(request)
            outcome = "error"
            try:
                async for response in self._stream(request, decision, started, timeout):
                    yield response
                outcome = "ok"
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                self.metrics.requests.labels(decision.policy, outcome).inc()
                self.metrics.latency.observe(time.perf_counter() - started)
        finally:
            self.active -= 1

    async def _stream(
        self, request: pb.GenerateRequest, decision: Decision, started: float, timeout: float | None
    ):
        upstream = pb.GenerateRequest(
            request_id=decision.request_id,
            token_ids=pb.TokenIds(ids=decision.token_ids),
            sampling=request.sampling,
        )
        hashes = decision.block_hashes
        for attempt, replica_id in enumerate(decision.ranked[:2]):
            entry = self.registry.entries.get(replica_id)
            if entry is None:
                continue
            matched = decision.matched.get(replica_id, 0)
            work = RequestWork.estimate(len(hashes), matched, decision.max_tokens, self.model.block_size)
            self.registry.begin(entry, work)
            self.overlay.record(replica_id, hashes)
            self._inflight[decision.request_id] = replica_id
            call = entry.stub.Generate(upstream, timeout=timeout)
            first = True
            try:
                async for response in call:
                    if first:
                        first = False
                        self.registry.prefill_done(entry, work)
                        self.metrics.ttft.observe(time.perf_counter() - started)
                        self.metrics.decisions.labels(replica_id).inc()
                    if response.WhichOneof("kind") == "complete":
                        predicted = self.predicted_cached_tokens(decision, replica_id)
                        response.complete.predicted_cached_tokens = predicted
                        response.complete.router_decision_us = int(decision.decision_s * 1e6)
                        self.metrics.predicted_cached.inc(predicted)
                        self.metrics.actual_cached.inc(response.complete.usage.cached_tokens)
                        self.metrics.prompt_tokens.inc(response.complete.usage.prompt_tokens)
                    yield response
                return
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # our caller went away
                # Nobody cancelled us: the call's channel was closed under it. Re-raising would
                # end the handler as "cancelled" and gRPC would send the client no status at all.
                code, details = grpc.StatusCode.UNAVAILABLE, "connection to the replica was closed"
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details()
            finally:
                call.cancel()  # no-op when finished; aborts upstream when the client went away
                self.registry.end(entry, work)
                self._inflight.pop(decision.request_id, None)
            retryable = code in _FAILOVER_CODES or code == grpc.StatusCode.RESOURCE_EXHAUSTED
            if code in _FAILOVER_CODES:
                self.registry.mark_failed(replica_id)
            if first and retryable and attempt == 0 and len(decision.ranked) > 1:
                self.metrics.retries.inc()
                log.warning(
                    "replica failed before streaming, retrying elsewhere", extra={"replica_id": replica_id}
                )
                continue
            raise upstream_error(code, details)
        raise Unavailable("no replica could take the request")

    async def abort(self, request_id: str) -> bool:
        replica_id = self._inflight.get(request_id)
        entry = self.registry.entries.get(replica_id) if replica_id else None
        if entry is None:
            return False
        try:
            reply = await entry.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=5)
        except grpc.aio.AioRpcError as exc:
            raise upstream_error(exc.code(), exc.details()) from None
        return reply.found


__all__ = ["Decision", "ModelInfo", "RouterCore", "RouterError", "RouterLimits"]
