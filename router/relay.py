"""Relay a decided request to its replica and stream the answer back, failing over once,
and moving a stream whose replica failed midway to another (a migration).

Each attempt is accounted for where it happens: the chosen replica's load and the prompt's
speculative entries at the start, the prefill paid off at the first response, the
prediction and the replica's actual reuse on ``Complete``, the decode paid off at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

import grpc

from kvmesh.protos import pb
from kvmesh.router.decision import Decision
from kvmesh.router.index_trust.predictions import Prediction
from kvmesh.router.index_trust.watch import IndexWatch
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.registry import ReplicaEntry, ReplicaRegistry
from kvmesh.router.replica_http import ReplicaHttpError
from kvmesh.router.replica_load import RequestWork
from kvmesh.router.speculative import SpeculativeOverlay
from kvmesh.serving import tracing
from kvmesh.serving.errors import Unavailable, upstream_error
from kvmesh.serving.http_server import DirectBody
from kvmesh.serving.openai.relay import (
    SseRequest,
    http_failure,
    take_failure,
    take_token_lines,
    take_trailer,
    whole_events,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
# The code that says the replica (not the request) failed: it is cooled down, and the request
# may move. INTERNAL and UNKNOWN are the request's own failure on a replica that goes on
# serving: moving it would fail it again elsewhere and cool down every replica it touched.
REPLICA_FAILURE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
RETRYABLE_CODES = REPLICA_FAILURE_CODES | {grpc.StatusCode.RESOURCE_EXHAUSTED}


def failover_targets(ranked: list[str]) -> list[str]:
    """The retry rule: the policy's first choice, then its second, never more.

    A request whose replica fails before sending anything (unreachable, crashed, gone
    silent, its channel closed, its queue full) moves once, to the next-ranked replica. One retry
    bounds what a failing replica adds to a request's latency to one more attempt and keeps
    a failure from multiplying load across the fleet; the failed replica is cooled down in
    the registry, so the following requests skip it already. A request that has streamed
    moves only as a migration (``Relay._moved``): its client has seen tokens.
    """
    return ranked[:2]


def why_not_migratable(sampling: pb.SamplingParams, chat: bool = True) -> str | None:
    """Why a stream cannot continue on another replica (None: it can). Its choices would
    have to move together, its prompt's log-probabilities would be sent again, and an
    OpenAI completion's log-probabilities count text offsets from the stream's start."""
    if sampling.HasField("n") and sampling.n > 1:
        return "n > 1"
    if sampling.HasField("prompt_logprobs"):
        return "prompt_logprobs"
    if not chat and sampling.HasField("logprobs"):
        return "logprobs of a completion"
    return None


class FailedInBand(Exception):
    """A relayed stream the replica ended with an error event (its client has it already):
    the request failed, though nothing is left to send."""


class _AttemptFailed(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, streamed: bool):
        super().__init__(details)
        self.code, self.details, self.streamed = code, details, streamed


class _StreamCut(Exception):
    """A replica failed a stream after it had sent tokens: it may move (``_moved``)."""

    def __init__(self, failed: _AttemptFailed, replica_id: str):
        super().__init__(failed.details)
        self.failed, self.replica_id = failed, replica_id


class _Moves:
    """One stream's migrations: the tokens that reached its client, the replicas it tried."""

    def __init__(self, why_not: str | None, lines: bool = False):
        self.why_not = why_not  # None: it may move
        self.lines = lines  # its SSE events start with their token ids (``take_token_lines``)
        self.sent: list[int] = []  # this attempt's tokens the client has (moved ones are in the prompt)
        self.tried: set[str] = set()
        self.count = 0


