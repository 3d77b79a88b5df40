"""The OpenAI-compatible routes (`runtime.api.openai`), in process.

The routes run in a Starlette app with the app's own exception handlers,
with the real request parser, the real `ChatQuota` and real `Generation`
records; only the chat service is scripted (`Scripted`: the deltas a chain
of hops would produce, a failure mid-stream, or a wait that never ends),
because the routes' job is the shapes, the quota and the counting, and a
real chain is tests/runtime/inference/test_chat.py's. Each request is
checked for its body, for being counted once by how it ended, and for
giving its quota slot back, an abandoned stream included (driven through
raw ASGI so the client can go away mid-stream).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from runtime.api.http import BadRequest, bad_request, chat_error, http_error, server_error
from runtime.api.openai import OpenAIRoutes, request_outcome
from runtime.api.quota import REASON_CLIENT, ChatQuota, client_key
from runtime.inference.chat import (
    GENERATION_FAILED,
    OUTCOME_CANCELLED,
    OUTCOME_CLIENT_ERROR,
    OUTCOME_MODEL_NOT_FOUND,
    OUTCOME_OK,
    OUTCOME_RATE_LIMITED,
    OUTCOME_SERVER_ERROR,
    OUTCOME_SWARM_LOST,
    ChatError,
    ChatRequest,
    Generation,
    TokenLogprob,
)

PATH = "/v1/chat/completions"
CLIENT = client_key("127.0.0.1")  # httpx's ASGI transport's client
MODELS = [{"id": "tiny", "object": "model", "owned_by": "shardmesh"}]
NEVER = trio.Event()
"""A delta that never comes: the stream waits on it until it is cancelled."""


class Scripted:
    """A chat service whose generations produce `script`: each str a delta,
    an exception raised where it stands, `NEVER` a wait that does not end."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.counters: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.requests: list[ChatRequest] = []
        self.closed = 0

    def models(self) -> list[dict[str, Any]]:
        return MODELS

    async def start(self, request: ChatRequest) -> tuple[Generation, AsyncGenerator[str, None]]:
        self.requests.append(request)
        if request.model != "tiny":
            raise ChatError(404, f"no model {request.model!r}", code="model_not_found")
        generation = Generation("chatcmpl-1", request.model, 1_700_000_000, prompt_tokens=3)
        generation.route = ["aa", "bb"]
        return generation, self._deltas(generation)

    async def _deltas(self, generation: Generation) -> AsyncGenerator[str, None]:
        try:
            for step in self.script:
                if isinstance(step, BaseException):
                    raise step
                if step is NEVER:
                    await NEVER.wait()
                generation.completion_tokens += 1
                yield step
            generation.finish_reason = "stop"
        finally:
            self.closed += 1


def app_of(chat: Scripted, quota: ChatQuota) -> Starlette:
    return Starlette(
        routes=OpenAIRoutes(chat, quota).routes(),  # type: ignore[arg-type]
        exception_handlers={
            BadRequest: bad_request,
            ChatError: chat_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )


@pytest.fixture
def quota() -> ChatQuota:
    return ChatQuota(per_client=2)


@asynccontextmanager
async def client_of(chat: Scripted, quota: ChatQuota) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app_of(chat, quota), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        yield client


async def post(chat: Scripted, quota: ChatQuota, body: Any, **kwargs: Any) -> httpx.Response:
    async with client_of(chat, quota) as client:
        return await client.post(PATH, json=body, **kwargs)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}


def events_of(response: httpx.Response) -> list[Any]:
    """The stream's `data:` payloads, JSON decoded except `[DONE]`."""
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = [line[len("data: ") :] for line in response.text.split("\n\n") if line]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


async def test_the_routes_are_the_documented_paths_and_methods(quota: ChatQuota) -> None:
    routes = OpenAIRoutes(Scripted([]), quota).routes()  # type: ignore[arg-type]
    assert {(r.path, frozenset(r.methods or ())) for r in routes} == {
        (PATH, frozenset({"POST"})),
        ("/v1/models", frozenset({"GET", "HEAD"})),
    }
    async with client_of(Scripted([]), quota) as client:
        listed = await client.get("/v1/models")
    assert listed.status_code == 200 and listed.json() == {"object": "list", "data": MODELS}


async def test_a_completion_is_openais_shape_with_our_extension(quota: ChatQuota) -> None:
    chat = Scripted(["Hel", "lo", "!"])
    answer = await post(chat, quota, chat_body(temperature=0))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    timing = body.pop("shardmesh")
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello!"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
    }
    assert timing["route"] == ["aa", "bb"] and timing["reroutes"] == 0 and "timing" in timing
    assert chat.requests[0].messages == ({"role": "user", "content": "hi"},)
    assert not chat.requests[0].stream
    assert chat.outcomes == Counter({OUTCOME_OK: 1}) and chat.closed == 1
    assert quota.in_flight(CLIENT) == 0


