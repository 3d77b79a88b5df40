"""Tool calls (`runtime.inference.tools`): the request's tools and the parse of an answer.

The parse is a pure function of the model's text, and that text is
untrusted: a call is read only when it names an offered function and its
arguments are a JSON object; anything else (broken JSON, an unknown
function, deep nesting, a runaway number of calls) leaves the answer as
text, never an exception.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime.inference.tools import (
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    ToolError,
    Tools,
    forced_call_schema,
    history_calls,
    parse_tool_calls,
    parse_tools,
    untemplated_chat,
)

NAMES = frozenset({"get_weather", "add"})
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def calls_of(text: str) -> tuple[str, list[tuple[str, str, dict[str, Any]]]]:
    rest, calls = parse_tool_calls(text, NAMES, "x")
    return rest, [(c.id, c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_blocks_are_read_with_the_text_around_them() -> None:
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    assert calls_of(text) == (
        "Let me look.",
        [("call_x_0", "get_weather", {"city": "Paris"}), ("call_x_1", "add", {"a": 1})],
    )


def test_a_whole_answer_that_is_a_call_or_a_list_of_calls_is_read() -> None:
    one = ' {"name": "add", "parameters": {"a": 1, "b": 2}} '
    assert calls_of(one) == ("", [("call_x_0", "add", {"a": 1, "b": 2})])
    both = '[{"name": "add", "arguments": {}}, {"name": "get_weather"}]'
    assert [name for _, name, _ in calls_of(both)[1]] == ["add", "get_weather"]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        "",
        '{"name": "rm_rf", "arguments": {}}',  # not an offered function
        '{"name": "add", "arguments": [1, 2]}',  # arguments not an object
        '{"name": "add", "arguments": "not json"}',
        '{"name": 3}',
        '{"arguments": {}}',
        '{"name": "add", "arguments": {"a": 1}',  # cut off mid-object
        '<tool_call>{"name": "add"}</tool_call><tool_call>{oops}</tool_call>',
        "<tool_call>" + "[" * 100_000 + "</tool_call>",  # past the JSON parser's depth
        "[" * 100_000,
        "[]",
        "[1, 2]",
        '"just a string"',
        "<tool_call>unclosed {",
        '<tool_call>{"name": "add"}</tool_call>' * (MAX_TOOL_CALLS + 1),
        "\x00\ud800<tool_call>\ud800</tool_call>",
    ],
)
def test_anything_that_is_not_an_offered_call_stays_text(text: str) -> None:
    assert parse_tool_calls(text, NAMES, "x") == (text, [])


def test_tools_and_tool_choice_are_parsed_strictly() -> None:
    tools = parse_tools({"tools": [WEATHER]})
    assert tools is not None and tools.choice == "auto" and tools.offered
    assert tools.functions[0]["function"]["name"] == "get_weather"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert parse_tools({"tools": [WEATHER], "tool_choice": named}).choice == named  # type: ignore[union-attr]
    silent = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert silent is not None and not silent.offered
    assert parse_tools({}) is None and parse_tools({"tool_choice": "none"}) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [WEATHER] * (MAX_TOOLS + 1)}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_a_bad_tools_field_names_itself(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ToolError) as caught:
        parse_tools(body)
    assert caught.value.param == param


def test_history_calls_give_templates_their_arguments_as_objects() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    assert history_calls(calls, "m") == [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    ]
    for bad, param in (
        ("add", "m"),
        ([{"function": {}}], "m[0]"),
        ([{"function": {"name": "add", "arguments": "{"}}], "m[0].function.arguments"),
    ):
        with pytest.raises(ToolError) as caught:
            history_calls(bad, "m")
        assert caught.value.param == param


def test_the_forced_call_is_one_of_the_offered_functions_or_the_named_one() -> None:
    offered = [_function("add", {"type": "object"}), _function("neg", {"type": "integer"})]
    assert forced_call_schema(_tools(offered, "auto")) is None
    assert forced_call_schema(_tools(offered, "none")) is None
    required = forced_call_schema(_tools(offered, "required"))
    assert required is not None
    assert [c["properties"]["name"]["const"] for c in required["anyOf"]] == ["add", "neg"]
    named = forced_call_schema(_tools(offered, {"type": "function", "function": {"name": "neg"}}))
    assert named == {
        "type": "object",
        "properties": {"name": {"const": "neg"}, "arguments": {"type": "integer"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    closed = forced_call_schema(_tools([_function("f", {"properties": {"x": {}}})], "required"))
    assert closed is not None
    assert closed["properties"]["arguments"]["additionalProperties"] is False
    # What the constraint lets through is what the parser reads as a call.
    text, calls = parse_tool_calls('{"name": "neg", "arguments": {}}', frozenset({"neg"}), "g")
    assert text == "" and [c.name for c in calls] == ["neg"]


def test_a_chat_without_a_tool_template_gets_the_tools_and_calls_as_text() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    chat = untemplated_chat(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "add one"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ],
        [_function("add", {"type": "object"})],
    )
    assert chat[0]["role"] == "system" and chat[0]["content"].startswith("be brief\n\n")
    assert '"name": "add"' in chat[0]["content"]
    assert chat[2] == {"role": "assistant", "content": '{"name": "add", "arguments": {"a": 1}}'}
    assert chat[3] == {"role": "user", "content": "add returned: 2"}
    bare = untemplated_chat([{"role": "user", "content": "hi"}], [_function("add", {})])
    assert [m["role"] for m in bare] == ["system", "user"]
    assert untemplated_chat([{"role": "user", "content": "hi"}], None) == [
        {"role": "user", "content": "hi"}
    ]


def _function(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _tools(functions: list[dict[str, Any]], choice: Any) -> Tools:
    return Tools(tuple(functions), choice)
