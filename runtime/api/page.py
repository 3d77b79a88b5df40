"""`GET /`: the web page, a chat box and a view of the swarm (`runtime/api/web/`).

Static files, no build step. The page's script reads `/v1/models` and
`/v1/network/status` and chats through `/v1/chat/completions`; it loads
nothing from anywhere else, and the headers served with every file say so
to the browser (`WEB_HEADERS`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Final

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

WEB: Final = Path(__file__).with_name("web")
"""Where the page's files are."""
WEB_FILES: Final = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/web/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/web/page.css": ("page.css", "text/css; charset=utf-8"),
    "/web/icon.svg": ("icon.svg", "image/svg+xml"),
}
"""Each path served, with its file in `WEB` and its media type."""
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


class PageRoutes:
    """`GET` of each of `WEB_FILES`, with `WEB_HEADERS`."""

    def routes(self) -> list[Route]:
        return [
            Route(path, partial(self.file, name, media_type), methods=["GET"], name=name)
            for path, (name, media_type) in WEB_FILES.items()
        ]

    async def file(self, name: str, media_type: str, request: Request) -> Response:
        """The file `name` of the page."""
        return FileResponse(WEB / name, media_type=media_type, headers=WEB_HEADERS)