async def test_a_stream_is_server_sent_chunks_closed_by_usage_and_done(quota: ChatQuota) -> None:
    chat = Scripted(["Hel", "lo"])
    body = chat_body(stream=True, stream_options={"include_usage": True})
    events = events_of(await post(chat, quota, body))
    assert events[-1] == "[DONE]"
    first, *deltas, last, usage, _ = events
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert [d["choices"][0]["delta"] for d in deltas] == [{"content": "Hel"}, {"content": "lo"}]
    for chunk in (first, *deltas, last, usage):
        assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == "chatcmpl-1"
        assert chunk["model"] == "tiny" and chunk["created"] == 1_700_000_000
    assert last["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert last["shardmesh"]["route"] == ["aa", "bb"]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
    assert chat.outcomes == Counter({OUTCOME_OK: 1}) and chat.closed == 1
    assert quota.in_flight(CLIENT) == 0
    # Without include_usage there is no usage chunk.
    plain = events_of(await post(Scripted(["x"]), quota, chat_body(stream=True)))
    assert plain[-1] == "[DONE]" and "usage" not in plain[-2]


async def test_a_stream_that_fails_says_so_in_band_and_is_counted_by_why(
    quota: ChatQuota,
) -> None:
    lost = ChatError(502, "the chain broke", code=GENERATION_FAILED)
    chat = Scripted(["Hel", lost])
    events = events_of(await post(chat, quota, chat_body(stream=True)))
    assert events[-1] == {
        "error": {"message": "the chain broke", "type": "server_error", "code": GENERATION_FAILED}
    }
    assert "[DONE]" not in events and len(events) == 3  # role, "Hel", the error
    assert chat.outcomes == Counter({OUTCOME_SWARM_LOST: 1}) and chat.closed == 1
    assert quota.in_flight(CLIENT) == 0


@pytest.mark.parametrize(
    ("body", "headers", "status", "outcome"),
    [
        (chat_body(model="other"), None, 404, OUTCOME_MODEL_NOT_FOUND),
        ({"model": "tiny", "messages": []}, None, 400, OUTCOME_CLIENT_ERROR),
        (chat_body(stream="yes"), None, 400, OUTCOME_CLIENT_ERROR),
        # An unhashable role was a TypeError in the parser: a 500 (issue 30).
        (chat_body(messages=[{"role": ["user"], "content": "x"}]), None, 400, OUTCOME_CLIENT_ERROR),
        (chat_body(), {"content-type": "text/plain"}, 415, OUTCOME_CLIENT_ERROR),
    ],
)
async def test_a_refused_request_is_counted_once_and_gives_its_slot_back(
    quota: ChatQuota, body: Any, headers: Any, status: int, outcome: str
) -> None:
    chat = Scripted(["never sent"])
    if headers is None:
        answer = await post(chat, quota, body)
    else:
        async with client_of(chat, quota) as client:
            answer = await client.post(PATH, content=json.dumps(body), headers=headers)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["message"]
    assert chat.outcomes == Counter({outcome: 1}) and chat.closed == 0
    assert quota.in_flight(CLIENT) == 0


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b'"hi \\ud800"', "messages[0].content"),
        (b'[{"type": "text", "text": "\\udfff"}]', "messages[0].content[0].text"),
        (b"[" * 30_000 + b"]" * 30_000, None),
    ],
)
async def test_a_lone_surrogate_or_deep_json_is_a_400_before_the_chat_starts(
    quota: ChatQuota, content: bytes, param: str | None
) -> None:
    """Issue 30: a lone surrogate reached the tokenizer (which raises on
    it: a 500) and 30,000 nested arrays the parser's recursion limit."""
    chat = Scripted(["never sent"])
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": ' + content + b"}]}"
    async with client_of(chat, quota) as client:
        answer = await client.post(PATH, content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert ("lone surrogate" if param else "nests deeper than") in error["message"]
    assert chat.requests == [] and chat.outcomes == Counter({OUTCOME_CLIENT_ERROR: 1})


async def test_a_client_over_its_quota_gets_a_429_to_retry(quota: ChatQuota) -> None:
    for _ in range(quota.per_client):
        assert quota.acquire(CLIENT) is None  # chats in flight already
    chat = Scripted(["never sent"])
    answer = await post(chat, quota, chat_body())
    assert answer.status_code == 429
    error = answer.json()["error"]
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
    assert error["reason"] == REASON_CLIENT
    assert int(answer.headers["retry-after"]) >= 1
    assert chat.requests == []  # refused before the body was read
    assert chat.counters == Counter({f"refused_{REASON_CLIENT}": 1})
    assert chat.outcomes == Counter({OUTCOME_RATE_LIMITED: 1})
    assert quota.in_flight(CLIENT) == quota.per_client  # the others' slots, untouched


async def test_a_bug_in_the_service_is_a_500_counted_as_a_server_error(
    quota: ChatQuota,
) -> None:
    class Broken(Scripted):
        async def start(self, request: ChatRequest) -> Any:
            raise RuntimeError("a bug")

    chat = Broken([])
    answer = await post(chat, quota, chat_body())
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "internal_error"
    assert chat.outcomes == Counter({OUTCOME_SERVER_ERROR: 1})
    assert quota.in_flight(CLIENT) == 0


async def test_an_abandoned_stream_is_closed_counted_cancelled_and_frees_its_slot(
    quota: ChatQuota,
) -> None:
    chat = Scripted(["Hel", NEVER])
    app = app_of(chat, quota)
    gone = trio.Event()
    sent: list[dict[str, Any]] = []
    request = json.dumps(chat_body(stream=True)).encode()
    received = 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        if received == 1:
            return {"type": "http.request", "body": request, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if b"Hel" in message.get("body", b""):
            gone.set()  # the client goes away after the first delta

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": PATH,
        "raw_path": PATH.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"node")],
        "client": ("127.0.0.1", 5000),
        "server": ("node", 80),
    }
    with trio.fail_after(5):
        await app(scope, receive, send)  # type: ignore[arg-type]
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert chat.closed == 1  # the hops' sessions closed now, not at garbage collection
    assert chat.outcomes == Counter({OUTCOME_CANCELLED: 1})
    assert quota.in_flight(CLIENT) == 0


