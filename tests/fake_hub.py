"""A stand-in for the Hugging Face Hub's file API, on loopback, for tests.

It answers what huggingface_hub asks when it fetches a file: `HEAD` and
`GET /{owner}/{name}/resolve/{revision}/{file}`, with the headers the real
hub sends (`X-Repo-Commit`, an `ETag`, `Content-Length`) and its error codes
(`X-Error-Code: RepoNotFound | RevisionNotFound | EntryNotFound`). Each
repository is a local folder served at one commit. Every request is
recorded, so a test can assert which files were fetched.

It runs in a thread of the test process (a `ThreadingHTTPServer`), starts
on a free port, and stops when its `with` block ends or, whatever happens,
after `LIFETIME_S`.
"""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Final

COMMIT: Final = "5ca1ab1e" * 5
"""The commit every repository is at (40 hex digits, as the hub's are)."""
LIFETIME_S: Final = 300.0
"""The server stops itself after this long even if a test never exits."""


class FakeHub:
    """`with FakeHub({"owner/name": folder}) as hub:` serves at `hub.url`."""

    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str, str]] = []
        """(method, revision, file) of every request for a file, in order."""
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._timer = threading.Timer(LIFETIME_S, self._server.shutdown)
        self._timer.daemon = True

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def fetched(self) -> set[str]:
        """The files whose bytes were sent (GET)."""
        with self._lock:
            return {name for method, _, name in self.requests if method == "GET"}

    def __enter__(self) -> FakeHub:
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._timer.cancel()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, *, body: bool) -> None:
                parts = self.path.split("?", 1)[0].lstrip("/").split("/")
                if len(parts) < 5 or parts[2] != "resolve":
                    return self._error(404, "RepoNotFound")
                repo, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                folder = hub.repos.get(repo)
                if folder is None:
                    return self._error(404, "RepoNotFound")
                if revision not in ("main", COMMIT):
                    return self._error(404, "RevisionNotFound")
                with hub._lock:
                    hub.requests.append(("GET" if body else "HEAD", revision, name))
                path = folder / name
                if "/" in name or not path.is_file():
                    return self._error(404, "EntryNotFound")
                data = path.read_bytes()
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)
                return None

            def _error(self, status: int, code: str) -> None:
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass  # the test reads `requests`, not a log

        return Handler
