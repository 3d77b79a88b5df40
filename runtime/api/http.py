"""What every route shares: OpenAI-shaped errors, and one way to refuse a bad body.

Errors of every kind, including unknown paths and wrong methods, use
OpenAI's error shape, because the clients that talk to `/v1` are OpenAI
clients and they parse that shape for messages. A route refuses bad input by
raising `BadRequest` (or `ChatError`); the app's exception handlers turn
each into its response, so no route formats an error of its own.

Every POST body is read by `json_object`, which first requires
`Content-Type: application/json`: a web page can send a cross-site "simple"
request (form or `text/plain`) without the browser's CORS preflight, never a
JSON one; and the app sends no CORS headers, so a browser never lets another
site's script read an answer either.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Final

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from runtime.inference.chat import ChatError

log = logging.getLogger("shardmesh.api")

MAX_BODY_BYTES: Final = 64 * 1024
"""Control-plane request bodies are tiny; refuse megabytes before parsing."""
JSON_MEDIA_TYPE: Final = "application/json"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable",
}
_ERROR_CODES = {
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    415: "unsupported_media_type",
    500: "internal_error",
}


def error_response(
    status: int,
    message: str,
    *,
    type_: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    """An error in OpenAI's shape: `{"error": {"message", "type", "code"}}`
    (plus `param`, which OpenAI clients expect to find, and any `extra`)."""
    body: dict[str, Any] = {
        "message": message,
        "type": type_ or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "error"),
        "param": None,
        "code": code if code is not None else _ERROR_CODES.get(status),
    }
    body.update(extra)  # e.g. param="model"
    return JSONResponse({"error": body}, status_code=status, headers=headers)


class BadRequest(Exception):
    """A request body we refuse; becomes a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def require_json(request: Request) -> None:
    """A 415 unless the body is declared `application/json` (parameters
    such as `; charset=utf-8` allowed)."""
    declared = request.headers.get("content-type", "")
    if declared.split(";", 1)[0].strip().lower() != JSON_MEDIA_TYPE:
        raise HTTPException(
            415,
            f"the body must be sent as Content-Type: {JSON_MEDIA_TYPE}"
            f" (got {declared[:60] or 'none'!r})",
        )


async def json_object(request: Request, max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request body as a JSON object, or 415 (not declared JSON) or
    BadRequest saying what is wrong."""
    require_json(request)
    body = await request.body()
    if len(body) > max_bytes:
        raise BadRequest(f"request body over {max_bytes} bytes")
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequest("the body must be a JSON object")
    return value


async def bad_request(request: Request, exc: Exception) -> JSONResponse:
    """The one handler for refused input: a 400 naming the field."""
    assert isinstance(exc, BadRequest)
    return error_response(400, str(exc), param=exc.param)


async def chat_error(request: Request, exc: Exception) -> JSONResponse:
    """A refused or failed chat (before any byte was streamed)."""
    assert isinstance(exc, ChatError)
    return chat_error_response(exc)


def chat_error_response(exc: ChatError) -> JSONResponse:
    extra = dict(exc.extra)
    if exc.param is not None:
        extra["param"] = exc.param
    return error_response(
        exc.status, exc.message, type_=exc.type_, code=exc.code, headers=exc.headers, **extra
    )


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (no such path, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, headers=exc.headers)


async def server_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}")
