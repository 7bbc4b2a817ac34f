"""Every error the OpenAI front end gives, in OpenAI's shape ``{"error": {"message", "type",
"param", "code"}}``, in a body or in band in a stream: 400 for bad input (``param`` names the
field), 401 without the token, 404 for an unknown model or path, 413 for an oversized body,
429 when overloaded, 499 when the client left, 503 when nothing can serve."""

from __future__ import annotations

import json
import math

from fastapi.responses import JSONResponse

from kvmesh.serving.errors import InvalidRequest, ServingError
from kvmesh.serving.openai.protocol import FIELD_RULES

FIELDS = frozenset(rule.name for rule in FIELD_RULES) | {"top_logprobs", "tokens"}


class ClientLeft(ServingError):
    """The client disconnected before its answer was ready (nginx's 499: nobody reads it)."""

    http_status = 499


_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "service_unavailable")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, param))


def serving_error_response(exc: ServingError) -> JSONResponse:
    response = error_response(exc.http_status, str(exc), param_of(exc))
    if getattr(exc, "retry_after_s", None):
        response.headers["retry-after"] = str(math.ceil(exc.retry_after_s))
    return response


def param_of(exc: ServingError) -> str | None:
    """The field an error is about: its own, else the request field its message starts with."""
    if exc.param or exc.http_status != 400:
        return exc.param
    message = str(exc)
    if message.startswith("replica error ("):
        message = message.split("): ", 1)[-1]
    word = message.replace(":", " ").split(" ", 1)[0]
    return word if word in FIELDS else None


def validation_error(errors: list) -> InvalidRequest:
    """A body that does not fit its model, as one 400 naming the first field at fault."""
    first = errors[0] if errors else {}
    where = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = first.get("msg", "invalid request")
    return InvalidRequest(f"{'.'.join(where)}: {message}" if where else message, where[0] if where else None)


def error_event(exc: ServingError) -> str:
    """A failure after the stream began, in band, in OpenAI's error shape."""
    return f"data: {json.dumps(error_body(exc.http_status, str(exc), param_of(exc)))}\n\n"
