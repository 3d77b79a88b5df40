"""`shardmesh chat`: stream one chat completion from any node to the terminal.

It speaks the same OpenAI wire format any client would (`stream: true`,
server-sent events), so it doubles as a check that the API really streams.

A model nobody serves yet is not an error to a user who asked for it: the
request itself is the demand that makes the leader place the model. So the
client may wait: while the node answers 503 `model_loading`, it reports the
coverage the node sent and asks again after the node's `Retry-After`.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import trio

CHAT_TIMEOUT_S = 120.0
"""A whole answer from a small model on CPUs; the stream itself keeps the
connection busy, so this only bounds a node that stops talking."""


RETRY_AFTER_BOUNDS_S = (0.5, 30.0)
"""Clamp on a 503's `Retry-After`: a missing or zero header must not make
the client spin, and a huge one must not outlast what a user will watch."""


class ChatClientError(Exception):
    """The node refused the request or the stream broke; the message says why."""


class ModelLoading(ChatClientError):
    """503 `model_loading`: the model is known but not fully served yet."""

    def __init__(self, message: str, coverage: dict[str, Any], retry_after_s: float) -> None:
        super().__init__(message)
        self.coverage = coverage
        self.retry_after_s = retry_after_s


@dataclass
class ChatResult:
    text: str
    finish_reason: str | None
    usage: dict[str, int] | None
    shardmesh: dict[str, Any] | None = None  # route, reroutes, timing (final chunk)


async def stream_chat(
    api: str,
    model: str,
    prompt: str,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    on_text: Callable[[str], None] = lambda text: None,
    wait_s: float = 0.0,
    on_wait: Callable[[ModelLoading, float], None] = lambda loading, retry_in: None,
) -> ChatResult:
    """POST a streaming chat completion; call `on_text` with each piece of
    text as it arrives; return the whole answer.

    While the node answers 503 `model_loading`, ask again for up to `wait_s`
    seconds, calling `on_wait` with each refusal and the seconds until the
    next try; past that, the last refusal is raised (`ModelLoading`).
    """
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for key, value in (("max_tokens", max_tokens), ("temperature", temperature), ("seed", seed)):
        if value is not None:
            body[key] = value
    give_up_at = trio.current_time() + wait_s
    while True:
        try:
            return await _stream_once(api, body, on_text)
        except ModelLoading as loading:
            left = give_up_at - trio.current_time()
            if left <= 0:
                raise
            retry_in = min(left, loading.retry_after_s)
            on_wait(loading, retry_in)
            await trio.sleep(retry_in)


async def sse_chunks(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a chat completion's event stream, in order (its
    `data:` lines, without the closing `[DONE]`)."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


async def _stream_once(
    api: str, body: dict[str, Any], on_text: Callable[[str], None]
) -> ChatResult:
    parts: list[str] = []
    finish = None
    usage = None
    extension = None
    try:
        async with (
            httpx.AsyncClient(timeout=CHAT_TIMEOUT_S) as client,
            client.stream("POST", f"{api}/v1/chat/completions", json=body) as response,
        ):
            if response.status_code != 200:
                await response.aread()
                raise _refusal(response)
            async for chunk in sse_chunks(response):
                if "error" in chunk:
                    raise ChatClientError(chunk["error"].get("message", "the stream failed"))
                usage = chunk.get("usage") or usage
                extension = chunk.get("shardmesh") or extension
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content") or ""
                    if text:
                        parts.append(text)
                        on_text(text)
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        raise ChatClientError(f"cannot talk to {api}: {exc}") from exc
    return ChatResult("".join(parts), finish, usage, extension)


def _refusal(response: httpx.Response) -> ChatClientError:
    error = _error_object(response)
    text = _error_text(response, error)
    if response.status_code != 503 or error is None or error.get("code") != "model_loading":
        return ChatClientError(text)
    coverage = error.get("coverage")
    return ModelLoading(
        text, coverage if isinstance(coverage, dict) else {}, _retry_after(response)
    )


def _retry_after(response: httpx.Response) -> float:
    """The header's seconds, clamped; HTTP dates are not sent by our nodes."""
    low, high = RETRY_AFTER_BOUNDS_S
    try:
        seconds = float(response.headers.get("retry-after", low))
    except ValueError:
        return low
    return min(high, max(low, seconds)) if math.isfinite(seconds) else low


def describe_loading(loading: ModelLoading) -> str:
    """One line on what a 503 `model_loading` said: layers covered, nodes
    loading, and what the swarm is waiting for."""
    coverage = loading.coverage
    layers = coverage.get("layers")
    covered = 0
    for span in coverage.get("covered") or []:
        if isinstance(span, list) and len(span) == 2 and all(type(x) is int for x in span):
            covered += span[1] - span[0]
    parts = [f"{covered}/{layers} layers served" if isinstance(layers, int) else "not served"]
    loading_nodes = coverage.get("loading")
    if isinstance(loading_nodes, list) and loading_nodes:
        parts.append(f"{len(loading_nodes)} node(s) loading")
    reason = coverage.get("reason")
    if reason:
        parts.append(str(reason))
    return f"{coverage.get('model', 'the model')}: " + "; ".join(parts)


def _error_text(response: httpx.Response, error: dict[str, Any] | None) -> str:
    if error is None or not isinstance(error.get("message"), str):
        return f"HTTP {response.status_code}: {response.text[:200]}"
    text = (
        f"HTTP {response.status_code} {error.get('code') or error.get('type')}: {error['message']}"
    )
    retry = response.headers.get("retry-after")
    return text + (f" (retry after {retry} s)" if retry else "")


def _error_object(response: httpx.Response) -> dict[str, Any] | None:
    """The OpenAI-shaped `error` object of a refusal, if it has one."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else None
