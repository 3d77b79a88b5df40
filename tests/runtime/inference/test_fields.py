"""`runtime.inference.fields`: `check_fields` applies each keyword a table uses, naming the field.

The tables themselves are checked against the parsers and the published
document in tests/runtime/api/test_openapi.py; here each keyword
`check_fields` reads is shown refusing a value that breaks it and taking
one that keeps it, and null stands for a field left out.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from runtime.inference.fields import Field, FieldError, check_fields

CASES: list[tuple[dict[str, Any], object, object, str]] = [
    ({"type": "integer"}, 3, True, "must be an integer"),
    ({"type": "integer"}, 3, 3.0, "must be an integer"),
    ({"type": "number"}, 0.5, "0.5", "must be a number"),
    ({"type": "boolean"}, False, 0, "must be true or false"),
    ({"enum": [1]}, 1, 2, "must be one of [1]"),
    ({"minimum": 1}, 1, 0, "at least 1"),
    ({"maximum": 5}, 5, 6, "at most 5"),
    ({"exclusiveMinimum": 0}, 0.1, 0, "greater than 0"),
    ({"minItems": 1}, [1], [], "at least 1 items"),
    ({"maxItems": 1}, [1], [1, 2], "at most 1 items"),
    ({"minLength": 1}, "a", "", "must not be empty"),
    ({"maxLength": 0}, "", "x", "at most 0 characters"),
    (
        {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": 1}]},
        ["a"],
        ["a", "b"],
        "must be a string or an array",
    ),
]


@pytest.mark.parametrize(("schema", "good", "bad", "message"), CASES)
def test_each_keyword_refuses_what_breaks_it_naming_the_field(
    schema: dict[str, Any], good: object, bad: object, message: str
) -> None:
    fields = (Field("other", {"type": "string"}, ""), Field("x", schema, ""))
    check_fields({"x": good}, fields)
    with pytest.raises(FieldError, match=re.escape(message)) as caught:
        check_fields({"x": bad}, fields)
    assert caught.value.param == "x" and str(caught.value).startswith("x ")


def test_null_or_absent_is_left_out_and_the_first_bad_field_is_named() -> None:
    fields = (Field("a", {"type": "integer"}, ""), Field("b", {"type": "integer"}, ""))
    check_fields({"a": None}, fields)
    check_fields({"unlisted": "anything"}, fields)
    with pytest.raises(FieldError) as caught:
        check_fields({"b": "x", "a": "y"}, fields)
    assert caught.value.param == "a"
