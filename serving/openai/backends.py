"""What the OpenAI front end serves from: each model's backend (the router's ``RouterCore``,
or a replica's engine backend) and the set of models a server holds (``OneModel`` for a
replica; the router's ``ModelRoutes``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from kvmesh.protos import pb
from kvmesh.serving.admission import Ticket
from kvmesh.serving.http_server import DirectBody
from kvmesh.serving.limits import InputLimits
from kvmesh.serving.model_info import ModelInfo
from kvmesh.serving.tokenizer import PromptTokenizer


class OpenAIBackend(Protocol):
    """What the front end serves from (the router's RouterCore, or a replica's EngineBackend)."""

    model: ModelInfo
    tokenizer: PromptTokenizer | None
    inputs: InputLimits

    def admit(self, count: int = 1, policy: str = "") -> Ticket: ...

    async def prompt_ids(self, request: pb.GenerateRequest) -> list[int]: ...

    def generate(
        self, request: pb.GenerateRequest, trace: object = None
    ) -> AsyncIterator[pb.GenerateResponse]: ...

    def render_metrics(self) -> bytes: ...

    relays_sse: bool  # True: one-prompt streams go through ``generate_sse`` (the router's relay)


class SseRelayBackend(OpenAIBackend, Protocol):
    """A backend that streams a one-prompt request's SSE from elsewhere, byte for byte."""

    def generate_sse(
        self,
        request: pb.GenerateRequest,
        chat: bool,
        body: bytes,
        trace: object = None,
        direct: Callable[[], DirectBody | None] | None = None,
    ) -> AsyncIterator[bytes]:
        """``direct``: the response's ``DirectBody`` once its headers went out (None where the
        server offers none), for the stream to splice into instead of yielding each event."""
        ...


class ServedModels(Protocol):
    """What a front end serves: each model's backend, found by the name a request gives."""

    def backend(self, name: str | None) -> OpenAIBackend:
        """The backend of model ``name`` (a served name or id; none: the only model's);
        NotFound for a model not served here."""
        ...

    def serving(self) -> list[OpenAIBackend]:
        """The models clients can use now (/v1/models)."""
        ...

    def render_metrics(self) -> bytes: ...


class OneModel:
    """A server of one model (a replica): its backend answers to its served name, its id, or none."""

    def __init__(self, backend: OpenAIBackend):
        self._backend = backend

    def backend(self, name: str | None) -> OpenAIBackend:
        self._backend.model.check_named(name)
        return self._backend

    def serving(self) -> list[OpenAIBackend]:
        return [self._backend]

    def render_metrics(self) -> bytes:
        return self._backend.render_metrics()
