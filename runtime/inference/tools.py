"""Tool calls (OpenAI's `tools`/`tool_choice`): the request side and the parse.

A chat request may offer the model functions to call (`tools`). They are
rendered into the prompt by the model's own chat template (transformers'
`apply_chat_template(tools=...)`, `runtime.inference.chat.ModelTokenizer`),
and the model answers in whatever form its training taught it; this module
reads the calls back out of the finished text, as a pure function of text:
`<tool_call>{...}</tool_call>` blocks (the Hermes/Qwen/SmolLM form), or a
whole answer that is one JSON call object or a list of them (the Llama 3
form). Anything that does not parse as a call stays text: a model's output
is untrusted, and a malformed call is the model's answer, never a 500.
Parsing the request's `tools`, `tool_choice` and the history's
`tool_calls` (400s naming the field) is here too, and what makes a call
sure: `forced_call_schema`, the one JSON call `tool_choice` "required" or
a named function allows (the last hop's constrained decoding writes it);
`untemplated_chat`, the tools described and the calls written out as text
for a template that has no place for them (docs/design/api.md#tool-calls).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

MAX_TOOLS: Final = 128
"""OpenAI's own bound on `tools`; bounds the prompt one request can render."""
MAX_TOOL_CALLS: Final = 32
"""Calls read from one answer; more are left as text (a runaway model)."""
FUNCTION_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for a function's name."""
TOOL_CALL_BLOCK: Final = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOL_CHOICES: Final = ("none", "auto", "required")


class ToolError(ValueError):
    """A bad `tools`/`tool_choice`/`tool_calls` field: the message, and the param."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: an id of ours, the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def to_json(self) -> dict[str, Any]:
        """OpenAI's `tool_calls[]` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Tools:
    """A request's validated tools (OpenAI's `tools[]` entries) and choice."""

    functions: tuple[dict[str, Any], ...]
    choice: str | dict[str, Any]

    @property
    def offered(self) -> bool:
        """Whether the model is told about the tools (not `tool_choice: none`)."""
        return bool(self.functions) and self.choice != "none"

    @property
    def forces(self) -> bool:
        """Whether the answer must be a call (`"required"` or a named function)."""
        return self.choice == "required" or isinstance(self.choice, dict)


