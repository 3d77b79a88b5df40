"""How `shardmesh chat` reads a node's refusals.

The happy path and the wait for a loading model run against real nodes in
tests/processes/test_placement.py; these are the answers a node (or something
pretending to be one) may send that the client must read without tripping.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from runtime.cli.chat_client import (
    RETRY_AFTER_BOUNDS_S,
    ChatClientError,
    ModelLoading,
    _refusal,
    describe_loading,
)

LOW, HIGH = RETRY_AFTER_BOUNDS_S


def loading(retry_after: str | None = "5", coverage: Any = None) -> httpx.Response:
    error: dict[str, Any] = {"message": "not served yet", "code": "model_loading"}
    if coverage is not None:
        error["coverage"] = coverage
    headers = {} if retry_after is None else {"Retry-After": retry_after}
    return httpx.Response(503, json={"error": error}, headers=headers)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("5", 5.0), (None, LOW), ("0", LOW), ("86400", HIGH), ("soon", LOW), ("nan", LOW)],
)
def test_retry_after_is_clamped(header: str | None, seconds: float) -> None:
    refusal = _refusal(loading(header))
    assert isinstance(refusal, ModelLoading)
    assert refusal.retry_after_s == seconds


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(503, json={"error": {"message": "no leader", "code": "no_leader"}}),
        httpx.Response(503, text="<html>bad gateway</html>"),
        httpx.Response(503, json={"error": "model_loading"}),
        httpx.Response(404, json={"error": {"message": "no", "code": "model_not_found"}}),
    ],
)
def test_other_refusals_are_not_waited_on(response: httpx.Response) -> None:
    refusal = _refusal(response)
    assert type(refusal) is ChatClientError
    assert str(refusal).startswith(f"HTTP {response.status_code}")


def test_the_wait_line_says_what_is_served_and_why() -> None:
    coverage = {
        "model": "y",
        "layers": 8,
        "covered": [[0, 3], [6, 8]],
        "loading": ["ab12", "cd34"],
        "reason": "loading and doctor in progress",
    }
    refusal = _refusal(loading(coverage=coverage))
    assert isinstance(refusal, ModelLoading)
    assert describe_loading(refusal) == (
        "y: 5/8 layers served; 2 node(s) loading; loading and doctor in progress"
    )


def test_a_malformed_coverage_still_gives_a_line() -> None:
    refusal = _refusal(loading(coverage={"layers": "8", "covered": [[0, "x"], 3], "loading": 2}))
    assert isinstance(refusal, ModelLoading)
    assert describe_loading(refusal) == "the model: not served"
