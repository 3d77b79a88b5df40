"""`GET /openapi.json` (`runtime.api.openapi`): the document of every route, unable to drift.

The node's whole app (`runtime.api.app.create_app`) serves the document;
every route it mounts is in it by path and method and nothing else is, a
route added without a description fails to build it, and the request
schemas of the two generating routes are validated with `jsonschema`
(a maintained JSON Schema 2020-12 validator, the dialect of OpenAPI 3.1)
against the real parsers: on a handful of bodies, and on every documented
field given a value of a kind it does not take, the schema and the parser
accept and refuse alike.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import pytest
from starlette.routing import Route

from runtime.api.app import create_app
from runtime.api.openapi import PATH, openapi_document
from runtime.inference.chat import CHAT_FIELDS, ChatError, parse_chat_request
from runtime.inference.completion import COMPLETION_FIELDS, parse_completion_request
from runtime.inference.fields import Field

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


@pytest.fixture(scope="module")
def app() -> Any:
    return create_app(SimpleNamespace(chat=None))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def document(app: Any) -> dict[str, Any]:
    return openapi_document(app.routes)


async def test_the_document_names_every_route_the_app_mounts_and_no_other(
    app: Any, document: dict[str, Any]
) -> None:
    mounted = {
        (route.path, method.lower()) for route in app.routes for method in route.methods - {"HEAD"}
    }
    documented = {(path, method) for path, item in document["paths"].items() for method in item}
    assert documented == mounted
    assert ("/openapi.json", "get") in documented and ("/v1/completions", "post") in documented
    ids = [op["operationId"] for item in document["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        served = await client.get(PATH)
    assert served.status_code == 200 and served.json() == document
    jsonschema.Draft202012Validator.check_schema(_chat_schema(document))


def test_a_route_without_a_description_fails_to_build_the_document(app: Any) -> None:
    with pytest.raises(KeyError):
        openapi_document([*app.routes, Route("/v1/undocumented", lambda r: None)])


def _chat_schema(document: dict[str, Any]) -> dict[str, Any]:
    return _body_schema(document, "/v1/chat/completions")


def _body_schema(document: dict[str, Any], path: str) -> dict[str, Any]:
    body = document["paths"][path]["post"]["requestBody"]
    return body["content"]["application/json"]["schema"]  # type: ignore[no-any-return]


def _agree(schema: dict[str, Any], parse: Any, body: dict[str, Any]) -> bool:
    """Whether the schema and the parser both accept `body`, or both refuse it."""
    try:
        parse(body)
        parsed = True
    except ChatError:
        parsed = False
    valid = jsonschema.Draft202012Validator(schema).is_valid(body)
    assert parsed == valid, (body, parsed, valid)
    return parsed


CHAT_BODIES = [
    ({"model": "m", "messages": MESSAGES}, True),
    ({"model": "m", "messages": MESSAGES, "logprobs": True, "top_logprobs": 5}, True),
    ({"model": "m", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "auto"}, True),
    ({"model": "m", "messages": MESSAGES, "stop": ["a", "b"], "temperature": None}, True),
    ({"model": "m", "messages": MESSAGES, "logprobs": True, "top_logprobs": 6}, False),
    ({"model": "m", "messages": MESSAGES, "n": 2}, False),
    ({"model": "m", "messages": MESSAGES, "max_tokens": 0}, False),
    ({"model": "m", "messages": MESSAGES, "stop": ["a"] * 5}, False),
    ({"model": "m", "messages": MESSAGES, "top_p": 0}, False),
    ({"model": "m", "messages": []}, False),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, False),
    ({"messages": MESSAGES}, False),
]
COMPLETION_BODIES = [
    ({"model": "m", "prompt": "hi"}, True),
    ({"model": "m", "prompt": [[1, 2], "hi"], "echo": True, "logprobs": 5}, True),
    ({"model": "m", "prompt": "hi", "suffix": ""}, True),
    ({"model": "m", "prompt": "hi", "logprobs": 6}, False),
    ({"model": "m", "prompt": "hi", "suffix": "end"}, False),
    ({"model": "m", "prompt": "hi", "best_of": 2}, False),
    ({"model": "m", "prompt": "hi", "max_tokens": 0}, False),
    ({"model": "m", "prompt": ""}, False),
    ({"model": "m", "prompt": []}, False),
    ({"model": "m", "prompt": [1, -2]}, False),
    ({"model": "m"}, False),
]


@pytest.mark.parametrize(("body", "accepted"), CHAT_BODIES)
def test_the_chat_schema_accepts_what_the_parser_accepts(
    document: dict[str, Any], body: dict[str, Any], accepted: bool
) -> None:
    assert _agree(_chat_schema(document), parse_chat_request, body) == accepted


@pytest.mark.parametrize(("body", "accepted"), COMPLETION_BODIES)
def test_the_completion_schema_accepts_what_the_parser_accepts(
    document: dict[str, Any], body: dict[str, Any], accepted: bool
) -> None:
    schema = _body_schema(document, "/v1/completions")
    assert _agree(schema, parse_completion_request, body) == accepted


WRONG_KINDS = {"string": {"a": 1}, "integer": "1", "number": "1", "boolean": 1, "array": "x"}
"""A value of another kind for a field of each JSON type."""


def _wrong(field: Field) -> object:
    kinds = [o.get("type") for o in field.schema.get("anyOf", [field.schema])]
    return 3.5 if "string" in kinds or "array" in kinds else WRONG_KINDS.get(kinds[0], 3.5)


@pytest.mark.parametrize(
    ("fields", "base", "parse"),
    [
        (CHAT_FIELDS, {"model": "m", "messages": MESSAGES}, parse_chat_request),
        (COMPLETION_FIELDS, {"model": "m", "prompt": "hi"}, parse_completion_request),
    ],
)
def test_every_documented_field_of_another_kind_is_refused_by_both(
    document: dict[str, Any], fields: tuple[Field, ...], base: dict[str, Any], parse: Any
) -> None:
    path = "/v1/chat/completions" if parse is parse_chat_request else "/v1/completions"
    schema = _body_schema(document, path)
    assert set(schema["properties"]) == {"model", *(f.name for f in fields)}
    for field in fields:
        assert not _agree(schema, parse, {**base, field.name: _wrong(field)}), field.name
