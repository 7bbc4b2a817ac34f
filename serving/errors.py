"""Errors a client can act on, with their gRPC status and HTTP code."""

from __future__ import annotations

import grpc

ECHO_CHARS = 64  # of a client's value, at most, in an error message or a log line


def shown(value: object) -> str:
    """A client's value as a message may quote it: its repr (newlines and control characters
    escaped, so it cannot forge a log line), cut to its first ``ECHO_CHARS`` characters with
    the full length after, so a huge value is neither sent back whole nor logged whole."""
    if isinstance(value, str):
        head = repr(value[:ECHO_CHARS])
        return head if len(value) <= ECHO_CHARS else f"{head}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS]}... ({len(text)} characters)"


class ServingError(Exception):
    """A request that cannot be served, with the status a gRPC client and an HTTP client get."""

    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param  # the request field at fault, when one is (OpenAI's error "param")


class InvalidRequest(ServingError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class NotFound(ServingError):
    """A model this server does not serve (OpenAI answers an unknown model with 404)."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class Unavailable(ServingError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class Overloaded(ServingError):
    """``retry_after_s``: when the client may try again (HTTP's Retry-After), if known."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429

    def __init__(self, message: str, param: str | None = None, retry_after_s: float | None = None):
        super().__init__(message, param)
        self.retry_after_s = retry_after_s


class RequestFailed(ServingError):
    """This request failed where it ran and ended alone: the requests beside it went on, and
    its replica stays in service (the router neither retries it nor cools the replica down)."""


class DeadlineExceeded(ServingError):
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


def upstream_error(code: grpc.StatusCode, details: str) -> ServingError:
    """A replica's error, passed on with its code and message."""
    cls = {
        grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
        grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
        grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
        grpc.StatusCode.INTERNAL: RequestFailed,
        grpc.StatusCode.UNKNOWN: RequestFailed,
    }.get(code, Unavailable)
    return cls(f"replica error ({code.name}): {details}")
