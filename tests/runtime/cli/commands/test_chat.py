"""`shardmesh chat`: what it prints while it waits, as it streams, and at the end
(the chat client itself: tests/runtime/cli/test_chat_client.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from runtime.cli import chat_client
from runtime.cli.chat_client import ChatClientError, ChatResult, ModelLoading
from runtime.cli.commands.chat import chat_timing
from runtime.cli.main import main

TIMING = {"ttft_ms": 28.4, "decode_ms_per_token": 9.12, "hops": [{}, {}, {}]}


def test_the_timing_line_says_where_the_time_went() -> None:
    def timed(timing: object) -> str:
        return chat_timing(ChatResult("", "stop", None, {"timing": timing}))

    assert timed(TIMING) == "; first token 28 ms, 9.1 ms/token through 3 hops"
    assert timed({**TIMING, "hops": [{}]}) == "; first token 28 ms, 9.1 ms/token through 1 hop"
    assert timed({**TIMING, "hops": None}) == "; first token 28 ms, 9.1 ms/token"
    assert timed({**TIMING, "decode_ms_per_token": None}) == ""  # a one-token answer
    assert timed("nonsense") == ""
    assert chat_timing(ChatResult("", "stop", None)) == ""  # another OpenAI server


def test_chat_streams_the_answer_and_sums_it_up(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked: dict[str, Any] = {}

    async def stream_chat(
        api: str,
        model: str,
        prompt: str,
        *,
        on_text: Callable[[str], None],
        on_wait: Callable[[ModelLoading, float], None],
        **options: Any,
    ) -> ChatResult:
        asked.update(api=api, model=model, prompt=prompt, **options)
        on_wait(ModelLoading("loading", {"model": "m", "layers": 8, "covered": [[0, 4]]}, 2), 2.0)
        on_text("Hello")
        on_text(", swarm")
        usage = {"prompt_tokens": 5, "completion_tokens": 2}
        return ChatResult("Hello, swarm", "stop", usage, {"timing": TIMING})

    monkeypatch.setattr(chat_client, "stream_chat", stream_chat)
    argv = ["chat", "--api", "127.0.0.1:1", "--model", "m", "hi", "--seed", "3", "--wait", "9"]
    assert main(argv) == 0
    assert asked == {
        "api": "http://127.0.0.1:1", "model": "m", "prompt": "hi", "max_tokens": None,
        "temperature": None, "seed": 3, "wait_s": 9.0,
    }  # fmt: skip
    out, err = capsys.readouterr()
    assert out == "Hello, swarm\n"
    assert err.splitlines() == [
        "shardmesh chat: waiting for m: 4/8 layers served (asking again in 2 s)",
        "[stop; 5 prompt + 2 completion tokens; first token 28 ms, 9.1 ms/token through 3 hops]",
    ]


def test_a_failed_chat_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def stream_chat(*args: Any, **kwargs: Any) -> ChatResult:
        raise ChatClientError("HTTP 404: no model 'm'")

    monkeypatch.setattr(chat_client, "stream_chat", stream_chat)
    assert main(["chat", "--api", "127.0.0.1:1", "--model", "m", "hi"]) == 1
    assert capsys.readouterr().err == "shardmesh chat: error: HTTP 404: no model 'm'\n"
