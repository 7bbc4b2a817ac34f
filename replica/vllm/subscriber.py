"""Follows one vLLM engine's KV event stream over ZeroMQ, in order and without gaps.

vLLM publishes each batch as three frames: topic, an 8-byte big-endian sequence number and
a msgpack payload, and keeps the last batches for replay behind a ROUTER socket (ask with
an empty frame and the first sequence number wanted; the answer ends with sequence -1).
Both endpoints are ipc sockets in a private folder, bound by vLLM: no TCP port is opened.

A sequence gap (a batch dropped at a full queue, or sent before this socket connected) is
filled from the replay buffer. When the buffer no longer holds what was missed, or a stored
block's parent is unknown, the view cannot be trusted: ``rebuild`` replays everything vLLM
still holds from its first batch, and where that is gone too, the caller resets vLLM's
prefix cache, so that an empty view is exact again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgpack
import zmq
import zmq.asyncio

from kvmesh.kvcache import KVEvent
from kvmesh.replica.vllm.cache_view import BrokenChain, CacheView, EventFormatError, decode_batch

log = logging.getLogger(__name__)
END_SEQ = 2**64 - 1  # the replay's end marker: -1 as 8 unsigned big-endian bytes
REPLAY_TIMEOUT_S = 10.0


class ViewLost(Exception):
    """The view misses events that cannot be replayed: it is not vLLM's cache."""


class EventSubscriber:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        view: CacheView,
        on_events: Callable[[list[KVEvent]], None],
        on_lost: Callable[[str], None],
    ):
        """``on_events``: kvmesh events, in order, as batches apply; ``on_lost``: why the view
        had to be dropped (the caller publishes the cleared view and resets vLLM's cache)."""
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.view = view
        self.on_events, self.on_lost = on_events, on_lost
        self.next_seq = 0  # the batch expected next
        self.lost: str | None = None  # why the view is not vLLM's cache, until vLLM clears it
        self.batches = 0  # batches applied, replays included
        self.gaps = 0  # gaps filled from the replay buffer
        # Fault injection: the next batches holding stored blocks lose those events unseen (a
        # count, so arming twice before the first batch comes loses two, whatever the timing).
        self.drop_stored_batches = 0
        self.skip_next_batch = False  # fault injection: one batch never arrives (a gap)
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 0)  # never drop here: vLLM's own queue is bounded
        self._sub.connect(endpoint)
        self._lock = asyncio.Lock()  # one of: a live batch, a replay

    async def run(self) -> None:
        """Apply batches as they come, until cancelled."""
        while True:
            _, seq_bytes, payload = await self._sub.recv_multipart()
            if self.skip_next_batch:
                self.skip_next_batch = False
                continue
            async with self._lock:
                seq = int.from_bytes(seq_bytes, "big")
                if seq < self.next_seq:
                    continue  # already applied from a replay
                if seq > self.next_seq:
                    self.gaps += 1
                    try:
                        await self._replay(self.next_seq, until=seq)
                    except ViewLost as exc:
                        self._lose(str(exc))
                self._apply_one(seq, payload)

    async def rebuild(self) -> bool:
        """Rebuild the view from every batch vLLM still holds (a resync: the index may lie
        about this replica); False, and the view dropped, when its replay buffer no longer
        starts at batch 0."""
        async with self._lock:
            self.view.clear()
            latest, self.next_seq, self.lost = self.next_seq, 0, None
            try:
                await self._replay(0, until=None)
            except ViewLost as exc:
                self.next_seq = max(self.next_seq, latest)
                self._lose(str(exc))
                return False
            return self.lost is None

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()

    def _apply_one(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        self.batches += 1
        try:
            events = decode_batch(msgpack.unpackb(payload, raw=False, strict_map_key=False))
            if self.drop_stored_batches:
                kept = [e for e in events if e["type"] != "BlockStored"]
                self.drop_stored_batches -= len(kept) < len(events)
                events = kept
            if any(e["type"] == "AllBlocksCleared" for e in events):
                self.lost = None  # vLLM holds nothing now: an empty view is exact
            self.on_events(self.view.apply(events))
        except BrokenChain as exc:
            if self.lost is None:  # while lost, blocks of chains begun before are unknown
                self._lose(str(exc))
        except (EventFormatError, ValueError) as exc:
            self._lose(str(exc))

    def _lose(self, why: str) -> None:
        """Drop the view: the caller publishes it empty and has vLLM clear its cache."""
        if self.lost is None:
            log.warning("vLLM's KV events: view dropped", extra={"reason": why})
        self.lost = why
        self.view.clear()
        self.on_lost(why)

    async def _replay(self, start: int, until: int | None) -> None:
        """Apply batches ``start`` .. ``until`` - 1 (None: all held) from vLLM's replay buffer."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4:  # empty delimiter, topic, sequence, payload
                        raise ViewLost(f"a replay answer of {len(frames)} frames")
                    _, _, seq_bytes, payload = frames
                    seq = int.from_bytes(seq_bytes, "big")
                    if seq == END_SEQ:
                        break
                    if seq < self.next_seq or (until is not None and seq >= until):
                        continue
                    if seq > self.next_seq:
                        raise ViewLost(f"vLLM no longer holds batches {self.next_seq}..{seq - 1}")
                    self._apply_one(seq, payload)
        except TimeoutError:
            raise ViewLost("vLLM did not answer a replay request") from None
        finally:
            dealer.close(linger=0)
        if until is not None and self.next_seq < until:
            raise ViewLost(f"vLLM's replay ended at {self.next_seq}, short of {until}")
