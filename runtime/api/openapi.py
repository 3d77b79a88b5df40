"""`GET /openapi.json`: an OpenAPI 3.1 document of every route the node's app mounts.

The document is built from the app itself, so it cannot drift: its paths
and methods are the app's mounted routes (a route without an entry in
`OPERATIONS` is a KeyError when the document is built, which the tests
make), and the request bodies of the generating routes are the field
tables their parsers check bodies with (`runtime.inference.chat.CHAT_FIELDS`,
`runtime.inference.completion.COMPLETION_FIELDS`: see
`runtime.inference.fields`). What `OPERATIONS` adds is prose: each
operation's summary and who may call it (`runtime.api.auth`: anyone, the
operator's bearer token, a node's signature); the other routes' bodies are
described in words, their parsers being the field checks of
`runtime.api.http`. Errors are OpenAI's error object on every route.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from runtime.inference.chat import CHAT_FIELDS, CHAT_REQUIRED
from runtime.inference.completion import COMPLETION_FIELDS, COMPLETION_REQUIRED
from runtime.inference.fields import Field
from runtime.node.signed_http import SIGNATURE, SIGNED_AT, SIGNED_BY

PATH = "/openapi.json"
VERSION: Final = "1"
"""The document's `info.version`: the API's, not the package's."""

Security = tuple[dict[str, list[str]], ...]
"""An operation's `security`: any one of these schemes (none: anyone)."""
ANYONE: Final[Security] = ()
OPERATOR: Final[Security] = ({"operator": []},)
SIGNED: Final[Security] = ({"node": []},)
OPERATOR_OR_SIGNED: Final[Security] = (*OPERATOR, *SIGNED)


@dataclass(frozen=True)
class Operation:
    """What the document says of one route's method beyond its path."""

    summary: str
    security: Security = ANYONE
    body: tuple[tuple[Field, ...], tuple[str, ...]] | None = None
    """The request body's field table and required fields (a JSON object)."""
    tag: str = "network"


OPERATIONS: Final[dict[tuple[str, str], Operation]] = {
    ("/v1/chat/completions", "POST"): Operation(
        "A chat completion (JSON, or server-sent chunks with `stream`)",
        body=(CHAT_FIELDS, CHAT_REQUIRED),
        tag="openai",
    ),
    ("/v1/completions", "POST"): Operation(
        "A text completion (OpenAI's legacy shape: echo, logprobs)",
        body=(COMPLETION_FIELDS, COMPLETION_REQUIRED),
        tag="openai",
    ),
    ("/v1/models", "GET"): Operation("The models the swarm serves or loads", tag="openai"),
    (PATH, "GET"): Operation("This document", tag="meta"),
    ("/v1/network/status", "GET"): Operation("This node's status document"),
    ("/v1/network/coverage", "GET"): Operation("Which layers of which models are served"),
    ("/v1/network/artifacts/{digest}/{name}", "GET"): Operation(
        "A model's manifest, config, tokenizer file or golden activations (never weights)"
    ),
    ("/v1/network/models/{name}/manifest", "GET"): Operation("A model's manifest"),
    ("/v1/network/demand", "POST"): Operation("A member's demand report", SIGNED),
    ("/v1/network/assign", "POST"): Operation("Suggest a placement", OPERATOR_OR_SIGNED),
    ("/v1/nodes/assign", "POST"): Operation("Assign layers to a node", OPERATOR_OR_SIGNED),
    ("/v1/network/policy", "GET"): Operation("The swarm's placement policy"),
    ("/v1/network/policy", "POST"): Operation("Change the policy", OPERATOR_OR_SIGNED),
    ("/v1/network/evidence", "POST"): Operation("File evidence against a hop", SIGNED),
    ("/v1/network/punch", "POST"): Operation("Meet a member on a direct path past NAT", SIGNED),
    ("/v1/network/ledger", "GET"): Operation("The replicated ledger's entries"),
    ("/v1/network/voters", "GET"): Operation("The swarm's voters"),
    ("/v1/network/voters", "POST"): Operation("Change the voters", OPERATOR_OR_SIGNED),
    ("/v1/network/refound", "POST"): Operation("Refound the swarm from this node", OPERATOR),
    ("/v1/network/invitations", "POST"): Operation("Invite a node (private swarm)", OPERATOR),
    ("/v1/network/join", "POST"): Operation("Redeem an invitation (signed by the newcomer)"),
    ("/v1/debug/faults", "POST"): Operation("Inject faults (--fault-injection)", OPERATOR),
    ("/metrics", "GET"): Operation("Prometheus metrics", tag="meta"),
    ("/", "GET"): Operation("The web page", tag="meta"),
    ("/web/page.js", "GET"): Operation("The web page's script", tag="meta"),
    ("/web/page.css", "GET"): Operation("The web page's style", tag="meta"),
    ("/web/icon.svg", "GET"): Operation("The web page's icon", tag="meta"),
}
"""Every route's methods (HEAD, which Starlette adds to GET, is left out)."""

