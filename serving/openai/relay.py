"""The router-to-replica leg of a streamed OpenAI request relayed byte for byte: what the
router sends (an envelope around the client's own body) and what the replica adds to its
stream for the router alone (one trailer event with the request's ``Complete``).

The router has tokenized and hashed the prompt already, so the envelope carries its token
ids (the replica does not tokenize or render it again), its own request id, the model name
the client sees, and the prediction the replica checks (``predicted_cached_blocks``,
``first_block_hash``). The replica streams exactly what a direct client would get, plus,
before ``data: [DONE]``, an SSE comment ``: kvmesh-complete <base64 Complete>`` carrying
the prediction-check fields and usage the router accounts for (an SSE comment: a client that
somehow saw it would ignore it; the router takes it out). A router that may move the stream
(a migration, ``SseRequest.continued``) asks for each event's token ids as one more comment
line in that event.
"""

from __future__ import annotations

import array
import base64
import binascii
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field

import grpc
from pydantic import BaseModel, Field

from kvmesh.protos import pb
from kvmesh.serving.errors import DeadlineExceeded, InvalidRequest, Overloaded, ServingError, Unavailable
from kvmesh.serving.openai.protocol import ChatRequest, CompletionRequest

RELAY_PATHS = {"chat": "/kvmesh/relay/chat", "completions": "/kvmesh/relay/completions"}
_TRAILER = b": kvmesh-complete "
_TRAILER_TEXT = _TRAILER.decode()
_TOKENS = b": kvmesh-tokens "
_TOKENS_TEXT = _TOKENS.decode()
_JSON = {True: b"true", False: b"false"}
_FAILED = b": kvmesh-failed "
_FAILED_TEXT = _FAILED.decode()
_ERRORS = (ServingError, InvalidRequest, Overloaded, Unavailable, DeadlineExceeded)
# A replica's HTTP error status as the gRPC code the router's errors are made of: the
# serving errors' own pairs, and the statuses only the HTTP front end answers with.
_HTTP_TO_GRPC = {cls.http_status: cls.grpc_code for cls in _ERRORS} | {
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    499: grpc.StatusCode.CANCELLED,
}


_BIG_ENDIAN = sys.byteorder != "little"  # the envelope's ids are little-endian


