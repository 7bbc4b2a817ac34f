"""The router-to-replica leg of a streamed OpenAI request relayed byte for byte: what the
router sends (an envelope around the client's own body) and what the replica adds to its
stream for the router alone (one trailer event with the request's ``Complete``).

The router has tokenized and hashed the prompt already, so the envelope carries its token
ids (the replica does not tokenize or render it again), its own request id, the model name
the client sees, and the prediction the replica checks (``predicted_cached_blocks``,
``first_block_hash``). The replica streams exactly what a direct client would get, plus,
before ``data: [DONE]``, an SSE comment ``: kvmesh-complete <base64 Complete>`` carrying
the index-truth fields and usage the router accounts for (an SSE comment: a client that
somehow saw it would ignore it; the router takes it out).
"""

from __future__ import annotations

import array
import base64
import binascii
import json
import sys
from dataclasses import dataclass

import grpc
from pydantic import BaseModel, Field

from kvmesh.protos import pb
from kvmesh.serving.errors import DeadlineExceeded, InvalidRequest, Overloaded, ServingError, Unavailable
from kvmesh.serving.openai.protocol import ChatRequest, CompletionRequest

RELAY_PATHS = {"chat": "/kvmesh/relay/chat", "completions": "/kvmesh/relay/completions"}
_TRAILER = b": kvmesh-complete "
_TRAILER_TEXT = _TRAILER.decode()
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
    """Token ids as the envelope carries them: base64 of little-endian uint32s. A 576-token
    prompt packs in ~10 us where writing it as a JSON list took ~90 (the router's side), and
    the replica reads it for less than it took to validate the list."""
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


class _Envelope(BaseModel):
    model: str = Field(max_length=256)
    request_id: str = Field(max_length=128)
    prompt_token_ids: str  # packed_token_ids's
    predicted_cached_blocks: int = Field(0, ge=0)
    first_block_hash: int = Field(0, ge=0, lt=1 << 64)

    def upstream(self, request: pb.GenerateRequest) -> None:
        """``request`` (planned from the client's body) as the router decided it."""
        request.request_id = self.request_id
        request.token_ids.CopyFrom(pb.TokenIds(ids=unpacked_token_ids(self.prompt_token_ids)))
        request.predicted_cached_blocks = self.predicted_cached_blocks
        request.first_block_hash = self.first_block_hash


class ChatEnvelope(_Envelope):
    request: ChatRequest


class CompletionEnvelope(_Envelope):
    request: CompletionRequest


@dataclass
class SseRequest:
    """A client's streamed request as the router relays it: the envelope, all but the
    per-replica prediction built once."""

    path: str
    head: bytes  # the envelope up to the prediction
    body: bytes  # the client's JSON body, verbatim

    @classmethod
    def of(cls, chat: bool, body: bytes, model: str, request_id: str, token_ids: list[int]) -> SseRequest:
        head = b"".join(
            (
                b'{"model":',
                json.dumps(model).encode(),
                b',"request_id":',
                json.dumps(request_id).encode(),
                b',"prompt_token_ids":"',
                packed_token_ids(token_ids),
                b'",',
            )
        )
        return cls(RELAY_PATHS["chat" if chat else "completions"], head, body)

    def envelope(self, predicted_cached_blocks: int, first_block_hash: int) -> bytes:
        prediction = b'"predicted_cached_blocks":%d,"first_block_hash":%d,"request":' % (
            predicted_cached_blocks,
            first_block_hash,
        )
        return b"".join((self.head, prediction, self.body, b"}"))


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
