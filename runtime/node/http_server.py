"""The node's HTTP API server: hypercorn on trio, bound or a clear error.

The daemon builds the ASGI app (`runtime.api.app`, which only the
composition root may import) and hands it here; this module binds it,
turns a bind failure into one `NodeStartupError` line, and says the URL
peers should use.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from runtime.node.hostport import HostPort, parse_hostport
from runtime.node.options import NodeStartupError, first_leaf


async def start_http(
    nursery: trio.Nursery,
    app: Any,
    *,
    bind: HostPort,
    advertise: str | None,
    shutdown: trio.Event,
) -> str:
    """Serve the ASGI `app` on `bind` in `nursery` until `shutdown` is set;
    the API's URL as peers should use it (`advertise`'s host, if given, with
    the bound port)."""
    try:
        binds = await nursery.start(_serve, app, bind, shutdown)
    except (OSError, BaseExceptionGroup) as exc:
        # hypercorn binds inside its own nurseries: the OSError may be grouped.
        bind_error: BaseException = exc
        if isinstance(exc, BaseExceptionGroup):
            oserrors, rest = exc.split(OSError)
            if oserrors is None or rest is not None:
                raise
            bind_error = first_leaf(oserrors)
        raise NodeStartupError(f"cannot serve the API on {bind.text()}: {bind_error}") from exc
    bound = parse_hostport(binds[0].split("//", 1)[1]) if binds else bind
    if advertise:
        bound = HostPort(advertise, bound.port)
    return bound.http()


async def _serve(
    app: Any,
    bind: HostPort,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [bind.text()]
    config.accesslog = None
    # Through our logging config (one format, one stream), not a second handler.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = 5.0
    await serve(app, config, shutdown_trigger=shutdown.wait, task_status=task_status)
