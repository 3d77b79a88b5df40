"""What every route shares (`runtime.api.http`): OpenAI-shaped errors and the JSON body.

A small Starlette app with the app's own exception handlers and routes that
read a body with `json_object` or raise each kind of refusal, driven through
httpx's ASGI transport. Every error is checked for OpenAI's shape (message,
type, param, code), and every way a body can be wrong for its status and a
message that says what is wrong.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from runtime.api.http import (
    MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    MAX_JSON_INT,
    BadRequest,
    bad_request,
    chat_error,
    error_response,
    http_error,
    json_object,
    server_error,
)
from runtime.inference.chat import ChatError

JSON = {"content-type": "application/json"}


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"got": await json_object(request)})


async def small(request: Request) -> JSONResponse:
    return JSONResponse({"got": await json_object(request, max_bytes=16)})


async def refuse(request: Request) -> JSONResponse:
    raise BadRequest("layers must be two integers", "layers")


async def busy(request: Request) -> JSONResponse:
    raise ChatError(
        429,
        "too many chats at once",
        type_="requests",
        code="rate_limit_exceeded",
        param="model",
        headers={"Retry-After": "2"},
        extra={"reason": "concurrent"},
    )


async def broken(request: Request) -> JSONResponse:
    raise ZeroDivisionError("a bug")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = Starlette(
        routes=[
            Route("/echo", echo, methods=["POST"]),
            Route("/small", small, methods=["POST"]),
            Route("/refuse", refuse, methods=["POST"]),
            Route("/busy", busy, methods=["POST"]),
            Route("/broken", broken, methods=["GET"]),
        ],
        exception_handlers={
            BadRequest: bad_request,
            ChatError: chat_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        yield client


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    return error


def test_an_error_is_in_openais_shape_with_a_type_and_code_by_status() -> None:
    response = error_response(404, "no such model", param="model")
    assert response.status_code == 404
    assert json.loads(bytes(response.body)) == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "param": "model",
            "code": "not_found",
        }
    }
    assert json.loads(bytes(error_response(502, "x").body))["error"]["type"] == "server_error"
    assert json.loads(bytes(error_response(418, "x").body))["error"] == {
        "message": "x", "type": "error", "param": None, "code": None,
    }  # fmt: skip
    given = error_response(503, "wait", type_="t", code="c", headers={"Retry-After": "1"})
    assert json.loads(bytes(given.body))["error"]["type"] == "t"
    assert json.loads(bytes(given.body))["error"]["code"] == "c"
    assert given.headers["retry-after"] == "1"


async def test_a_json_object_body_is_read(client: httpx.AsyncClient) -> None:
    for content_type in ("application/json", "Application/JSON; charset=utf-8"):
        answer = await client.post(
            "/echo", content=b'{"a": [1]}', headers={"content-type": content_type}
        )
        assert answer.status_code == 200 and answer.json() == {"got": {"a": [1]}}


async def test_a_body_not_declared_json_is_a_415_before_it_is_read(
    client: httpx.AsyncClient,
) -> None:
    for headers in (
        {"content-type": "text/plain"},
        {"content-type": "application/x-www-form-urlencoded"},
        {},
    ):
        error = error_of(await client.post("/echo", content=b"{}", headers=headers), 415)
        assert error["code"] == "unsupported_media_type"
        assert error["type"] == "invalid_request_error"
        assert "Content-Type: application/json" in error["message"]
    assert (
        "'text/plain'"
        in error_of(
            await client.post("/echo", content=b"{}", headers={"content-type": "text/plain"}), 415
        )["message"]
    )


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"{not json", "malformed JSON body"),
        (b"\xff\xfe", "malformed JSON body"),
        (b"[1, 2]", "the body must be a JSON object"),
        (b'"text"', "the body must be a JSON object"),
        (b" " * (MAX_BODY_BYTES + 1), f"request body over {MAX_BODY_BYTES} bytes"),
    ],
)
async def test_a_bad_body_is_a_400_saying_why(
    client: httpx.AsyncClient, body: bytes, words: str
) -> None:
    error = error_of(await client.post("/echo", content=body, headers=JSON), 400)
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] is None


@pytest.mark.parametrize(
    ("body", "words", "param"),
    [
        (b"[" * 30_000 + b"]" * 30_000, f"nests deeper than {MAX_JSON_DEPTH} levels", None),
        (b'{"a": ' * 65 + b"1" + b"}" * 65, "nests deeper than", None),
        (b'{"messages": [{"content": "hi \\ud800"}]}', "lone surrogate", "messages[0].content"),
        (b'{"\\udc00": 1}', "lone surrogate", "\\udc00"),
        (b'{"count": ' + b"9" * 5_000 + b"}", "count: the integer 999", "count"),
        (b'{"count": ' + b"9" * 5_000 + b"}", "(5000 digits) is out of range", "count"),
        (b'{"n": [1, ' + str(MAX_JSON_INT).encode() + b"]}", "n[1]: the integer", "n[1]"),
        (b'{"count": -' + str(MAX_JSON_INT).encode() + b"}", "is out of range", "count"),
        (b'{"at": NaN}', "at: NaN is not a JSON value", "at"),
        (b'{"a": {"b": -Infinity}}', "-Infinity is not a JSON value", "a.b"),
        (b'{"at": 1e400}', "1e400 is out of a float's range", "at"),
        (b"1e400", "the body: the number 1e400", None),
        (b'{"a": "\xed\xa0\x80"}', "not UTF-8", None),  # a surrogate written raw
        (b"\xff\xfe{\x00}\x00", "not UTF-8", None),  # UTF-16: JSON is UTF-8 only
        (b"[]", "not an array", None),
        (b"null", "not null", None),
    ],
)
async def test_json_that_would_fail_further_in_is_a_400_naming_it(
    client: httpx.AsyncClient, body: bytes, words: str, param: str | None
) -> None:
    """Issue 30: each of these was a 500 (RecursionError, ValueError from
    the int parser, a surrogate or NaN that no encoder takes)."""
    error = error_of(await client.post("/echo", content=body, headers=JSON), 400)
    assert words in error["message"] and error["param"] == param, error


async def test_strict_json_still_takes_every_json_we_serve(client: httpx.AsyncClient) -> None:
    """Up to the depth limit, paired surrogates, brackets and escaped quotes
    inside strings, integers up to 64 bits either way."""
    deep = b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1)  # 64 levels, the object's too
    for body, got in [
        (b'{"a": ' + deep + b"}", None),
        (b'{"a": "\\ud83d\\ude00"}', {"a": "\U0001f600"}),
        (b'{"a": "[[[[\\"{{{{", "b": ' + b"[" * 60 + b"]" * 60 + b"}", None),
        (json.dumps({"n": [MAX_JSON_INT - 1, 1 - MAX_JSON_INT, 1.5e300]}).encode(), None),
    ]:
        answer = await client.post("/echo", content=body, headers=JSON)
        assert answer.status_code == 200, (body[:40], answer.text)
        assert got is None or answer.json()["got"] == got


async def test_the_depth_is_counted_in_linear_time(client: httpx.AsyncClient) -> None:
    """A scanner that retried every quote would take seconds on this; a
    body of brackets under the limit costs one pass too."""
    started = time.perf_counter()
    for body in (b'"' + b'\\"' * 30_000, b"[]" * 30_000, b'"[' * 30_000):
        error_of(await client.post("/echo", content=body, headers=JSON), 400)
    assert time.perf_counter() - started < 1.0


async def test_the_size_limit_is_the_routes_own(client: httpx.AsyncClient) -> None:
    assert (await client.post("/small", content=b'{"a": 1}', headers=JSON)).status_code == 200
    error = error_of(await client.post("/small", content=b'{"a": "0123456789"}', headers=JSON), 400)
    assert error["message"] == "request body over 16 bytes"


async def test_a_refusal_names_its_field_and_a_chat_error_keeps_its_own_shape(
    client: httpx.AsyncClient,
) -> None:
    error = error_of(await client.post("/refuse"), 400)
    assert error == {
        "message": "layers must be two integers",
        "type": "invalid_request_error",
        "param": "layers",
        "code": None,
    }
    answer = await client.post("/busy")
    assert error_of(answer, 429) == {
        "message": "too many chats at once",
        "type": "requests",
        "param": "model",
        "code": "rate_limit_exceeded",
        "reason": "concurrent",
    }
    assert answer.headers["retry-after"] == "2"


async def test_unknown_paths_and_wrong_methods_are_openai_shaped(
    client: httpx.AsyncClient,
) -> None:
    error = error_of(await client.get("/nowhere"), 404)
    assert error["message"] == "no such endpoint: GET /nowhere" and error["code"] == "not_found"
    answer = await client.get("/echo")
    error = error_of(answer, 405)
    assert error["message"] == "GET is not allowed on /echo"
    assert error["code"] == "method_not_allowed"
    assert answer.headers["allow"] == "POST"


async def test_a_bug_is_a_logged_500_that_names_only_the_exceptions_type(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="shardmesh.api"):
        error = error_of(await client.get("/broken"), 500)
    assert error == {
        "message": "internal error: ZeroDivisionError",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    assert "a bug" not in json.dumps(error)  # the detail stays in the log
    (record,) = [r for r in caplog.records if r.name == "shardmesh.api"]
    assert record.getMessage() == "GET /broken failed" and record.exc_info is not None
