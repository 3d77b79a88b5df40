"""The OpenAI-compatible routes: `POST /v1/chat/completions` and `GET /v1/models`.

`runtime.inference.chat` does the work; this module speaks OpenAI's shapes
(a completion, or server-sent chunks when `stream` is true) and adds our
`shardmesh` extension (the route, failovers and timing) that OpenAI clients
ignore.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.api.http import json_object
from runtime.inference.chat import ChatError, ChatService, Generation, parse_chat_request


def openai_routes(chat: ChatService) -> list[Route]:
    """The routes, served from `chat`."""

    async def chat_completions(request: Request) -> Response:
        request_ = parse_chat_request(await json_object(request))
        generation, deltas = await chat.start(request_)
        if not request_.stream:
            async with aclosing(deltas):
                text = "".join([delta async for delta in deltas])
            return JSONResponse(_completion_json(generation, text))

        async def events() -> AsyncIterator[str]:
            # aclosing: a client that disconnects cancels this generator,
            # and the hops' sessions must close now, not at garbage collection.
            yield _chunk(generation, {"role": "assistant", "content": ""}, None)
            try:
                async with aclosing(deltas):
                    async for delta in deltas:
                        yield _chunk(generation, {"content": delta}, None)
            except ChatError as exc:
                # Headers are gone: report in-band, as OpenAI does mid-stream.
                error = {"message": exc.message, "type": "server_error", "code": exc.code}
                yield f"data: {json.dumps({'error': error})}\n\n"
                return
            last = _chunk_json(generation, {}, generation.finish_reason)
            last["shardmesh"] = _shardmesh_json(generation)
            yield f"data: {json.dumps(last)}\n\n"
            if request_.include_usage:
                usage = {
                    "id": generation.id,
                    "object": "chat.completion.chunk",
                    "created": generation.created,
                    "model": generation.model,
                    "choices": [],
                    "usage": _usage(generation),
                }
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": chat.models()})

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
    ]


def _completion_json(generation: Generation, text: str) -> dict[str, Any]:
    return {
        "id": generation.id,
        "object": "chat.completion",
        "created": generation.created,
        "model": generation.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": generation.finish_reason,
            }
        ],
        "usage": _usage(generation),
        "shardmesh": _shardmesh_json(generation),
    }


def _shardmesh_json(generation: Generation) -> dict[str, Any]:
    """Our extension to a completion (OpenAI clients ignore unknown fields):
    the chain it ran through, its failovers, and where its time went."""
    return {
        "route": generation.route,
        "reroutes": generation.reroutes,
        "timing": generation.timing_json(),
    }


def _usage(generation: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
    }


def _chunk(generation: Generation, delta: dict[str, Any], finish: str | None) -> str:
    return f"data: {json.dumps(_chunk_json(generation, delta, finish))}\n\n"


def _chunk_json(
    generation: Generation, delta: dict[str, Any], finish: str | None
) -> dict[str, Any]:
    return {
        "id": generation.id,
        "object": "chat.completion.chunk",
        "created": generation.created,
        "model": generation.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