def packed_token_ids(token_ids: list[int]) -> bytes:
    """Token ids as the envelope carries them: base64 of little-endian uint32s, packed several
    times faster than a JSON list is written (the router's side), and read by the replica for
    less than it took to validate the list."""
    packed = array.array("I", token_ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return base64.b64encode(packed.tobytes())


def unpacked_token_ids(text: str) -> list[int]:
    """``packed_token_ids``'s ids back; InvalidRequest for anything it did not write."""
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error:
        raw = None
    if raw is None or len(raw) % 4:
        raise InvalidRequest("prompt_token_ids: not base64 of uint32s", param="prompt_token_ids")
    ids = array.array("I", raw)
    if _BIG_ENDIAN:
        ids.byteswap()
    return ids.tolist()


class RelayEnvelope(BaseModel):
    """``stream_token_ids``: start each data event with the token ids it shows
    (``token_line``), so the router can continue the stream elsewhere. ``continuation``: the
    rest of a stream whose replica failed (its choice was opened already); its prompt's last
    ``continued_tokens`` ids are its output, sent before (``GenerateRequest``'s field).
    ``created``: the response's timestamp, the same on every replica it runs on."""

    model: str = Field(max_length=256)
    request_id: str = Field(max_length=128)
    prompt_token_ids: str  # packed_token_ids's
    created: int = Field(0, ge=0, lt=1 << 40)
    stream_token_ids: bool = False
    continuation: bool = False
    continued_tokens: int = Field(0, ge=0)
    predicted_cached_blocks: int = Field(0, ge=0)
    first_block_hash: int = Field(0, ge=0, lt=1 << 64)

    def upstream(self, request: pb.GenerateRequest) -> None:
        """``request`` (planned from the client's body) as the router decided it."""
        request.request_id = self.request_id
        request.token_ids.CopyFrom(pb.TokenIds(ids=unpacked_token_ids(self.prompt_token_ids)))
        request.continued_tokens = self.continued_tokens
        request.predicted_cached_blocks = self.predicted_cached_blocks
        request.first_block_hash = self.first_block_hash


class ChatEnvelope(RelayEnvelope):
    request: ChatRequest


class CompletionEnvelope(RelayEnvelope):
    request: CompletionRequest


@dataclass
class SseRequest:
    """A client's streamed request as the router relays it: the envelope, all but the
    per-replica prediction built once (``head``). ``migratable``: its events come with their
    token ids, so that ``continued`` can move it."""

    chat: bool
    body: bytes  # the client's JSON body, verbatim
    model: str
    request_id: str
    token_ids: list[int]
    migratable: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    continuation: bool = False
    continued_tokens: int = 0
    head: bytes = field(init=False, repr=False)  # the envelope up to the prediction

    def __post_init__(self) -> None:
        self.head = b"".join(
            (
                b'{"model":',
                json.dumps(self.model).encode(),
                b',"request_id":',
                json.dumps(self.request_id).encode(),
                b',"prompt_token_ids":"',
                packed_token_ids(self.token_ids),
                b'","created":%d,"stream_token_ids":%s,"continuation":%s,"continued_tokens":%d,'
                % (self.created, _JSON[self.migratable], _JSON[self.continuation], self.continued_tokens),
            )
        )

    @property
    def path(self) -> str:
        return RELAY_PATHS["chat" if self.chat else "completions"]

    def continued(self, sent: list[int]) -> SseRequest:
        """This request as it goes on elsewhere after ``sent`` (this attempt's tokens that
        reached the client): those tokens at the prompt's end, counted as output."""
        return dataclasses.replace(
            self,
            token_ids=self.token_ids + sent,
            continuation=True,
            continued_tokens=self.continued_tokens + len(sent),
        )

    def envelope(self, predicted_cached_blocks: int, first_block_hash: int) -> bytes:
        prediction = b'"predicted_cached_blocks":%d,"first_block_hash":%d,"request":' % (
            predicted_cached_blocks,
            first_block_hash,
        )
        return b"".join((self.head, prediction, self.body, b"}"))


def token_line(token_ids: list[int]) -> str:
    """An SSE comment line for the router, put at the start of the event that shows these
    tokens: one event, so the router counts tokens exactly as their event reaches the client."""
    return f"{_TOKENS_TEXT}{packed_token_ids(token_ids).decode()}\n"


def take_token_lines(block: bytes) -> tuple[bytes, list[int] | None]:
    """``block`` (whole SSE events) without its token lines, and the ids they held; None for
    the ids where a data event came without its line (a replica that does not write them:
    what its client saw is unknown)."""
    ids: list[int] | None = []
    kept, marked = [], False
    for line in block.split(b"\n"):
        if line.startswith(_TOKENS):
            if ids is not None:
                ids.extend(unpacked_token_ids(line[len(_TOKENS) :].decode()))
            marked = True
            continue
        if line.startswith(b"data: ") and not marked:
            ids = None
        if not line or line.startswith(b"data: "):  # an event's end, or its data: the mark is used
            marked = False
        kept.append(line)
    return b"\n".join(kept), ids


def failure_line(code: str) -> str:
    """An SSE comment line for the router, in the error event of a stream the replica failed:
    its gRPC code, so that the router can tell its replica's failure (UNAVAILABLE: the stream
    may move) from the request's own before the event reaches the client."""
    return f"{_FAILED_TEXT}{code}\n"


def take_failure(block: bytes) -> tuple[bytes, str | None]:
    """``block`` (whole SSE events) without its failure line, and the failure's code; where
    the code is UNAVAILABLE, the block ends before the failure's event (it is not the
    client's to see if the stream moves)."""
    at = block.find(_FAILED)
    if at < 0:
        return block, None
    end = block.find(b"\n", at)
    code = block[at + len(_FAILED) : end].decode(errors="replace")
    if code == "UNAVAILABLE":
        return block[: block.rfind(b"\n\n", 0, at) + 2], code
    return block[:at] + block[end + 1 :], code


def trailer(complete: pb.Complete) -> str:
    """The replica's last event before ``[DONE]``, for the router."""
    return f"{_TRAILER_TEXT}{base64.b64encode(complete.SerializeToString()).decode()}\n\n"


def trailer_at(block: bytes) -> int:
    """Where the trailer event starts in ``block`` (whole SSE events), -1 if it is not there.
    Matched at an event's start only: a data event's JSON cannot hold a newline, so text a
    model generates never looks like it."""
    if block.startswith(_TRAILER):
        return 0
    found = block.find(b"\n\n" + _TRAILER)
    return found + 2 if found >= 0 else -1


def take_trailer(block: bytes) -> tuple[bytes, pb.Complete | None]:
    """``block`` (whole SSE events) without the trailer, and the trailer's Complete if it
    held it."""
    at = trailer_at(block)
    if at < 0:
        return block, None
    end = block.find(b"\n\n", at)
    try:
        complete = pb.Complete.FromString(base64.b64decode(block[at + len(_TRAILER) : end]))
    except (binascii.Error, ValueError):
        complete = None
    return block[:at] + block[end + 2 :], complete


def whole_events(data: bytes) -> tuple[bytes, bytes]:
    """(the whole SSE events at the start of ``data``, the rest): an event split across two
    reads waits for its end, so the trailer is always seen whole."""
    cut = data.rfind(b"\n\n") + 2
    if cut < 2:
        return b"", data
    return (data, b"") if cut == len(data) else (data[:cut], data[cut:])


def http_failure(status: int, body: bytes) -> tuple[grpc.StatusCode, str]:
    """A replica's HTTP error as the gRPC code and message the router's errors are made of."""
    code = _HTTP_TO_GRPC.get(
        status, grpc.StatusCode.UNAVAILABLE if status >= 500 else grpc.StatusCode.UNKNOWN
    )
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = f"HTTP {status}"
    return code, str(message)
