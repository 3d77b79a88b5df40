"""The fields a generating request takes, as one table the parser and the API document share.

`/v1/chat/completions` and `/v1/completions` bodies are described field by
field (`Field`: its JSON Schema and what it does). The request parsers
(`runtime.inference.chat.parse_chat_request`,
`runtime.inference.completion.parse_completion_request`) first check every
field present against its schema with `check_fields` (a 400 naming the
field), then parse what the schema cannot say (nested messages, prompts,
tools); `runtime.api.openapi` writes the same schemas into
`GET /openapi.json`. So the document cannot describe a field the parser
does not take, or a type or bound it does not apply. `check_fields` reads
the few keywords the tables use (type, enum, bounds, lengths, anyOf) on
each field's own value, not what nests in it; JSON null is a field left
out, as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from runtime.inference.protocol import MAX_TOP_LOGPROBS
from runtime.model.sampling import MAX_PENALTY, MAX_STOP_SEQUENCES, MAX_TEMPERATURE, SEED_MODULUS


@dataclass(frozen=True)
class Field:
    """One request field: its name, its value's JSON Schema, what it does."""

    name: str
    schema: Mapping[str, Any]
    description: str


class FieldError(ValueError):
    """A field's value does not match its schema."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


_JSON_TYPES: Final = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}
_NAMES: Final = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true or false",
    "array": "an array",
    "object": "an object",
}


def _is(value: object, kind: str) -> bool:
    if kind != "boolean" and isinstance(value, bool):  # True is an int to Python, not JSON
        return False
    return isinstance(value, _JSON_TYPES[kind])


def check_fields(body: Mapping[str, Any], fields: Sequence[Field]) -> None:
    """Each of `fields` that `body` holds (not null) matches its schema;
    FieldError naming the first that does not."""
    for field in fields:
        value = body.get(field.name)
        if value is not None:
            _check(value, field.schema, field.name)


def _check(value: object, schema: Mapping[str, Any], param: str) -> None:
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                _check(value, option, param)
                return
            except FieldError:
                continue
        raise FieldError(f"{param} must be {_describe(schema)}", param)
    kind = schema.get("type")
    if kind is not None and not _is(value, kind):
        raise FieldError(f"{param} must be {_NAMES[kind]}", param)
    if "enum" in schema and value not in schema["enum"]:
        raise FieldError(f"{param} must be one of {schema['enum']}", param)
    if "minimum" in schema and value < schema["minimum"]:
        raise FieldError(f"{param} must be at least {schema['minimum']}", param)
    if "maximum" in schema and value > schema["maximum"]:
        raise FieldError(f"{param} must be at most {schema['maximum']}", param)
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        raise FieldError(f"{param} must be greater than {schema['exclusiveMinimum']}", param)
    if "minItems" in schema and len(value) < schema["minItems"]:  # type: ignore[arg-type]
        raise FieldError(f"{param} must have at least {schema['minItems']} items", param)
    if "maxItems" in schema and len(value) > schema["maxItems"]:  # type: ignore[arg-type]
        raise FieldError(f"{param} must have at most {schema['maxItems']} items", param)
    if "minLength" in schema and len(value) < schema["minLength"]:  # type: ignore[arg-type]
        raise FieldError(f"{param} must not be empty", param)
    if "maxLength" in schema and len(value) > schema["maxLength"]:  # type: ignore[arg-type]
        raise FieldError(f"{param} must be at most {schema['maxLength']} characters", param)


def _describe(schema: Mapping[str, Any]) -> str:
    kinds = dict.fromkeys(_NAMES.get(option.get("type"), "a value") for option in schema["anyOf"])
    return " or ".join(kinds)


BOOLEAN: Final = {"type": "boolean"}
STOP_SEQUENCE: Final = {"type": "string", "minLength": 1}

SAMPLING_FIELDS: Final = (
    Field(
        "temperature",
        {"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE},
        "0 is greedy (ties to the lowest token id); default 1",
    ),
    Field(
        "top_p",
        {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "nucleus sampling: the smallest set of best tokens reaching this mass; default 1",
    ),
    Field("top_k", {"type": "integer", "minimum": 0}, "only the k best tokens; 0 (default) is off"),
    Field(
        "seed",
        {"type": "integer", "minimum": -SEED_MODULUS // 2, "maximum": SEED_MODULUS - 1},
        "the same seed, parameters and prompt give the same tokens",
    ),
    Field(
        "max_tokens",
        {"type": "integer", "minimum": 1},
        "the most tokens to generate (0 is refused: this API has no scoring-only mode)",
    ),
    Field(
        "stop",
        {
            "anyOf": [
                STOP_SEQUENCE,
                {"type": "array", "items": STOP_SEQUENCE, "maxItems": MAX_STOP_SEQUENCES},
            ]
        },
        "up to four sequences; the text ends before the first, which is not returned",
    ),
    *(
        Field(
            name,
            {"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
            "subtracted from the logit of each token already generated "
            + ("once" if name == "presence_penalty" else "once per time it was generated"),
        )
        for name in ("presence_penalty", "frequency_penalty")
    ),
    Field(
        "response_format",
        {"type": "object"},
        '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
        '{"schema": ...}}: the output is constrained to parse (and validate)',
    ),
)
"""What `runtime.model.sampling.SamplingParams.from_request` reads, in both bodies."""

STREAM_FIELDS: Final = (
    Field("model", {"type": "string", "minLength": 1}, "a model the swarm serves (GET /v1/models)"),
    Field("stream", BOOLEAN, "server-sent events, closed by `data: [DONE]`"),
    Field(
        "stream_options",
        {
            "type": "object",
            "properties": {"include_usage": BOOLEAN},
        },
        "`include_usage`: a last event with the request's token counts",
    ),
    Field("n", {"type": "integer", "enum": [1]}, "choices per request: 1 only"),
)
"""The fields both bodies take beyond sampling's."""

TOP_LOGPROBS: Final = {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}
"""Alternatives per token: the last hop sends at most MAX_TOP_LOGPROBS (OpenAI's chat allows 20)."""