ERROR: Final = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message"],
        }
    },
    "required": ["error"],
}
SECURITY_SCHEMES: Final = {
    "operator": {
        "type": "http",
        "scheme": "bearer",
        "description": "this node's operator token (STATE_DIR/operator.token)",
    },
    "node": {
        "type": "apiKey",
        "in": "header",
        "name": SIGNATURE,
        "description": f"a node's Ed25519 signature of the request, with {SIGNED_BY} "
        f"(its id) and {SIGNED_AT} (the time)",
    },
}


def request_schema(fields: Sequence[Field], required: Sequence[str]) -> dict[str, Any]:
    """A body's JSON Schema from its field table (null is a field left out)."""
    properties: dict[str, Any] = {"model": {"type": "string", "minLength": 1}}
    for field in fields:
        schema = {"anyOf": [dict(field.schema), {"type": "null"}]}
        properties[field.name] = {**schema, "description": field.description}
    return {"type": "object", "properties": properties, "required": list(required)}


def openapi_document(routes: Sequence[BaseRoute]) -> dict[str, Any]:
    """The document of `routes` (the app's); KeyError for one not in OPERATIONS."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route):
            raise KeyError(f"{route!r} is not a plain route: describe it in runtime.api.openapi")
        for method in sorted((route.methods or set()) - {"HEAD"}):
            operation = OPERATIONS[(route.path, method)]
            paths.setdefault(route.path, {})[method.lower()] = _operation_json(
                route, method, operation
            )
    return {
        "openapi": "3.1.0",
        "info": {"title": "shardmesh node API", "version": VERSION},
        "paths": paths,
        "components": {"securitySchemes": SECURITY_SCHEMES, "schemas": {"Error": ERROR}},
    }


def _operation_json(route: Route, method: str, operation: Operation) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    described: dict[str, Any] = {
        "summary": operation.summary,
        "operationId": f"{method.lower()}_{route.name}",
        "tags": [operation.tag],
        "security": list(operation.security),
        "responses": {"200": {"description": "OK"}, "4XX": {"description": "refused", **error}},
    }
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in route.param_convertors
    ]
    if parameters:
        described["parameters"] = parameters
    if operation.body is not None:
        schema = request_schema(*operation.body)
        described["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    elif method == "POST":
        described["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"type": "object"}}},
        }
    return described


class OpenAPIRoutes:
    """`GET /openapi.json`, the document of `routes` (the app's, this one included)."""

    def __init__(self, routes: Sequence[BaseRoute]) -> None:
        self._routes = routes
        self._document: dict[str, Any] | None = None

    def routes(self) -> list[Route]:
        return [Route(PATH, self.document, methods=["GET"])]

    async def document(self, request: Request) -> JSONResponse:
        if self._document is None:  # the routes are fixed once the app is made
            self._document = openapi_document(self._routes)
        return JSONResponse(self._document)
