"""The API server: serves an app on loopback, says its URL, fails to bind clearly."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest
import trio

from runtime.node.hostport import HostPort
from runtime.node.http_server import start_http
from runtime.node.options import NodeStartupError


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The smallest ASGI app: 200 "hello" to any request."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


async def test_serves_until_shutdown_on_the_bound_port() -> None:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await start_http(
            nursery, hello, bind=HostPort("127.0.0.1", 0), advertise=None, shutdown=shutdown
        )
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        async with httpx.AsyncClient() as client:
            reply = await client.get(url + "/anything")
        assert (reply.status_code, reply.text) == (200, "hello")
        shutdown.set()  # the server ends and the nursery with it


async def test_advertise_names_the_host_peers_use() -> None:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await start_http(
            nursery,
            hello,
            bind=HostPort("127.0.0.1", 0),
            advertise="node.example",
            shutdown=shutdown,
        )
        shutdown.set()
    assert url.startswith("http://node.example:")
    assert int(url.rsplit(":", 1)[1]) > 0, "the bound port, not the asked-for 0"


async def test_a_port_in_use_is_one_clear_startup_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.RaisesGroup(NodeStartupError) as caught:
            async with trio.open_nursery() as nursery:
                await start_http(
                    nursery,
                    hello,
                    bind=HostPort("127.0.0.1", port),
                    advertise=None,
                    shutdown=trio.Event(),
                )
    message = str(caught.value.exceptions[0])
    assert message.startswith(f"cannot serve the API on 127.0.0.1:{port}: "), message
    assert "in use" in message, "the OSError's own words, unwrapped from hypercorn's groups"
