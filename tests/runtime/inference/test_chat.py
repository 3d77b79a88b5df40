"""Chat at the entry, the parts that need no swarm: the request's checks and the held-back tail.

Chats through real chains are in tests/runtime/inference/test_slow_hops.py
and across processes in tests/processes/test_inference.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.inference.chat import (
    MAX_MESSAGES,
    NO_CHAT_TEMPLATE,
    ChatError,
    Generation,
    ModelTokenizer,
    _held_back,
    parse_chat_request,
)
from runtime.model.manifest import has_chat_template
from runtime.model.sampling import StopScanner
from runtime.model.tiny import make_tiny_model

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_request_is_parsed_strictly() -> None:
    request = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 5,
        }
    )
    assert request.model == "m" and request.stream and request.include_usage
    assert request.messages[1] == {"role": "user", "content": "ab"}, "text parts joined"
    assert request.params.max_tokens == 5
    assert not parse_chat_request({"model": "m", "messages": MESSAGES, "stream": None}).stream


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MESSAGES}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": MESSAGES * (MAX_MESSAGES + 1)}, "messages"),
        ({"model": "m", "messages": ["hi"]}, "messages[0]"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content",
        ),
        ({"model": "m", "messages": MESSAGES, "stream": "yes"}, "stream"),
        ({"model": "m", "messages": MESSAGES, "stream_options": ["usage"]}, "stream_options"),
        ({"model": "m", "messages": MESSAGES, "n": 2}, "n"),
        ({"model": "m", "messages": MESSAGES, "temperature": -1}, "temperature"),
    ],
)
def test_a_bad_field_is_a_400_that_names_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ChatError) as caught:
        parse_chat_request(body)
    assert caught.value.status == 400
    assert caught.value.param == param


def generation() -> Generation:
    return Generation(id="g", model="m", created=0, prompt_tokens=1)


def test_held_back_text_is_released_when_no_stop_came() -> None:
    scanner = StopScanner(["END"])
    assert scanner.feed("hello E").text == "hello "
    done = generation()
    assert _held_back(scanner, "", done) == "E", "the start of a stop that never came"
    assert done.finish_reason is None


def test_a_stop_in_the_held_back_text_ends_the_completion_there() -> None:
    scanner = StopScanner(["END"])
    assert scanner.feed("hello E").text == "hello "
    done = generation()
    assert _held_back(scanner, "ND and more", done) == ""
    assert done.finish_reason == "stop"


def test_a_model_without_a_chat_template_refuses_chat_naming_completions(
    tmp_path: Path,
) -> None:
    """Issue 32: transformers' ValueError ("Cannot use chat template
    functions because tokenizer.chat_template is not set") was a 500."""
    folder = make_tiny_model(tmp_path / "base", layers=1, chat_template=False, with_manifest=False)
    tokenizer = ModelTokenizer(folder)
    assert not tokenizer.has_chat_template and not has_chat_template(folder)
    with pytest.raises(ChatError) as caught:
        tokenizer.encode_chat(MESSAGES)
    assert caught.value.status == 400 and caught.value.code == NO_CHAT_TEMPLATE
    assert "/v1/completions" in caught.value.message
    assert tokenizer.decode(tokenizer.encode_text("hello there")) == "hello there"
