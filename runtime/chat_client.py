"""`shardmesh chat`: stream one chat completion from any node to the terminal.

It speaks the same OpenAI wire format any client would (`stream: true`,
server-sent events), so it doubles as a check that the API really streams.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

CHAT_TIMEOUT_S = 120.0
"""A whole answer from a small model on CPUs; the stream itself keeps the
connection busy, so this only bounds a node that stops talking."""


class ChatClientError(Exception):
    """The node refused the request or the stream broke; the message says why."""


@dataclass
class ChatResult:
    text: str
    finish_reason: str | None
    usage: dict[str, int] | None


async def stream_chat(
    api: str,
    model: str,
    prompt: str,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    on_text: Callable[[str], None] = lambda text: None,
) -> ChatResult:
    """POST a streaming chat completion; call `on_text` with each piece of
    text as it arrives; return the whole answer."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for key, value in (("max_tokens", max_tokens), ("temperature", temperature), ("seed", seed)):
        if value is not None:
            body[key] = value
    parts: list[str] = []
    finish = None
    usage = None
    try:
        async with (
            httpx.AsyncClient(timeout=CHAT_TIMEOUT_S) as client,
            client.stream("POST", f"{api}/v1/chat/completions", json=body) as response,
        ):
            if response.status_code != 200:
                await response.aread()
                raise ChatClientError(_error_text(response))
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    raise ChatClientError(chunk["error"].get("message", "the stream failed"))
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content") or ""
                    if text:
                        parts.append(text)
                        on_text(text)
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        raise ChatClientError(f"cannot talk to {api}: {exc}") from exc
    return ChatResult("".join(parts), finish, usage)


def _error_text(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"
    text = (
        f"HTTP {response.status_code} {error.get('code') or error.get('type')}: {error['message']}"
    )
    retry = response.headers.get("retry-after")
    return text + (f" (retry after {retry} s)" if retry else "")
