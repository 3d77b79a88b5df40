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
site's script read an answer either. It then parses strictly (`strict_json`):
UTF-8 only, bounded nesting and numbers, no NaN, no lone surrogates, so no
route ever meets a value that fails later, deep in a parser or an encoder.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from itertools import accumulate
from typing import Any, Final

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from runtime.inference.chat import ChatError

log = logging.getLogger("shardmesh.api")

MAX_BODY_BYTES: Final = 64 * 1024
"""Control-plane request bodies are tiny; refuse megabytes before parsing."""
JSON_MEDIA_TYPE: Final = "application/json"
MAX_JSON_DEPTH: Final = 64
"""Arrays and objects nested in a body. Ours nest four deep (a chat message's
text parts), an OpenAI client's JSON schema a dozen; Python's parser, and
whatever walks the value after it (our checks, CBOR, logging), recurse once
per level, and 30,000 levels fit in 64 KiB: a RecursionError, a 500."""
MAX_JSON_INT: Final = 2**64
"""Integers lie in (-2**64, 2**64): each count, size, time and seed of ours
fits in 64 bits. Bigger is a client's bug that would fail further in: over
4,300 digits Python's int parser raises, a few hundred overflow the float
arithmetic of times and expiries."""
_MAX_INT_DIGITS: Final = len(str(MAX_JSON_INT))
_ESCAPE: Final = re.compile(r"\\.", re.DOTALL)
_STRING: Final = re.compile(r'"[^"]*"')
_NOT_BRACKET: Final = re.compile(r"[^\[\]{}]+")
_NESTING: Final = {"[": 1, "{": 1, "]": -1, "}": -1}
_SURROGATE: Final = re.compile("[\ud800-\udfff]")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    415: "invalid_request_error",
    421: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable",
}
_ERROR_CODES = {
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    415: "unsupported_media_type",
    421: "misdirected_request",
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
    BadRequest saying what is wrong (`strict_json`)."""
    require_json(request)
    body = await request.body()
    if len(body) > max_bytes:
        raise BadRequest(f"request body over {max_bytes} bytes")
    value = strict_json(body)
    if not isinstance(value, dict):
        raise BadRequest(f"the body must be a JSON object, not {_json_kind(value)}")
    return value


def strict_json(body: bytes) -> Any:
    """`body` parsed as RFC 8259 JSON, or BadRequest naming what is wrong
    (and where, for a value): not UTF-8, nested deeper than
    `MAX_JSON_DEPTH`, malformed, an integer outside `MAX_JSON_INT`, a number
    past a float's range, `NaN`/`Infinity` (Python's extension, not JSON),
    or a lone surrogate.

    A lone surrogate (`"\\ud800"`, legal JSON escape syntax) is refused,
    not replaced with U+FFFD: it is no Unicode character, so no UTF-8
    encoder (the tokenizer's, CBOR's, the response's) takes it, and quietly
    changing a string would change what a signature or an invitation
    token covers."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"malformed JSON body: not UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    _check_depth(text)
    try:
        value = json.loads(text, parse_int=_integer, parse_float=_float, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    _refuse_unusable(value, "")
    return value


def _check_depth(text: str) -> None:
    """BadRequest if arrays and objects nest deeper than `MAX_JSON_DEPTH`,
    counted before parsing with brackets inside strings skipped. Each pass
    is one linear regex (escapes, then strings, then all but brackets): a
    scanner that retried each quote could take seconds on 64 KiB of them."""
    strings_out = _STRING.sub("", _ESCAPE.sub("", text))
    brackets = _NOT_BRACKET.sub("", strings_out)
    if brackets.count("[") + brackets.count("{") <= MAX_JSON_DEPTH:
        return  # the common case: too few to nest that deep
    if max(accumulate(map(_NESTING.__getitem__, brackets)), default=0) > MAX_JSON_DEPTH:
        raise BadRequest(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")


class _Unusable:
    """A number the parser read that no route may be given: left where it
    stands, so that `_refuse_unusable` names its place."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _integer(literal: str) -> int | _Unusable:
    digits = literal.lstrip("-")
    if len(digits) <= _MAX_INT_DIGITS and -MAX_JSON_INT < (value := int(literal)) < MAX_JSON_INT:
        return value
    shown = literal if len(literal) <= 24 else f"{literal[:12]}... ({len(digits)} digits)"
    return _Unusable(f"the integer {shown} is out of range (|n| < 2**64)")


def _float(literal: str) -> float | _Unusable:
    value = float(literal)
    if math.isfinite(value):
        return value
    return _Unusable(f"the number {literal[:24]} is out of a float's range")


def _constant(literal: str) -> _Unusable:
    return _Unusable(f"{literal} is not a JSON value")


def _refuse_unusable(value: Any, where: str) -> None:
    """BadRequest naming the first place (a member, an item, a key) that
    holds a lone surrogate or an unusable number."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise BadRequest(
                f"{where or 'the body'}: a lone surrogate escape (\\ud800-\\udfff) "
                "is not a Unicode character",
                where or None,
            )
    elif isinstance(value, _Unusable):
        raise BadRequest(f"{where or 'the body'}: {value.why}", where or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_unusable(key, _member(where, _printable(key)))
            _refuse_unusable(item, _member(where, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_unusable(item, f"{where}[{i}]")


def _member(where: str, key: str) -> str:
    """The place of member `key` of the object at `where` (`messages[0].content`)."""
    return f"{where}.{key}" if where else key


def _printable(key: str) -> str:
    """`key` as a place to name in a message: its surrogates escaped."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _json_kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


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
