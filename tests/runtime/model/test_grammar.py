"""Structured output's constraint and its token mask, on the tiny tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from transformers import AutoTokenizer

from runtime.model.grammar import (
    MAX_SCHEMA_CHARS,
    Constraint,
    ConstraintError,
    Matcher,
    Vocabulary,
    json_schema_constraint,
    response_format_from_request,
)
from runtime.model.sampling import SamplingParamError, SamplingParams, sample
from runtime.model.tiny import write_tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["colour", "ok", "n"],
    "additionalProperties": False,
}
WIDTH = 600
"""The logits' width: past the tiny tokenizer's 512 tokens, as a padded LM head is."""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def vocabulary(tokenizer_dir: Path) -> Vocabulary:
    return Vocabulary(tokenizer_dir)


def request(response_format: object) -> dict[str, Any]:
    return {"response_format": response_format}


def test_response_formats_become_constraints() -> None:
    assert response_format_from_request({}) is None
    assert response_format_from_request(request({"type": "text"})) is None
    assert response_format_from_request(request({"type": "json_object"})) == Constraint(
        "json_object"
    )
    spec = {"name": "answer", "schema": SCHEMA, "strict": True}
    found = response_format_from_request(request({"type": "json_schema", "json_schema": spec}))
    assert found is not None and json.loads(found.schema) == SCHEMA
    # Equal schemas, however laid out, share one digest (one compiled grammar).
    again = json_schema_constraint(json.loads(json.dumps(SCHEMA, indent=3)))
    assert again.digest() == found.digest()
    assert SamplingParams.from_request(request({"type": "json_object"})).constraint is not None


@pytest.mark.parametrize(
    "response_format",
    [
        "json",
        {"type": "yaml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": 1}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frog"}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"d": "x" * MAX_SCHEMA_CHARS}},
        },
    ],
)
def test_a_bad_response_format_is_a_parameter_error(response_format: object) -> None:
    with pytest.raises(SamplingParamError) as caught:
        SamplingParams.from_request(request(response_format))
    assert caught.value.param.startswith("response_format")


@pytest.mark.parametrize(
    "value",
    [
        None,
        [],
        {"kind": "json_object"},
        {"kind": "xml", "schema": "{}"},
        {"kind": "json_schema", "schema": "{"},
    ],
)
def test_a_malformed_header_constraint_is_refused(value: object) -> None:
    with pytest.raises(ConstraintError):
        Constraint.from_header(value)
    header = Constraint("json_schema", json_schema_constraint(SCHEMA).schema).header()
    assert Constraint.from_header(header) == json_schema_constraint(SCHEMA)


def generate(vocabulary: Vocabulary, constraint: Constraint, seed: int) -> list[int]:
    """Random logits, masked and sampled until end of sequence."""
    matcher = Matcher(vocabulary, constraint)
    rng = np.random.default_rng(seed)
    tokens: list[int] = []
    params = SamplingParams(temperature=1.0)
    for step in range(200):
        logits = rng.normal(size=WIDTH).astype(np.float32)
        allowed = matcher.allowed(WIDTH)
        assert not allowed[vocabulary.size :].any()
        token = sample(logits, params, seed=seed, step=step, history=tokens, allowed=allowed)
        if token == vocabulary.eos:
            return tokens
        matcher.advance(token)
        tokens.append(token)
    raise AssertionError("the grammar never allowed the end")


def test_masked_random_logits_always_give_valid_json(
    vocabulary: Vocabulary, tokenizer_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    constraint = json_schema_constraint(SCHEMA)
    for seed in range(10):
        value = json.loads(tokenizer.decode(generate(vocabulary, constraint, seed)))
        jsonschema.validate(value, SCHEMA)
    value = json.loads(tokenizer.decode(generate(vocabulary, Constraint("json_object"), 3)))
    assert isinstance(value, dict)


def test_a_rebuilt_matcher_masks_as_the_running_one(vocabulary: Vocabulary) -> None:
    constraint = json_schema_constraint(SCHEMA)
    tokens = generate(vocabulary, constraint, 5)
    running = Matcher(vocabulary, constraint)
    for index, token in enumerate(tokens):
        rebuilt = Matcher.after(vocabulary, constraint, tokens[:index])
        assert np.array_equal(rebuilt.allowed(WIDTH), running.allowed(WIDTH))
        running.advance(token)
    end = running.allowed(WIDTH)
    assert end[vocabulary.eos] and end.sum() == 1  # complete: only the end of sequence


def test_end_of_sequence_only_where_the_grammar_accepts(vocabulary: Vocabulary) -> None:
    matcher = Matcher(vocabulary, Constraint("json_object"))
    assert not matcher.allowed(WIDTH)[vocabulary.eos]
    with pytest.raises(ConstraintError):
        matcher.advance(vocabulary.eos)
