"""Where a request goes: validate -> tokenize -> hash -> ONE index lookup (merged with the
speculative entries) -> the policy ranks the live replicas."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.kvcache import block_hashes
from kvmesh.kvcache.index.api import IndexView, PrefixIndex
from kvmesh.kvcache.index.redis import INDEX_ERRORS
from kvmesh.protos import pb
from kvmesh.router.config import RouterLimits
from kvmesh.router.flow import FlowConfig
from kvmesh.router.index_trust.predictions import Prediction
from kvmesh.router.index_trust.states import IndexTrustConfig
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.policies import POLICIES, SATURATION_STEPS, Policy, ReplicaState, RouteRequest, make_policy
from kvmesh.router.registry import ReplicaRegistry
from kvmesh.router.speculative import SpeculativeOverlay
from kvmesh.serving import tracing
from kvmesh.serving.admission import admit
from kvmesh.serving.errors import InvalidRequest, Unavailable
from kvmesh.serving.generation_config import GenerationDefaults
from kvmesh.serving.model_info import ModelInfo
from kvmesh.serving.prompt import prompt_ids
from kvmesh.serving.request_ids import new_request_id
from kvmesh.serving.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)
# A request's load estimate counts at most this many decode tokens: a chat that leaves
# max_tokens unset may run to the end of the context (tens of thousands of tokens), but
# answers rarely do, and one such request must not look like a hundred to the policy.
DECODE_ESTIMATE_CAP_TOKENS = 1024


@dataclass
class Decision:
    """Where a request goes and why (for the relay, metrics and experiments)."""

    request_id: str  # the router's own (the client's id is only echoed back)
    token_ids: list[int]
    block_hashes: list[int]
    sampling: pb.SamplingParams  # every default filled in: what the replica runs
    ranked: list[str]
    matched: dict[str, int]  # replica -> blocks the policy saw it hold (trusted index + speculative)
    policy: str
    decision_s: float
    index_matched: dict[str, int] = field(default_factory=dict)  # what the index said, trusted or not
    speculative_matched: dict[str, int] = field(default_factory=dict)  # what this router's entries said
    tiered_matched: dict[str, int] = field(default_factory=dict)  # the index's, counting host tiers
    branch: str = ""  # why the first choice came first
    index_read: bool = True  # False: the lookup failed, so no prediction says anything of the index
    served_tokens: int | None = None  # prompt and output tokens its replica reported (its usage)
    states: list[ReplicaState] = field(default_factory=list)  # the live replicas as it saw them

    @property
    def checks_index(self) -> bool:
        """Whether this request's reuse tests the index: it was read, and the replica will try
        its prefix cache (prompt log-probabilities bypass it)."""
        return self.index_read and not self.sampling.HasField("prompt_logprobs")

    @property
    def first_block_hash(self) -> int:
        """What the replica checks its own hashing against (0: no full block)."""
        return self.block_hashes[0] if self.block_hashes else 0

    @property
    def decode_estimate(self) -> int:
        """Decode tokens to expect: max_tokens (capped) for each of the n choices."""
        n = self.sampling.n if self.sampling.HasField("n") else 1
        return min(self.sampling.max_tokens, DECODE_ESTIMATE_CAP_TOKENS) * n

    def prediction(self, replica_id: str, incarnation: int, block_size: int) -> Prediction:
        """What ``replica_id`` should reuse, in blocks (never the prompt's last block, which a
        replica always computes), with the fleet's best for comparison. A host tier's blocks
        count where they continue what the replica holds on its device (a replica restores
        them before its prefill)."""
        lookable = (len(self.token_ids) - 1) // block_size
        index = min(self.index_matched.get(replica_id, 0), lookable)
        speculative = min(self.speculative_matched.get(replica_id, 0), lookable)
        device = max(index, speculative)
        tiered = min(self.tiered_matched.get(replica_id, 0), lookable)
        host = max(0, tiered - device)
        best = max(
            (*self.index_matched.values(), *self.speculative_matched.values(), *self.tiered_matched.values()),
            default=0,
        )
        return Prediction(
            replica_id, incarnation, min(best, lookable), index, speculative, device + host, host
        )


@dataclass(frozen=True)
class RoutingOptions:
    """How a router decides and what it lets in, from its config (``RouterCore`` and
    ``Decider`` take this one object instead of a list of positional settings)."""

    policy: str = "prefix"  # for requests that name none
    limits: RouterLimits = field(default_factory=RouterLimits)
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)  # the model's sampling defaults
    lookup_timeout_s: float = 0.25  # an index lookup slower than this routes by load alone
    speculative_ttl_s: float = 2.0  # how long this router's own speculative entries last
    index_trust: IndexTrustConfig = field(default_factory=IndexTrustConfig)
    saturation_steps: float = SATURATION_STEPS  # the prefix policy's (``PrefixAware``)
    flow: FlowConfig = field(default_factory=FlowConfig)  # tenants, bands, when the fleet is saturated


class Decider:
    def __init__(
        self,
        model: ModelInfo,
        tokenizer: PromptTokenizer | None,
        sources: tuple[PrefixIndex, ReplicaRegistry, SpeculativeOverlay],
        metrics: RouterMetrics,
        options: RoutingOptions,
        untrusted: Callable[[], set[str]] = set,
    ):
        """``sources``: what a decision reads (the index, the live replicas, this router's
        speculative entries)."""
        self.model = model
        self.untrusted = untrusted  # replicas whose index entries the router ignores (LOAD_ONLY)
        self.defaults = options.defaults
        self.tokenizer = tokenizer
        self.index, self.registry, self.overlay = sources
        self.metrics = metrics
        self.limits = options.limits
        self.lookup_timeout_s = options.lookup_timeout_s
        self.policies: dict[str, Policy] = {}
        self.saturation_steps = options.saturation_steps
        self.default_policy = self.policy(options.policy).name
        self._index_warned = False

    def known_policy(self, name: str) -> str:
        """A policy name fit for a metric label: a known one, else "unknown" (a client's
        made-up name never becomes a series of its own)."""
        return name if name in POLICIES else "unknown" if name else self.default_policy

    def policy(self, name: str) -> Policy:
        if name not in self.policies:
            self.policies[name] = make_policy(
                name, block_size=self.model.block_size, saturation_steps=self.saturation_steps
            )
        return self.policies[name]

    async def prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        self.limits.inputs.check(request)
        return await prompt_ids(request, self.tokenizer, self.model.vocab_size)

    async def validate(self, request: pb.GenerateRequest) -> tuple[list[int], pb.SamplingParams, str]:
        """(prompt ids, resolved sampling, policy name); NotFound for another model's request,
        InvalidRequest with the reason for a bad one."""
        self.model.check_named(request.model)
        ids = await self.prompt_ids(request)
        try:
            policy = self.policy(request.policy or self.default_policy).name
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="policy") from None
        sampling, _ = admit(
            request,
            len(ids),
            self.model,
            self.defaults,
            self.limits.max_prompt_tokens,
            self.limits.max_tokens,
        )
        return ids, sampling, policy

    async def lookup(self, hashes: list[int]) -> IndexView | None:
        """What the index says of this prompt in one call: the replicas' matches and, with
        shared load, the routers' speculative matches and every router's in-flight work
        (``fleet`` None without it: the policy then reads this router's own counts and
        speculative entries). None when Redis is away or slow (logged once per outage)."""
        shared = self.registry.fleet is not None and self.registry.fleet.active
        if not hashes and not shared:
            return IndexView({}, {}, None)  # no full block: nothing to look up
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.lookup_timeout_s):  # no task per lookup, unlike wait_for
                if shared:
                    view = await self.index.routing_view(hashes)
                else:
                    view = IndexView(await self.index.lookup(hashes), {}, None)
        except INDEX_ERRORS as exc:
            self.metrics.index_errors.inc()
            if not self._index_warned:
                slow = isinstance(exc, TimeoutError)
                error = str(exc) or (
                    f"no answer in {self.lookup_timeout_s} s" if slow else type(exc).__name__
                )
                log.warning("prefix index lookup failed: routing by load only", extra={"error": error})
                self._index_warned = True
            return None
        self._index_warned = False
        self.metrics.lookup.observe(time.perf_counter() - start)
        return view

    async def decide(self, request: pb.GenerateRequest, trace: object = None) -> Decision:
        """``trace``: the request's span, parent of the tokenize, lookup and decision spans."""
        start = time.perf_counter()
        with tracing.span("kvmesh.router.tokenize", trace):
            ids, sampling, policy_name = await self.validate(request)
            hashes = block_hashes(ids, self.model.block_size, self.model.hash_seed)
        if not self.registry.live():
            raise Unavailable("no live replica")
        with tracing.span("kvmesh.router.index_lookup", trace, blocks=len(hashes)):
            view = await self.lookup(hashes)
        index_matched = view.matched if view else {}
        fleet = view.fleet if view else None
        speculative = self.overlay.matched(hashes)  # this router's own, then every router's
        for rid, depth in (view.speculative if view else {}).items():
            speculative[rid] = max(speculative.get(rid, 0), depth)
        untrusted = self.untrusted()
        matched = {rid: depth for rid, depth in index_matched.items() if rid not in untrusted}
        for rid, depth in speculative.items():
            matched[rid] = max(matched.get(rid, 0), depth)
        tiered = {rid: depth for rid, depth in (view.tiered if view else {}).items() if rid not in untrusted}
        states = self.registry.states(matched, fleet, tiered)
        if not states:
            raise Unavailable("no live replica")
        decision = Decision(
            new_request_id(), ids, hashes, sampling, [], matched, policy_name, 0.0, index_matched, speculative
        )
        decision.tiered_matched = view.tiered if view else {}
        decision.index_read, decision.states = view is not None, states
        route = RouteRequest(ids, hashes, decision.decode_estimate, request.affinity_key)
        policy = self.policy(policy_name)
        with tracing.span("kvmesh.router.decision", trace, policy=policy_name) as span:
            decision.ranked = policy.rank(route, states)
            decision.branch = policy.branch(route, states, decision.ranked[0])
            tracing.set_attributes(span, replica_id=decision.ranked[0], branch=decision.branch)
        self.metrics.branches.labels(policy_name, decision.branch).inc()
        decision.decision_s = time.perf_counter() - start
        self.metrics.decision.observe(decision.decision_s)
        return decision
