"""The OpenAI-compatible routes: `POST /v1/chat/completions` and `GET /v1/models`.

`runtime.inference.chat` does the work; this module speaks OpenAI's shapes
(a completion, or server-sent chunks when `stream` is true) and adds our
`shardmesh` extension (the route, failovers and timing) that OpenAI clients
ignore. Each client may run a few chats at once (`runtime.api.quota`); one
more gets `429` with `Retry-After`, and a stream holds its slot until it has
ended, failed or been abandoned. `OpenAIRoutes.serve` is that machinery for
every generating route: `runtime.api.completions` serves text completions
through it.

Each request is counted once by how it ended (`ChatService.outcomes`, the
`OUTCOMES` of `runtime.inference.chat`): a JSON answer or a refusal when
the route returns or raises, a stream when it is over.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from functools import partial
from typing import Any, Final

import trio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from runtime.api.http import BadRequest, json_object
from runtime.api.quota import ChatQuota, client_key
from runtime.inference.chat import (
    OUTCOME_CANCELLED,
    OUTCOME_CLIENT_ERROR,
    OUTCOME_OK,
    OUTCOME_SERVER_ERROR,
    ChatError,
    ChatRequest,
    ChatService,
    Generation,
    TokenLogprob,
    parse_chat_request,
)
from runtime.inference.tools import ToolCall, parse_tool_calls


class OpenAIRoutes:
    """`POST /v1/chat/completions` and `GET /v1/models`, served from `chat`,
    each client's chats in flight bounded by `quota` (`ChatQuota()`: the
    documented limits)."""

    def __init__(self, chat: ChatService, quota: ChatQuota) -> None:
        self.chat = chat
        self.quota = quota

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
        ]

    async def chat_completions(self, request: Request) -> Response:
        """A chat completion (`serve` of `answer_chat`)."""
        return await self.serve(request, self.answer_chat)

    async def serve(self, request: Request, respond: Respond) -> Response:
        """`respond`'s answer to the request's JSON body (a chat, or a text
        completion: `runtime.api.completions`), served under the client's
        quota and counted once by how it ended."""
        outcomes = self.chat.outcomes
        try:
            response = await self._answer(request, respond)
        except Exception as exc:
            outcomes[request_outcome(exc)] += 1
            raise
        except BaseException:  # cancelled: the client went away, or the node stops
            outcomes[OUTCOME_CANCELLED] += 1
            raise
        if not isinstance(response, _SlotStream):  # a stream counts itself once over
            outcomes[OUTCOME_OK] += 1
        return response

    async def _answer(self, request: Request, respond: Respond) -> Response:
        """`respond`'s answer (JSON, or a stream that holds the client's
        quota slot until it is over); 429 when the client has no slot left."""
        # Before the body is read: a slow upload holds a slot too.
        client = client_key(request.client.host if request.client else None)
        self._acquire(client)
        streaming = False
        try:
            answer = await respond(await json_object(request))
            if isinstance(answer, Response):
                return answer
            events, ending = answer
            response = _SlotStream(events, release=partial(self._stream_over, client, ending))
            streaming = True  # the response releases the slot once it is over
            return response
        finally:
            if not streaming:
                self.quota.release(client)

    async def answer_chat(self, body: dict[str, Any]) -> Response | Streamed:
        """A chat completion of `body`: JSON, or its stream's events."""
        request = parse_chat_request(body)
        generation, deltas = await self.chat.start(request)
        if not request.stream:
            message = _message(request, generation, await collect(deltas))
            return JSONResponse(_completion_json(generation, message))
        ending = Ending()
        return _events(request, generation, deltas, ending), ending

    def _acquire(self, client: str) -> None:
        """Take one of `client`'s quota slots, or raise the 429 that says why not."""
        refusal = self.quota.acquire(client)
        if refusal is None:
            return
        self.chat.counters[f"refused_{refusal.reason}"] += 1
        raise ChatError(
            429,
            refusal.message,
            type_="requests",  # OpenAI's rate-limit error: type "requests"
            code="rate_limit_exceeded",
            headers={"Retry-After": str(refusal.retry_after_s)},
            extra={"reason": refusal.reason},
        )

    def _stream_over(self, client: str, ending: Ending) -> None:
        """A stream is over: count how it ended and give its slot back."""
        self.chat.outcomes[ending.outcome] += 1
        self.quota.release(client)

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": self.chat.models()})


def request_outcome(exc: Exception) -> str:
    """How a request that raised `exc` ended (one of `runtime.inference.chat.OUTCOMES`)."""
    if isinstance(exc, ChatError):
        return exc.outcome
    if isinstance(exc, BadRequest):
        return OUTCOME_CLIENT_ERROR
    if isinstance(exc, HTTPException) and exc.status_code < 500:  # 415: not sent as JSON
        return OUTCOME_CLIENT_ERROR
    return OUTCOME_SERVER_ERROR


class Ending:
    """How a stream ended, as far as it got: cancelled until it says otherwise."""

    __slots__ = ("outcome",)

    def __init__(self) -> None:
        self.outcome = OUTCOME_CANCELLED


Streamed = tuple[AsyncGenerator[str, None], Ending]
"""A streamed answer: its server-sent events, and how it ended."""
Respond = Callable[[dict[str, Any]], Awaitable[Response | Streamed]]
"""What answers one request's JSON body (`OpenAIRoutes.serve`)."""


async def collect(deltas: AsyncGenerator[str, None]) -> str:
    """A whole completion's text, its generator closed at once."""
    async with aclosing(deltas):
        return "".join([delta async for delta in deltas])


def sse(value: dict[str, Any]) -> str:
    """One server-sent event of JSON."""
    return f"data: {json.dumps(value)}\n\n"


