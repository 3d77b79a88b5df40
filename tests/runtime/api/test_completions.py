"""`POST /v1/completions` (`runtime.api.completions`), in process.

The route runs in a Starlette app with the app's own exception handlers,
the real request parser (`runtime.inference.completion`), the real
`ChatQuota` and real `Generation` records; the chat service is
`tests.runtime.api.test_openai`'s `Scripted` one (the deltas a chain would
produce), here also filing logprobs as a chain's last hop would. Checked:
the legacy shapes (one choice per prompt, `echo`, `logprobs` with text
offsets, server-sent chunks closed by usage and `[DONE]`), refusals as
400s in OpenAI's shape (`suffix` among them), each request counted once
and its quota slot given back. Real chains: tests/processes/test_completions.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from runtime.api.completions import PATH, completion_routes, logprobs_json
from runtime.api.http import BadRequest, bad_request, chat_error, http_error, server_error
from runtime.api.openai import OpenAIRoutes
from runtime.api.quota import ChatQuota
from runtime.inference.chat import (
    OUTCOME_CLIENT_ERROR,
    OUTCOME_OK,
    OUTCOME_SWARM_LOST,
    ChatError,
    Generation,
    TokenLogprob,
)
from runtime.inference.completion import PromptCompletion
from tests.runtime.api.test_openai import CLIENT, Scripted, events_of


class Filing(Scripted):
    """`Scripted`, filing one logprob entry per delta when asked (the
    prompt's first, with `echo`), as `ChatService` files the last hop's."""

    async def start(self, request: Any) -> tuple[Generation, AsyncGenerator[str, None]]:
        generation, deltas = await super().start(request)
        if request.logprobs is not None:
            generation.logprobs = []
            if request.echo:
                generation.logprobs.append(TokenLogprob("say", None, None))
                generation.prompt_text = "say"
        return generation, self._filed(generation, deltas)

    async def _filed(
        self, generation: Generation, deltas: AsyncGenerator[str, None]
    ) -> AsyncGenerator[str, None]:
        async for delta in deltas:
            if generation.logprobs is not None:
                generation.logprobs.append(TokenLogprob(delta, -0.5, {delta: -0.5, "z": -2.0}))
            yield delta


def app_of(chat: Scripted, quota: ChatQuota) -> Starlette:
    openai = OpenAIRoutes(chat, quota)  # type: ignore[arg-type]
    return Starlette(
        routes=completion_routes(openai),
        exception_handlers={
            BadRequest: bad_request,
            ChatError: chat_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )


async def post(chat: Scripted, body: Any, quota: ChatQuota | None = None) -> httpx.Response:
    quota = quota or ChatQuota(per_client=2)
    transport = httpx.ASGITransport(app=app_of(chat, quota), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        answer = await client.post(PATH, json=body)
    assert quota.in_flight(CLIENT) == 0, "the slot is given back"
    return answer


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "say", **extra}


async def test_a_completion_is_the_legacy_shape() -> None:
    chat = Filing(["Hel", "lo"])
    answer = await post(chat, body(max_tokens=5, temperature=0))
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert (got["id"], got["object"], got["model"]) == ("chatcmpl-1", "text_completion", "tiny")
    (choice,) = got["choices"]
    assert (choice["text"], choice["index"], choice["finish_reason"]) == ("Hello", 0, "stop")
    assert choice["logprobs"] is None
    assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert got["shardmesh"]["route"] == ["aa", "bb"]
    (request,) = chat.requests
    assert isinstance(request, PromptCompletion) and request.prompt == "say"
    assert (request.params.max_tokens, request.params.temperature) == (5, 0.0)
    assert chat.outcomes == Counter({OUTCOME_OK: 1}) and chat.closed == 1


async def test_echo_and_logprobs_with_text_offsets() -> None:
    got = (await post(Filing(["Hel", "lo"]), body(echo=True, logprobs=1))).json()
    (choice,) = got["choices"]
    assert choice["text"] == "sayHello"
    assert choice["logprobs"] == {
        "tokens": ["say", "Hel", "lo"],
        "token_logprobs": [None, -0.5, -0.5],
        "top_logprobs": [None, {"Hel": -0.5, "z": -2.0}, {"lo": -0.5, "z": -2.0}],
        "text_offset": [0, 3, 6],
    }
    # Without echo the offsets count from the prompt's end, as OpenAI's do.
    plain = (await post(Filing(["Hel"]), body(logprobs=0))).json()["choices"][0]["logprobs"]
    assert plain["text_offset"] == [3]


async def test_a_list_of_prompts_is_a_choice_each_in_order() -> None:
    chat = Filing(["ok"])
    got = (await post(chat, body(prompt=["one", [1, 2, 3]]))).json()
    assert [(c["index"], c["text"]) for c in got["choices"]] == [(0, "ok"), (1, "ok")]
    assert [r.prompt for r in chat.requests] == ["one", (1, 2, 3)]
    assert got["usage"]["completion_tokens"] == 2
    assert chat.outcomes == Counter({OUTCOME_OK: 1}) and chat.closed == 2


async def test_a_stream_is_chunks_with_their_logprobs_then_usage_and_done() -> None:
    chat = Filing(["Hel", "lo"])
    streamed = body(stream=True, echo=True, logprobs=1, stream_options={"include_usage": True})
    events = events_of(await post(chat, streamed))
    assert events[-1] == "[DONE]"
    echo, *deltas, last, usage, _ = events
    assert echo["choices"][0]["text"] == "say"
    assert [d["choices"][0]["text"] for d in deltas] == ["Hel", "lo"]
    tokens = [t for e in (echo, *deltas, last) for t in e["choices"][0]["logprobs"]["tokens"]]
    assert tokens == ["say", "Hel", "lo"]  # each once, in order
    offsets = [o for e in (echo, *deltas) for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 3, 6]
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["text"] == ""
    assert all(e["object"] == "text_completion" for e in (echo, *deltas, last, usage))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
    assert chat.outcomes == Counter({OUTCOME_OK: 1}) and chat.closed == 1


async def test_a_stream_that_fails_says_so_in_band() -> None:
    chat = Scripted(["Hel", ChatError(503, "lost", code="generation_failed")])
    events = events_of(await post(chat, body(stream=True)))
    assert events[-1]["error"]["code"] == "generation_failed" and "[DONE]" not in events
    assert chat.outcomes == Counter({OUTCOME_SWARM_LOST: 1})


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"suffix": "and the end"}, "suffix"),
        ({"prompt": None}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [["a"]]}, "prompt[0]"),
        ({"prompt": ["ok", 3]}, "prompt[1]"),
        ({"prompt": [1, -2]}, "prompt[1]"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"model": ""}, "model"),
    ],
)
async def test_a_bad_field_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    chat = Scripted(["never sent"])
    answer = await post(chat, body(**fields))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"]
    assert chat.outcomes == Counter({OUTCOME_CLIENT_ERROR: 1}) and chat.requests == []


def test_logprobs_json_counts_offsets_from_where_the_text_starts() -> None:
    entries = [TokenLogprob("a", None, None), TokenLogprob("bc", -1.0, {"bc": -1.0})]
    assert logprobs_json(entries, 5)["text_offset"] == [5, 6]
