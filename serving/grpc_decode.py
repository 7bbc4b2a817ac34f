"""A request message that does not decode is INVALID_ARGUMENT naming what was wrong.

grpc answers a request deserializer that raises with UNKNOWN and the exception's text, and
logs a traceback per call. Here the deserializer returns an ``Undecodable`` instead, and the
method's handler answers it before the servicer runs."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

MAX_FIELDS_WALKED = 4096  # looking for the field at fault stops there: the walk is Python's


@dataclass(frozen=True)
class Undecodable:
    """What a request deserializer returns for bytes that are not its message."""

    reason: str


class GuardedRegistrar:
    """Stands in for the server in a generated ``add_XServicer_to_server``: registers its
    methods, each with a deserializer that returns an ``Undecodable`` rather than raising and a
    handler that answers one with INVALID_ARGUMENT."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self._server.add_registered_method_handlers(service, {m: guarded(h) for m, h in handlers.items()})

    def add_generic_rpc_handlers(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h) for h in handlers))


class _GuardedGeneric(grpc.GenericRpcHandler):
    """A generic handler's methods, guarded (each once; grpc asks it only for methods that
    were not registered by name)."""

    def __init__(self, inner: grpc.GenericRpcHandler):
        self._inner = inner
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._guarded.get(details.method)
        if handler is None:
            found = self._inner.service(details)
            if found is None:
                return None
            handler = self._guarded[details.method] = guarded(found)
        return handler


def guarded(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` (one request message, an async servicer method) answering a request that
    does not decode with INVALID_ARGUMENT and the reason."""
    behaviour = handler.unary_unary or handler.unary_stream
    message = getattr(handler.request_deserializer, "__self__", None)
    if handler.request_streaming or not inspect.iscoroutinefunction(behaviour) or message is None:
        raise TypeError("only async methods taking one protobuf request message can be guarded")

    async def checked(request, context: grpc.aio.ServicerContext):
        if type(request) is Undecodable:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return await behaviour(request, context)

    make = (
        grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.unary_stream_rpc_method_handler
    )
    return make(
        checked, request_deserializer=decoder(message), response_serializer=handler.response_serializer
    )


def decoder(message: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """``message.FromString``, returning an ``Undecodable`` with the reason where it raises."""
    parse = message.FromString

    def decode(data: bytes) -> Message | Undecodable:
        try:
            return parse(data)
        except DecodeError:
            return Undecodable(why_undecodable(message.DESCRIPTOR, data))

    return decode


def why_undecodable(descriptor: Descriptor, data: bytes) -> str:
    """Why ``data`` is not a ``descriptor`` message: the string field that is not UTF-8
    (proto3 strings must be), or else a corrupt encoding."""
    field = _non_utf8_field(descriptor, data, iter(range(MAX_FIELDS_WALKED)))
    what = f"field {field} is not valid UTF-8" if field else "the protobuf encoding is corrupt"
    return f"the request is not a valid {descriptor.full_name}: {what}"


def _non_utf8_field(descriptor: Descriptor, data: bytes, budget: Iterator[int]) -> str | None:
    """The path (``chat.messages.content``) of the first string field in ``data`` that is not
    UTF-8; None where there is none, the encoding breaks first, or the budget runs out."""
    pos = 0
    try:
        while pos < len(data):
            if next(budget, None) is None:
                return None
            key, pos = _varint(data, pos)
            wire_type, field = key & 7, descriptor.fields_by_number.get(key >> 3)
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                value, pos = data[pos : pos + size], pos + size
                if field is None:
                    continue
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        value.decode()
                    except UnicodeDecodeError:
                        return field.name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    inner = _non_utf8_field(field.message_type, value, budget)
                    if inner:
                        return f"{field.name}.{inner}"
            else:
                return None  # groups, or no wire type at all
    except IndexError:
        return None
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        result |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return result, pos
        shift += 7
