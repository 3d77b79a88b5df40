"""The node's HTTP API (Starlette, served by hypercorn's trio worker).

Every node answers the same API: a client can point at any node. The
routes live by audience: `runtime.api.openai` (chat, for OpenAI clients),
`runtime.api.network` (the swarm's status, placement and files), and here
`GET /metrics` (Prometheus text, `runtime.api.metrics`) and `GET /` (the
web page: a chat box and a view of the swarm, `runtime/api/web/`), both
views of the status document.
Errors of every kind use OpenAI's shape (`runtime.api.http`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
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

WEB: Final = Path(__file__).with_name("web")
"""The web page `GET /` serves: static files, no build step. Its script reads
`/v1/models` and `/v1/network/status` and chats through
`/v1/chat/completions`; it loads nothing from anywhere else."""
WEB_FILES: Final = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/web/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/web/page.css": ("page.css", "text/css; charset=utf-8"),
    "/web/icon.svg": ("icon.svg", "image/svg+xml"),
}
WEB_HEADERS: Final = {
    # The page shows strings from other nodes' records; it only ever sets
    # them as text, and this policy would refuse any script or request
    # beyond this node's own files if one slipped through.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class NodeAPI(NetworkNode, Protocol):
    """What the API needs from a node (`runtime.node.daemon.Node` is the real one)."""

    chat: ChatService


def create_app(node: NodeAPI, *, chats_per_client: int | None = None) -> Starlette:
    """The ASGI app for one node; `chats_per_client` is `--max-chats-per-client`."""

    async def metrics(request: Request) -> Response:
        return Response(prometheus_text(node.status()), media_type=METRICS_CONTENT_TYPE)

    return Starlette(
        routes=[
            *openai_routes(node.chat, ChatQuota(chats_per_client or MAX_CONCURRENT_PER_CLIENT)),
            *network_routes(node),
            Route("/metrics", metrics, methods=["GET"]),
            *(
                Route(path, _web_file(*served), methods=["GET"])
                for path, served in WEB_FILES.items()
            ),
        ],
        exception_handlers={
            BadRequest: bad_request,
            ChatError: chat_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )


def _web_file(name: str, media_type: str) -> Callable[[Request], Awaitable[Response]]:
    """The route serving one of the page's files."""

    async def serve(request: Request) -> Response:
        return FileResponse(WEB / name, media_type=media_type, headers=WEB_HEADERS)

    return serve