class Relay:
    def __init__(
        self,
        registry: ReplicaRegistry,
        overlay: SpeculativeOverlay,
        metrics: RouterMetrics,
        block_size: int,
        watch: IndexWatch | None = None,
        migration_limit: int = 1,
    ):
        self.watch = watch  # checks each prediction against the replica's answer
        self.migration_limit = migration_limit  # moves a stream may make (0: a cut stream fails)
        self.registry = registry
        self.overlay = overlay
        self.metrics = metrics
        self.block_size = block_size
        self.inflight: dict[str, str] = {}  # request id -> replica id, for Abort

    async def stream(
        self, decision: Decision, started: float, timeout: float | None, trace: object = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The replica's responses, the prediction added to ``Complete``; a stream cut midway
        goes on on another replica (``_moved``). Raises ServingError."""
        upstream = pb.GenerateRequest(
            request_id=decision.request_id,
            token_ids=pb.TokenIds(ids=decision.token_ids),
            sampling=decision.sampling,
        )
        moves = _Moves(why_not_migratable(decision.sampling))

        def attempt(entry: ReplicaEntry, number: int) -> AsyncIterator[pb.GenerateResponse]:
            moves.tried.add(entry.record.replica_id)
            return self._grpc_attempt(upstream, decision, entry, started, timeout, trace, number)

        while True:
            try:
                failover = self._failover(decision, attempt, moves.tried if moves.count else ())
                async with contextlib.aclosing(failover) as responses:
                    async for response in responses:
                        if response.WhichOneof("kind") == "chunk" and moves.why_not is None:
                            moves.sent.extend(response.chunk.token_ids)
                            if moves.count:
                                response.chunk.prompt_tokens = 0  # the client has the prompt's length
                        yield response
                return
            except _StreamCut as cut:
                self._moved(decision, moves, cut)
            upstream.token_ids.ids.extend(moves.sent)
            upstream.continued_tokens += len(moves.sent)
            moves.sent = []

    async def stream_sse(
        self,
        decision: Decision,
        request: SseRequest,
        started: float,
        trace: object = None,
        direct: Callable[[], DirectBody | None] | None = None,
    ) -> AsyncIterator[bytes]:
        """The replica's own OpenAI SSE bytes, as the client gets them (whole events; the
        replica's trailer for the router taken out). Raises ServingError. Once a block went
        out (the client's response has begun), the events go straight from the replica's
        connection to the client's where ``direct`` gives it (``_Connection.splice``), and
        this wakes only for the trailer, the end, or a client that must drain first. A
        migratable request's events carry their token ids, so it is read here to its end and
        moves when its replica fails midway (``_moved``)."""
        moves = _Moves(None if request.migratable else "its events carry no token ids", request.migratable)
        if request.migratable:
            direct = None
        began = False  # a block went out
        while True:
            opened = await self._open_sse(decision, request, started, trace, moves)
            try:
                async for block in self._read_sse(decision, opened, moves, began, direct):
                    yield block
                    began = True
                return
            except _StreamCut as cut:
                self._moved(decision, moves, cut)
            request, moves.sent = request.continued(moves.sent), []

    async def _open_sse(
        self, decision: Decision, request: SseRequest, started: float, trace: object, moves: _Moves
    ) -> tuple[ReplicaEntry, object, RequestWork, Prediction, object]:
        """The first candidate that takes the request (failing over once), its answer begun."""
        for number, entry, last in self._candidates(decision, moves.tried if moves.count else ()):
            moves.tried.add(entry.record.replica_id)
            try:
                return (entry, *await self._open_http(request, decision, entry, started, trace, number))
            except _AttemptFailed as failed:
                self._after_failure(decision, entry.record.replica_id, failed, last)
        raise Unavailable("no replica could take the request")

    async def _read_sse(
        self,
        decision: Decision,
        opened: tuple[ReplicaEntry, object, RequestWork, Prediction, object],
        moves: _Moves,
        began: bool,
        direct: Callable[[], DirectBody | None] | None,
    ) -> AsyncIterator[bytes]:
        entry, conn, work, prediction, span = opened
        outcome, carry, completed = "error", b"", False
        client = None  # the client's DirectBody, once spliced into
        try:
            while (data := await conn.read()) is not None:
                if not data:  # CLIENT_FULL: reading from the replica stopped until the client drains
                    await client.drain()
                    conn.resume()
                    continue
                block, carry = whole_events(carry + data if carry else data)
                if block:
                    block, complete = take_trailer(block)
                    if complete is not None:
                        completed = True
                        self._complete(decision, prediction, complete, span, observe=not moves.count)
                    failed = None
                    if moves.lines:
                        block, ids = take_token_lines(block)
                        block, failed = take_failure(block)
                        if ids is None:
                            moves.why_not = "the replica did not say which tokens its events held"
                        else:
                            moves.sent.extend(ids)
                    if block:
                        yield block
                        began = True
                    if failed == "UNAVAILABLE":  # its replica failed it, in band: it may move
                        raise self._cut(entry, "the replica failed the stream", began)
                if began and direct is not None and not completed and not carry:
                    client, direct = direct(), None  # asked once, after the response began
                    if client is not None:
                        conn.splice(client.write_now)
            if carry:
                yield carry
            if not completed:  # the replica ended it with an error event of its own
                raise FailedInBand
            outcome = "ok"
        except OSError as exc:  # reset, closed midway, or not HTTP
            if conn.fell_behind:  # the replica cut a stream its client did not read: not cooled down
                raise upstream_error(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "the client did not read the stream in time"
                ) from None
            raise self._cut(entry, f"connection to the replica failed: {exc}", began) from None
        finally:
            entry.http.release(conn)  # kept only when read to its end
            self._end(entry, work, decision.request_id, span, outcome)

    def _cut(self, entry: ReplicaEntry, details: str, began: bool) -> Exception:
        """What to raise for a relayed stream its replica failed (UNAVAILABLE): the replica
        cooled down; a ``_StreamCut`` that may move once a block went out, else the client's
        error."""
        self.registry.mark_failed(entry.record.replica_id)
        if began:
            return _StreamCut(
                _AttemptFailed(grpc.StatusCode.UNAVAILABLE, details, True), entry.record.replica_id
            )
        return upstream_error(grpc.StatusCode.UNAVAILABLE, details)

    async def _open_http(
        self,
        request: SseRequest,
        decision: Decision,
        entry: ReplicaEntry,
        started: float,
        trace: object,
        attempt: int,
    ) -> tuple[object, RequestWork, Prediction, object]:
        """The request sent, the replica's answer begun (its first token is ready)."""
        if entry.http is None:  # joined without an HTTP port since the front end chose to relay
            raise _AttemptFailed(grpc.StatusCode.UNAVAILABLE, "the replica serves no HTTP", False)
        work, prediction, span = self._begin(entry, decision, trace, attempt)
        body = request.envelope(prediction.predicted, decision.first_block_hash)
        sent_at = time.monotonic()
        try:
            conn = await entry.http.post(request.path, body, (*entry.auth, *tracing.inject(span)))
        except BaseException as exc:
            self._end(entry, work, decision.request_id, span, "error")
            if isinstance(exc, ReplicaHttpError):
                raise _AttemptFailed(*http_failure(exc.status, exc.body), False) from None
            if isinstance(exc, OSError):  # unreachable, reset, or not HTTP
                raise _AttemptFailed(
                    grpc.StatusCode.UNAVAILABLE, f"connection to the replica failed: {exc}", False
                ) from None
            raise
        self.metrics.relayed.inc()
        self._first_response(entry, work, started, span, sent_at)
        return conn, work, prediction, span

    async def _failover(
        self,
        decision: Decision,
        attempt: Callable[[ReplicaEntry, int], AsyncIterator[T]],
        tried: set[str] | tuple = (),
    ) -> AsyncIterator[T]:
        for number, entry, last in self._candidates(decision, tried):
            try:
                # aclosing: when our caller stops reading (an HTTP client went away), the
                # attempt's cleanup (cancel the upstream call, release the load) runs now.
                async with contextlib.aclosing(attempt(entry, number)) as out:
                    async for item in out:
                        yield item
                return
            except _AttemptFailed as failed:
                self._after_failure(decision, entry.record.replica_id, failed, last)
        raise Unavailable("no replica could take the request")

    def _candidates(
        self, decision: Decision, tried: set[str] | tuple = ()
    ) -> Iterator[tuple[int, ReplicaEntry, bool]]:
        """The retry rule's targets still known, past those ``tried`` already (a migration's):
        (attempt number, replica, whether it is the last)."""
        targets = failover_targets([r for r in decision.ranked if r not in tried])
        for number, replica_id in enumerate(targets):
            entry = self.registry.entries.get(replica_id)
            if entry is not None:  # else gone from the index since the decision
                yield number, entry, number == len(targets) - 1

    def _after_failure(self, decision: Decision, replica_id: str, failed: _AttemptFailed, last: bool) -> None:
        """A failed replica cooled down; the client's error raised unless the request may
        move (nothing streamed, a retryable code, a next choice left)."""
        if failed.code in REPLICA_FAILURE_CODES:
            self.registry.mark_failed(replica_id)
            if failed.streamed:
                raise _StreamCut(failed, replica_id)
        if failed.streamed or failed.code not in RETRYABLE_CODES or last:
            raise upstream_error(failed.code, failed.details) from None
        self.metrics.retries.inc()
        self.metrics.branches.labels(decision.policy, "failover").inc()
        log.warning("replica failed before streaming, retrying elsewhere", extra={"replica_id": replica_id})

    def _moved(self, decision: Decision, moves: _Moves, cut: _StreamCut) -> None:
        """A cut stream about to continue elsewhere, counted and logged; the client's error
        raised instead where it may not move (the limit, its kind, or no replica left)."""
        if not self.migration_limit:
            raise upstream_error(cut.failed.code, cut.failed.details) from None
        why_not = moves.why_not
        if why_not is None and moves.count >= self.migration_limit:
            why_not = f"it moved {moves.count} time(s), the limit"
        if why_not is None and not [r for r in decision.ranked if r not in moves.tried]:
            why_not = "no other replica"
        if why_not is not None:
            self.metrics.migrations.labels("refused").inc()
            raise upstream_error(cut.failed.code, f"{cut.failed.details} (not moved: {why_not})") from None
        moves.count += 1
        self.metrics.migrations.labels("moved").inc()
        log.warning(
            "stream cut midway, moving it to another replica",
            extra={"replica_id": cut.replica_id, "tokens_sent": len(moves.sent), "move": moves.count},
        )

    async def _grpc_attempt(
        self,
        upstream: pb.GenerateRequest,
        decision: Decision,
        entry: ReplicaEntry,
        started: float,
        timeout: float | None,
        trace: object,
        attempt: int,
    ) -> AsyncIterator[pb.GenerateResponse]:
        work, prediction, span = self._begin(entry, decision, trace, attempt)
        upstream.predicted_cached_blocks = prediction.predicted
        upstream.first_block_hash = decision.first_block_hash
        call = entry.stub.Generate(upstream, timeout=timeout, metadata=(*entry.auth, *tracing.inject(span)))
        streamed, sent_at, outcome = False, time.monotonic(), "error"
        try:
            async for response in call:
                if not streamed:
                    streamed = True
                    self._first_response(entry, work, started, span, sent_at)
                if response.WhichOneof("kind") == "complete" and response.complete.index == 0:
                    self._complete(
                        decision, prediction, response.complete, span, not upstream.continued_tokens
                    )
                yield response
            outcome = "ok"
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # our caller went away
            # Nobody cancelled us: the call's channel was closed under it (the replica went
            # silent, say). Re-raising would end the handler as "cancelled", and gRPC would
            # then send the client no status at all.
            why = entry.closed_because or "connection to the replica was closed"
            raise _AttemptFailed(grpc.StatusCode.UNAVAILABLE, why, streamed) from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                # Not ours (ours raises CancelledError above): the replica's server cancelled
                # it, as gRPC does to a call that reaches a server in the instant it stops.
                raise _AttemptFailed(
                    grpc.StatusCode.UNAVAILABLE, f"the replica cancelled the call: {exc.details()}", streamed
                ) from None
            raise _AttemptFailed(exc.code(), exc.details(), streamed) from None
        finally:
            call.cancel()  # no-op when finished; aborts upstream when the client went away
            self._end(entry, work, decision.request_id, span, outcome)

    # ------------------------------------------------------------------ accounting

    def _begin(
        self, entry: ReplicaEntry, decision: Decision, trace: object, attempt: int
    ) -> tuple[RequestWork, Prediction, object]:
        """The replica owes this request its prefill and decode; it will hold the prompt's blocks."""
        rid = entry.record.replica_id
        matched = decision.matched.get(rid, 0)
        work = RequestWork.estimate(
            len(decision.block_hashes), matched, decision.decode_estimate, self.block_size
        )
        self.registry.begin(entry, work)
        self.overlay.record(rid, decision.block_hashes)
        if self.registry.fleet is not None:  # every other router learns it through the index
            self.registry.fleet.speculate(rid, decision.block_hashes)
        self.inflight[decision.request_id] = rid
        prediction = decision.prediction(rid, entry.record.incarnation, self.block_size)
        span = tracing.start(
            "kvmesh.router.relay",
            trace,
            replica_id=rid,
            attempt=attempt,
            predicted_cached_tokens=prediction.predicted * self.block_size,
        )
        return work, prediction, span

    def _first_response(
        self, entry: ReplicaEntry, work: RequestWork, started: float, span: object, sent_at: float
    ) -> None:
        self.registry.prefill_done(entry, work)
        self.metrics.ttft.observe(time.perf_counter() - started)
        self.metrics.decisions.labels(entry.record.replica_id).inc()
        tracing.record_phases(span, [("kvmesh.router.first_token", sent_at, time.monotonic())])

    def _complete(
        self, decision: Decision, prediction: Prediction, complete: pb.Complete, span: object, observe: bool
    ) -> None:
        """Predicted next to actual reuse: index accuracy, per request and in the metrics
        (the first choice's: the others of an n > 1 request reuse its prefill). ``observe``:
        whether the index watch learns from it (not from a moved stream's longer prompt)."""
        cause = None
        if self.watch is not None and decision.checks_index and observe:
            cause = self.watch.observe(prediction, complete)
        predicted = prediction.predicted * self.block_size
        decision.served_tokens = complete.usage.prompt_tokens + complete.usage.completion_tokens
        complete.predicted_cached_tokens = predicted
        complete.predicted_host_cached_tokens = prediction.host * self.block_size
        self.metrics.fleet_best_cached.inc(prediction.fleet_best * self.block_size)
        complete.router_decision_us = int(decision.decision_s * 1e6)
        self.metrics.predicted_cached.inc(predicted)
        self.metrics.actual_cached.inc(complete.usage.cached_tokens)
        self.metrics.predicted_host_cached.inc(prediction.host * self.block_size)
        self.metrics.actual_host_cached.inc(complete.usage.host_cached_tokens)
        self.metrics.prompt_tokens.inc(complete.usage.prompt_tokens)
        tracing.set_attributes(span, actual_cached_tokens=complete.usage.cached_tokens, miss_cause=cause)

    def _end(
        self, entry: ReplicaEntry, work: RequestWork, request_id: str, span: object, outcome: str
    ) -> None:
        self.registry.end(entry, work)
        self.inflight.pop(request_id, None)
        tracing.end(span, outcome=outcome)