def parse_tools(body: Mapping[str, Any]) -> Tools | None:
    """The request's `tools` and `tool_choice`, or None when it has no tools."""
    listed = body.get("tools")
    choice = body.get("tool_choice")
    if listed is None:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice names a tool but the request has no tools", "tool_choice")
        return None
    if not isinstance(listed, list) or len(listed) > MAX_TOOLS:
        raise ToolError(f"tools must be an array of at most {MAX_TOOLS} tools", "tools")
    functions = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(listed))
    names = [f["function"]["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools name the same function twice", "tools")
    return Tools(functions, _choice(choice, names))


def _tool(tool: object, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ToolError(f'{where} must be an object of type "function"', where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function must be an object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise ToolError(
            f"{where}.function.name must be 1 to 64 letters, digits, _ or -",
            f"{where}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(
            f"{where}.function.description must be a string", f"{where}.function.description"
        )
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ToolError(
            f"{where}.function.parameters must be a JSON schema object",
            f"{where}.function.parameters",
        )
    clean = {"name": name, "parameters": parameters}
    if description is not None:
        clean["description"] = description
    return {"type": "function", "function": clean}


def _choice(choice: object, names: list[str]) -> str | dict[str, Any]:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ToolError(
                f"tool_choice must be one of {list(TOOL_CHOICES)} or a function", "tool_choice"
            )
        return choice
    named = choice.get("function") if isinstance(choice, dict) else None
    name = named.get("name") if isinstance(named, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise ToolError('tool_choice must be a string or {"type": "function", ...}', "tool_choice")
    if name not in names:
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def forced_call_schema(tools: Tools) -> dict[str, Any] | None:
    """The JSON schema of the call `tool_choice` forces: any offered function
    ("required") or the named one, as `{"name", "arguments"}` (the form
    `parse_tool_calls` reads); None when the model chooses ("auto", "none")."""
    if not tools.forces:
        return None
    functions = [tool["function"] for tool in tools.functions]
    if isinstance(tools.choice, dict):
        named = tools.choice["function"]["name"]
        functions = [function for function in functions if function["name"] == named]
    calls = [_call_schema(function) for function in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": _closed(function["parameters"]),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _closed(parameters: Mapping[str, Any]) -> Mapping[str, Any]:
    """A function's parameters with no keys besides those it declares, unless
    it says otherwise (as OpenAI's strict mode has them): a model made to
    write the call spends no tokens on keys the function never reads (a
    135M model, left free, copied the schema's own keywords in)."""
    if "properties" in parameters and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


TOOLS_PROMPT: Final = (
    "You can call these functions, each given as a JSON schema:\n{functions}\n"
    'To call one, answer with only a JSON object: {{"name": <the function\'s name>, '
    '"arguments": <an object of its parameters>}}.'
)
"""What a model whose chat template has no place for tools is told of them
(a system message; `untemplated_chat`)."""


def untemplated_chat(
    messages: Sequence[Mapping[str, Any]], functions: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """The chat as a template without tools renders it: `functions`
    described in the system message (`TOOLS_PROMPT`), an assistant's calls
    written as the JSON it was asked to answer with, and a tool's result as
    a user message naming the function that returned it (such templates
    read only `role` and `content`, and may know no `tool` role)."""
    names: dict[str, str] = {}
    chat: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            names.update((call["id"], call["function"]["name"]) for call in calls)
            written = [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in calls
            ]
            text = json.dumps(written[0] if len(written) == 1 else written)
            chat.append({"role": "assistant", "content": text})
        elif message["role"] == "tool":
            name = message.get("name") or names.get(message.get("tool_call_id", ""), "the function")
            chat.append({"role": "user", "content": f"{name} returned: {message['content']}"})
        else:
            chat.append({"role": message["role"], "content": message["content"]})
    if functions:
        listed = "\n".join(json.dumps(f["function"], ensure_ascii=False) for f in functions)
        described = TOOLS_PROMPT.format(functions=listed)
        if chat and chat[0]["role"] == "system":
            chat[0] = {"role": "system", "content": f"{chat[0]['content']}\n\n{described}"}
        else:
            chat.insert(0, {"role": "system", "content": described})
    return chat


def history_calls(calls: object, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, as chat templates read them: each
    function's `arguments` an object (OpenAI sends JSON text)."""
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
        raise ToolError(f"{where} must be an array of at most {MAX_TOOL_CALLS} calls", where)
    parsed = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolError(f"{at} must be a call with function.name", at)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ToolError(
                    f"{at}.function.arguments is not JSON", f"{at}.function.arguments"
                ) from None
        call_id = call.get("id")
        parsed.append(
            {
                "id": call_id if isinstance(call_id, str) else "",
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return parsed


def parse_tool_calls(
    text: str, names: frozenset[str], id_prefix: str
) -> tuple[str, list[ToolCall]]:
    """The text the model wrote besides its calls, and the calls of the
    functions in `names` it made (ids `call_<id_prefix>_<i>`); when any
    call does not parse, none do: the text as it came."""
    found = _found_calls(text, names)
    if found is None:
        return text, []
    rest, calls = found
    numbered = [ToolCall(f"call_{id_prefix}_{i}", c.name, c.arguments) for i, c in enumerate(calls)]
    return rest, numbered


def _found_calls(text: str, names: frozenset[str]) -> tuple[str, list[ToolCall]] | None:
    """`<tool_call>` blocks and the text around them, else a whole answer
    that is a call or a list of calls; None when there is no call, or any
    one of them does not parse."""
    blocks = TOOL_CALL_BLOCK.findall(text)
    if blocks:
        calls = [_call(block, names) for block in blocks[: MAX_TOOL_CALLS + 1]]
        if len(calls) > MAX_TOOL_CALLS or None in calls:
            return None
        return TOOL_CALL_BLOCK.sub("", text).strip(), [c for c in calls if c is not None]
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        value = json.loads(stripped)
    except (ValueError, RecursionError):  # a model may nest past the parser's depth
        return None
    items = value if isinstance(value, list) else [value]
    if not 0 < len(items) <= MAX_TOOL_CALLS:
        return None
    calls = [_call_object(item, names) for item in items]
    return None if None in calls else ("", [c for c in calls if c is not None])


def _call(source: str, names: frozenset[str]) -> ToolCall | None:
    try:
        value = json.loads(source)
    except (ValueError, RecursionError):
        return None
    return _call_object(value, names)


def _call_object(value: object, names: frozenset[str]) -> ToolCall | None:
    """`{"name": ..., "arguments"|"parameters": {...}}` of an offered function."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return ToolCall("", name, json.dumps(arguments))