def test_how_a_request_ended_is_read_from_what_it_raised() -> None:
    assert request_outcome(ChatError(429, "busy")) == OUTCOME_RATE_LIMITED
    assert request_outcome(ChatError(502, "x", code=GENERATION_FAILED)) == OUTCOME_SWARM_LOST
    assert request_outcome(BadRequest("bad body")) == OUTCOME_CLIENT_ERROR
    assert request_outcome(HTTPException(415)) == OUTCOME_CLIENT_ERROR
    assert request_outcome(HTTPException(503)) == OUTCOME_SERVER_ERROR
    assert request_outcome(ValueError("a bug")) == OUTCOME_SERVER_ERROR


class Scored(Scripted):
    """`Scripted`, filing one logprob entry per delta when the request asks
    (as `ChatService` files the last hop's rows, by token text)."""

    async def start(self, request: ChatRequest) -> tuple[Generation, AsyncGenerator[str, None]]:
        generation, deltas = await super().start(request)
        if request.logprobs is not None:
            generation.logprobs = []
        return generation, self._scored(generation, deltas)

    async def _scored(
        self, generation: Generation, deltas: AsyncGenerator[str, None]
    ) -> AsyncGenerator[str, None]:
        async for delta in deltas:
            if generation.logprobs is not None:
                generation.logprobs.append(TokenLogprob(delta, -0.5, {delta: -0.5, "é": -2.0}))
            yield delta


def scored(text: str) -> dict[str, Any]:
    """The chat logprob `Scored` files for a delta."""
    alternatives = [
        {"token": text, "logprob": -0.5, "bytes": list(text.encode())},
        {"token": "é", "logprob": -2.0, "bytes": [0xC3, 0xA9]},
    ]
    return {**alternatives[0], "top_logprobs": alternatives}


async def test_chat_logprobs_are_openais_chat_shape_plain_and_streamed(quota: ChatQuota) -> None:
    body = chat_body(logprobs=True, top_logprobs=2)
    answer = (await post(Scored(["Hel", "lo"]), quota, body)).json()
    assert answer["choices"][0]["logprobs"] == {
        "content": [scored("Hel"), scored("lo")],
        "refusal": None,
    }
    events = events_of(await post(Scored(["Hel", "lo"]), quota, {**body, "stream": True}))
    _, *deltas, last, _ = events
    assert [d["choices"][0]["logprobs"]["content"] for d in deltas] == [
        [scored("Hel")],
        [scored("lo")],
    ]
    assert last["choices"][0]["logprobs"] == {"content": [], "refusal": None}
    refused = await post(Scored([]), quota, chat_body(logprobs=True, top_logprobs=6))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
    assert quota.in_flight(CLIENT) == 0


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


async def test_a_tool_call_in_the_answer_is_openais_tool_calls_plain_and_streamed(
    quota: ChatQuota,
) -> None:
    body = chat_body(tools=[WEATHER])
    answer = (await post(Scripted([CALL[:20], CALL[20:]]), quota, body)).json()
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert choice["message"]["content"] is None and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert call["id"].startswith("call_")
    events = events_of(
        await post(Scripted([CALL[:20], CALL[20:]]), quota, {**body, "stream": True})
    )
    first, last, _ = events  # the text is held to the end, where the calls are read
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    (streamed,) = last["choices"][0]["delta"]["tool_calls"]
    assert streamed["index"] == 0 and streamed["function"] == call["function"]
    # No call in the answer, or tools not offered: text as ever.
    plain = (await post(Scripted(["It is sunny."]), quota, body)).json()["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "It is sunny."}
    assert plain["finish_reason"] == "stop"
    silent = (await post(Scripted([CALL]), quota, {**body, "tool_choice": "none"})).json()
    assert silent["choices"][0]["message"]["content"] == CALL
    assert quota.in_flight(CLIENT) == 0


async def test_n_above_one_and_max_tokens_zero_are_400s_naming_them(quota: ChatQuota) -> None:
    for fields, param in (({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens")):
        refused = await post(Scripted([]), quota, chat_body(**fields))
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param