def stream_error(exc: ChatError, ending: Ending) -> str:
    """A stream's in-band error (headers are gone), as OpenAI sends one."""
    ending.outcome = exc.outcome
    return sse({"error": {"message": exc.message, "type": "server_error", "code": exc.code}})


STREAM_CLOSE_TIMEOUT_S: Final = 5.0
"""How long an abandoned stream may take to close its hops' sessions (a few
local sends) before its quota slot is given back anyway."""


class _SlotStream(StreamingResponse):
    """An SSE response that holds its client's quota slot until it is over:
    sent to the end, failed, or abandoned by a client that disconnected.

    Starlette cancels a stream whose client went away; the generator may
    then be left suspended at a `yield` (never resumed, closed only by the
    garbage collector), with sessions open on every hop. So once the
    response is over, the generator is closed here, shielded and bounded,
    and only then is the slot released."""

    def __init__(self, events: AsyncGenerator[str, None], release: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(STREAM_CLOSE_TIMEOUT_S):
                        await self._events.aclose()
            finally:
                self._release()


async def _events(
    request: ChatRequest,
    generation: Generation,
    deltas: AsyncGenerator[str, None],
    ending: Ending,
) -> AsyncGenerator[str, None]:
    """The server-sent events of one streamed completion, each delta with
    the logprobs of the tokens since the last; `ending` says how it ended
    (left cancelled when the client goes away first). With tools offered
    the text is held to the end, where it is parsed for calls: a delta of
    calls, or of the text when there were none."""
    # aclosing: a client that disconnects cancels this generator,
    # and the hops' sessions must close now, not at garbage collection.
    yield _chunk(generation, {"role": "assistant", "content": ""}, None)
    sent = 0
    held: list[str] = []
    try:
        async with aclosing(deltas):
            async for text in deltas:
                if _tools_offered(request):
                    held.append(text)
                    continue
                entries = (generation.logprobs or [])[sent:]
                sent += len(entries)
                yield _chunk(generation, {"content": text}, None, _logprobs(generation, entries))
    except ChatError as exc:
        yield stream_error(exc, ending)
        return
    ending.outcome = OUTCOME_OK  # the answer is whole; what follows only closes it
    entries = (generation.logprobs or [])[sent:]
    delta = _message(request, generation, "".join(held)) if held else {}
    delta.pop("role", None)
    for index, call in enumerate(delta.get("tool_calls", [])):
        call["index"] = index
    last = _chunk_json(generation, delta, generation.finish_reason, _logprobs(generation, entries))
    last["shardmesh"] = shardmesh_json(generation)
    yield sse(last)
    if request.include_usage:
        usage = {
            "id": generation.id,
            "object": "chat.completion.chunk",
            "created": generation.created,
            "model": generation.model,
            "choices": [],
            "usage": usage_json([generation]),
        }
        yield sse(usage)
    yield "data: [DONE]\n\n"


def _tools_offered(request: ChatRequest) -> bool:
    return request.tools is not None and request.tools.offered


def _message(request: ChatRequest, generation: Generation, text: str) -> dict[str, Any]:
    """The answer's message: its text, or the calls parsed from it (when
    tools were offered and the model made any: `finish_reason` tool_calls)."""
    calls: list[ToolCall] = []
    if request.tools is not None and _tools_offered(request):
        names = frozenset(f["function"]["name"] for f in request.tools.functions)
        text, calls = parse_tool_calls(text, names, generation.id.rsplit("-", 1)[-1][:24])
    if not calls:
        return {"role": "assistant", "content": text}
    generation.finish_reason = "tool_calls"
    return {
        "role": "assistant",
        "content": text or None,
        "tool_calls": [call.to_json() for call in calls],
    }


def _logprobs(generation: Generation, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
    """A chat choice's `logprobs` of `entries`, or None when not asked for."""
    if generation.logprobs is None:
        return None
    return {"content": [_token_json(entry) for entry in entries], "refusal": None}


def _token_json(entry: TokenLogprob) -> dict[str, Any]:
    """One token's chat logprob: its text, logprob, UTF-8 bytes and alternatives."""
    top = entry.top or {}
    return {
        **_scored(entry.text, entry.logprob),
        "top_logprobs": [_scored(text, logprob) for text, logprob in top.items()],
    }


def _scored(text: str, logprob: float | None) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _completion_json(generation: Generation, message: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": generation.id,
        "object": "chat.completion",
        "created": generation.created,
        "model": generation.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _logprobs(generation, generation.logprobs or []),
                "finish_reason": generation.finish_reason,
            }
        ],
        "usage": usage_json([generation]),
        "shardmesh": shardmesh_json(generation),
    }


def shardmesh_json(generation: Generation) -> dict[str, Any]:
    """Our extension to a completion (OpenAI clients ignore unknown fields):
    the chain it ran through, its failovers, and where its time went."""
    return {
        "route": generation.route,
        "reroutes": generation.reroutes,
        "timing": generation.timing_json(),
    }


def usage_json(generations: Sequence[Generation]) -> dict[str, int]:
    """The tokens of one answer's generations (one per prompt), OpenAI's `usage`."""
    prompt = sum(g.prompt_tokens for g in generations)
    completion = sum(g.completion_tokens for g in generations)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _chunk(
    generation: Generation,
    delta: dict[str, Any],
    finish: str | None,
    logprobs: dict[str, Any] | None = None,
) -> str:
    return sse(_chunk_json(generation, delta, finish, logprobs))


def _chunk_json(
    generation: Generation,
    delta: dict[str, Any],
    finish: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {
        "id": generation.id,
        "object": "chat.completion.chunk",
        "created": generation.created,
        "model": generation.model,
        "choices": [choice],
    }
