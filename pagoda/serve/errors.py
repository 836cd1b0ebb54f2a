"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}, and in
Anthropic's for the Messages API: {"type": "error", "error": {"type", "message"}}.

Everything a client can cause is an `APIError` with a 4xx status; the app maps FastAPI's own
validation errors (422) and HTTP exceptions onto the same shape (`install_error_handlers` in
app.py) so a client never sees a 500 for its own mistake. No web framework is imported here:
the CLI imports this module's neighbours and must stay light.
"""

from __future__ import annotations

import math
from typing import Any

from pagoda.errors import InvalidRequest


class APIError(Exception):
    """An error answered to the client with `status` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        # Set once the request's metrics and log line account for this error.
        self.recorded = False

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    """The same error in Anthropic's shape (the status stays; the type follows it)."""
    kind = _ANTHROPIC_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def invalid_request(exc: InvalidRequest, names: dict[str, str] | None = None) -> APIError:
    """The engine's InvalidRequest as a 400; `names` renames its param into this endpoint's
    terms (chat: {"prompt": "messages"})."""
    if names:
        exc = exc.renamed(names)
    if exc.code == "model_not_found":  # e.g. a LoRA adapter unloaded while the request was sent
        return APIError(404, exc.message, type="not_found_error", param=exc.param, code=exc.code)
    return bad_request(exc.message, param=exc.param, code=exc.code)


def unauthorized(message: str = "Missing or invalid API key.") -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", type="not_found_error", param="model", code="model_not_found"
    )


def request_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body exceeds the server's limit of {limit} bytes.", code="request_too_large")


def body_timed_out(seconds: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {seconds:g} s.", code="request_timeout")


def rate_limited(message: str, retry_after: float) -> APIError:
    return APIError(
        429,
        message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": retry_after_header(retry_after)},
    )


def overloaded(message: str, retry_after: float) -> APIError:
    return APIError(
        503,
        message,
        type="server_overloaded",
        code="server_busy",
        headers={"Retry-After": retry_after_header(retry_after)},
    )


def engine_unavailable(message: str = "The engine is not running.") -> APIError:
    return APIError(503, message, type="server_error", code="engine_dead", headers={"Retry-After": "5"})


def model_asleep(message: str) -> APIError:
    """The model sleeps (POST /sleep) until an admin wakes it (POST /wake_up)."""
    return APIError(
        503,
        f"{message[:1].upper()}{message[1:]}.",
        type="server_error",
        code="model_asleep",
        headers={"Retry-After": "5"},
    )


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(loc: tuple[Any, ...] | list[Any]) -> list[str]:
    # pydantic names the union member that failed ("str", "list[int]"); clients want the field.
    return [str(p) for p in loc if p != "body" and not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))]


def validation_error(errors: list[Any]) -> APIError:
    """A pydantic/FastAPI validation error list -> a 400 naming the first bad field."""
    if not errors:
        return bad_request("Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        if "recursion limit" in str(first.get("msg", "")):  # valid JSON, but deeper than the parser goes
            return bad_request(
                "The request body is nested too deeply (JSON arrays and objects inside each "
                "other more than about 128 levels)."
            )
        return bad_request("The request body is not valid JSON (or not valid UTF-8).")
    if first.get("type") in ("model_type", "model_attributes_type") and not _field_path(first.get("loc", ())):
        return bad_request("The request body must be a JSON object.")
    by_field: dict[str, list[str]] = {}
    for err in errors:
        where = ".".join(_field_path(err.get("loc", ())))
        messages = by_field.setdefault(where, [])
        message = err.get("msg", "invalid value")
        if message not in messages:
            messages.append(message)
    parts = [
        f"{where}: {' or '.join(msgs)}" if where else " or ".join(msgs) for where, msgs in list(by_field.items())[:3]
    ]
    path = _field_path(first.get("loc", ()))
    return bad_request("; ".join(parts), param=path[0] if path else None)
