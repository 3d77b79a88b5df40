"""The node's HTTP API (Starlette, served by hypercorn's trio worker).

Every node answers the same API: a client can point at any node. For now it
serves `GET /v1/network/status` and `GET /v1/network/coverage[?model=M]`;
chat, models and assignment endpoints arrive with later issues. Errors of
every kind, including unknown paths and wrong methods, use OpenAI's error
shape, because the clients that talk to `/v1` are OpenAI clients and they
parse that shape for messages.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

log = logging.getLogger("shardmesh.api")


class StatusSource(Protocol):
    """What the API needs from a node (`runtime.node.Node` is the real one)."""

    def status(self) -> dict[str, Any]: ...


_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable",
}
_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 500: "internal_error"}


def error_response(
    status: int,
    message: str,
    *,
    type_: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
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


def create_app(node: StatusSource) -> Starlette:
    """The ASGI app for one node."""

    async def network_status(request: Request) -> JSONResponse:
        return JSONResponse(node.status())

    async def network_coverage(request: Request) -> JSONResponse:
        coverage = node.status()["coverage"]
        model = request.query_params.get("model")
        if model is None:
            return JSONResponse(coverage)
        if model not in coverage:
            return error_response(
                404,
                f"no node reports an admitted capability for model {model!r}",
                code="model_not_found",
                param="model",
            )
        return JSONResponse({model: coverage[model]})

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
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

    return Starlette(
        routes=[
            Route("/v1/network/status", network_status, methods=["GET"]),
            Route("/v1/network/coverage", network_coverage, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
