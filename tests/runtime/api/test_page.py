"""The page's files and their route (`runtime.api.page`), in process.

The files are the ones served and only those, with no inline script or
style (the CSP allows neither) and no sink that would turn a peer's string
into markup; each is served through the real route with its media type and
the strict headers; the script words every reason placement gives for
waiting. The page in a real browser, against a swarm of node processes, is
tests/runtime/api/test_web_page.py.
"""

from __future__ import annotations

import json
import re

import httpx
from starlette.applications import Starlette

from consensus.placement import WAIT_MESSAGES
from runtime.api.page import WEB, WEB_FILES, WEB_HEADERS, PageRoutes


def test_the_page_is_its_own_files_and_sets_strings_only_as_text() -> None:
    served = {name for name, _ in WEB_FILES.values()}
    assert served == {path.name for path in WEB.iterdir()}, "every file served, and only those"
    html = (WEB / "index.html").read_text()
    assert "<script>" not in html and "style=" not in html  # the CSP allows neither inline
    assert set(re.findall(r'(?:src|href)="([^"]*)"', html)) <= {f"/web/{name}" for name in served}
    script = (WEB / "page.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, f"page.js uses {sink}: peers' strings are only ever text"
    assert "setAttribute(" not in script and "new Function" not in script


async def test_each_file_is_served_with_its_type_and_the_strict_headers() -> None:
    app = Starlette(routes=PageRoutes().routes())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        for path, (name, media_type) in WEB_FILES.items():
            served = await client.get(path)
            assert served.status_code == 200, path
            assert served.headers["content-type"] == media_type
            assert served.content == (WEB / name).read_bytes()
            for header, value in WEB_HEADERS.items():
                assert served.headers[header] == value, (path, header)
            assert "default-src 'none'" in served.headers["content-security-policy"]
        assert (await client.get("/web/index.html")).status_code == 404  # only the paths named


def test_the_page_words_every_reason_placement_gives_for_waiting() -> None:
    script = (WEB / "page.js").read_text()
    for code, message in WAIT_MESSAGES.items():
        assert f"{code}: {json.dumps(message)}," in script, code
