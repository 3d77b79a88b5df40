"""The node's HTTP API (Starlette, served by hypercorn's trio worker).

Every node answers the same API: a client can point at any node. The routes
live by audience, each module a few small classes of routes:
`runtime.api.openai` (chat, for OpenAI clients) and `runtime.api.completions`
(their legacy text completions), `runtime.api.network` (the
swarm's status, placement and files), `runtime.api.metrics` (`GET /metrics`,
Prometheus text) and `runtime.api.page` (`GET /`, the web page); the last two
are views of the status document; `runtime.api.openapi` (`GET
/openapi.json`) documents them all. This module puts them in one app, with the
exception handlers that give errors of every kind OpenAI's shape
(`runtime.api.http`).
"""

from __future__ import annotations

from typing import Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute

from runtime.api.completions import completion_routes
from runtime.api.http import BadRequest, bad_request, chat_error, http_error, server_error
from runtime.api.metrics import MetricsRoutes
from runtime.api.network import NetworkNode, network_routes
from runtime.api.openai import OpenAIRoutes
from runtime.api.openapi import OpenAPIRoutes
from runtime.api.page import PageRoutes
from runtime.api.quota import MAX_CONCURRENT_PER_CLIENT, ChatQuota
from runtime.inference.chat import ChatError, ChatService


class NodeAPI(NetworkNode, Protocol):
    """What the API needs from a node (`runtime.node.daemon.Node` is the real one)."""

    chat: ChatService


def create_app(node: NodeAPI, *, chats_per_client: int | None = None) -> Starlette:
    """The ASGI app for one node; `chats_per_client` is `--max-chats-per-client`.

    Nothing of `node` but `chat` is read here: the routes read the rest per
    request, so the app can be made before the node is fully wired."""
    quota = ChatQuota(chats_per_client or MAX_CONCURRENT_PER_CLIENT)
    openai = OpenAIRoutes(node.chat, quota)
    routes: list[BaseRoute] = [
        *openai.routes(),
        *completion_routes(openai),
        *network_routes(node),
        *MetricsRoutes(node).routes(),
        *PageRoutes().routes(),
    ]
    routes += OpenAPIRoutes(routes).routes()  # the document's routes list holds itself
    return Starlette(
        routes=routes,
        exception_handlers={
            BadRequest: bad_request,
            ChatError: chat_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )
