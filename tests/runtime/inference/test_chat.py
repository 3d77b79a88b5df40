"""Chat at the entry, the parts that need no swarm: the request's checks
(logprobs, tools and a history of tool calls among them), the model's
template with and without tools, and the held-back tail.

Chats through real chains are in tests/runtime/inference/test_slow_hops.py
and across processes in tests/processes/test_inference.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runtime.inference.chat import (
    MAX_MESSAGES,
    NO_CHAT_TEMPLATE,
    NO_TOOL_TEMPLATE,
    ChatError,
    Generation,
    ModelTokenizer,
    _held_back,
    parse_chat_request,
    template_takes_tools,
)
from runtime.inference.protocol import MAX_TOP_LOGPROBS
from runtime.model.manifest import has_chat_template
from runtime.model.sampling import StopScanner
from runtime.model.tiny import make_tiny_model

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML template with a place for tools, as Qwen's and Hermes' have."""


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
        ({"model": "m", "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": MESSAGES, "logprobs": 1}, "logprobs"),
        ({"model": "m", "messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        (
            {"model": "m", "messages": MESSAGES, "logprobs": True, "top_logprobs": 20},
            "top_logprobs",
        ),
        ({"model": "m", "messages": MESSAGES, "tools": [{"type": "x"}]}, "tools[0]"),
        (
            {
                "model": "m",
                "messages": MESSAGES,
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        (
            {
                "model": "m",
                "messages": MESSAGES,
                "tools": [{**WEATHER, "function": {"name": "f", "parameters": {"type": 3}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {"model": "m", "messages": [{"role": "tool", "content": "1"}]},
            "messages[0].tool_call_id",
        ),
        (
            {"model": "m", "messages": [{"role": "assistant", "tool_calls": "add"}]},
            "messages[0].tool_calls",
        ),
    ],
)
def test_a_bad_field_is_a_400_that_names_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ChatError) as caught:
        parse_chat_request(body)
    assert caught.value.status == 400
    assert caught.value.param == param


def test_chat_logprobs_are_top_logprobs_alternatives_or_none() -> None:
    def top(**fields: Any) -> int | None:
        return parse_chat_request({"model": "m", "messages": MESSAGES, **fields}).logprobs

    assert top() is None and top(logprobs=False) is None
    assert top(logprobs=True) == 0
    assert top(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS) == MAX_TOP_LOGPROBS


def test_a_forced_call_constrains_the_answer_to_that_call() -> None:
    def constraint(choice: Any) -> Any:
        body = {"model": "m", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": choice}
        return parse_chat_request(body).params.constraint

    assert constraint("auto") is None and constraint("none") is None
    forced = constraint({"type": "function", "function": {"name": "get_weather"}})
    assert forced is not None and forced.kind == "json_schema"
    assert json.loads(forced.schema)["properties"]["name"] == {"const": "get_weather"}
    assert constraint("required") == forced, "one tool: required is that tool"


def test_a_history_of_tool_calls_is_kept_as_templates_read_it() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    request = parse_chat_request(
        {
            "model": "m",
            "tools": [WEATHER],
            "messages": [
                *MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "sunny"},
            ],
        }
    )
    assert request.tools is not None and request.tools.offered
    assert request.messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {}}
    assert request.messages[2] == {
        "role": "tool",
        "content": "sunny",
        "tool_call_id": "c1",
        "name": "f",
    }


def test_tools_are_rendered_by_a_template_that_takes_them_and_refused_by_one_that_does_not(
    tmp_path: Path,
) -> None:
    folder = make_tiny_model(tmp_path / "chat", layers=1, with_manifest=False)
    plain = ModelTokenizer(folder)
    assert plain.has_chat_template and not plain.takes_tools
    with pytest.raises(ChatError) as caught:
        plain.encode_chat(MESSAGES, [WEATHER])
    assert caught.value.status == 400 and caught.value.code == NO_TOOL_TEMPLATE
    assert caught.value.param == "tools"
    # A call it is made to write: the tools described by us, in its system message.
    described = plain.decode(plain.encode_chat(MESSAGES, [WEATHER], forced=True))
    assert "get_weather" in described and '"arguments"' in described
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tooled = ModelTokenizer(folder)
    assert tooled.takes_tools
    rendered = tooled.decode(tooled.encode_chat(MESSAGES, [WEATHER]))
    assert "get_weather" in rendered and rendered == tooled.decode(
        tooled.encode_chat(MESSAGES, [WEATHER])
    )
    assert "get_weather" not in tooled.decode(tooled.encode_chat(MESSAGES))
    assert template_takes_tools("{% generation %}{{ tools }}")  # a tag of transformers' own
    assert not template_takes_tools("{% for m in messages %}{{ m.content }}{% endfor %}")


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
