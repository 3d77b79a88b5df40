"""The node's HTTP API (Starlette, served by hypercorn's trio worker).

Every node answers the same API: a client can point at any node. The
routes live by audience: `runtime.api.openai` (chat, for OpenAI clients),
`runtime.api.network` (the swarm's status, placement and files), and here
`GET /metrics` (Prometheus text, `runtime.api.metrics`) and `GET /` (a
dashboard page that polls the status), both views of the status document.
Errors of every kind use OpenAI's shape (`runtime.api.http`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from runtime.api.http import BadRequest, bad_request, chat_error, http_error, server_error
from runtime.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from runtime.api.metrics import prometheus_text
from runtime.api.network import NetworkNode, network_routes
from runtime.api.openai import openai_routes
from runtime.api.quota import MAX_CONCURRENT_PER_CLIENT, ChatQuota
from runtime.inference.chat import ChatError, ChatService

DASHBOARD: Final = Path(__file__).with_name("dashboard.html")
"""The page `GET /` serves: static, it reads `/v1/network/status` itself."""


class NodeAPI(NetworkNode, Protocol):
    """What the API needs from a node (`runtime.node.daemon.Node` is the real one)."""

    chat: ChatService


def create_app(node: NodeAPI, *, chats_per_client: int | None = None) -> Starlette:
    """The ASGI app for one node; `chats_per_client` is `--max-chats-per-client`."""

    async def metrics(request: Request) -> Response:
        return Response(prometheus_text(node.status()), media_type=METRICS_CONTENT_TYPE)

    async def dashboard(request: Request) -> Response:
        return FileResponse(DASHBOARD, media_type="text/html; charset=utf-8")

    return Starlette(
        routes=[
            *openai_routes(node.chat, ChatQuota(chats_per_client or MAX_CONCURRENT_PER_CLIENT)),
            *network_routes(node),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/", dashboard, methods=["GET"]),
        ],
        exception_handlers={
            BadRequest: bad_request,
            ChatError: chat_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )
