"""Structured output: a JSON constraint and the token mask that enforces it.

A request's `response_format` (`json_object`, or `json_schema` with a
schema) becomes a `Constraint`: a small immutable value the entry puts in
the last hop's `open` (runtime.inference.protocol.constraint_field). The
last hop, which holds the logits, builds a `Matcher` from the constraint and
its model's tokenizer (`Vocabulary`), and before each draw masks every
token the grammar does not allow; an end-of-sequence token is allowed only
where the grammar accepts. The engine is llguidance (chosen by measured
per-token mask cost on CPU: docs/benchmarks.md, "Structured output").

The mask at step n is a function of (constraint, the tokens generated
before n) alone: a matcher is rebuilt by feeding it those tokens, so a last
hop after a failover and a spot check's replay mask exactly as the first
last hop did. The sampler (runtime.model.sampling) takes the mask as input.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np

from runtime.model.sampling import SamplingParamError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "CONSTRAINT_KINDS",
    "MAX_SCHEMA_CHARS",
    "Constraint",
    "ConstraintError",
    "Matcher",
    "Vocabulary",
    "json_schema_constraint",
    "response_format_from_request",
]

MAX_SCHEMA_CHARS: Final = 32 * 1024
"""A schema's canonical JSON text is at most this long: it rides in one
data-plane header (the open's), and a client's schema is untrusted input
that a hop compiles; real response and tool schemas are a few KB."""

CONSTRAINT_KINDS: Final = ("json_object", "json_schema")

JSON_LAYOUT: Final[JsonCompileOptions] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
"""Output laid out as Python's `json.dumps` does, with no free whitespace: a
model may not spend its tokens on blanks that never end the object."""

ANY_OBJECT: Final = '{"type": "object"}'
"""`json_object`'s schema: any JSON object."""


class ConstraintError(SamplingParamError):
    """A constraint is malformed or its schema does not compile; ``param``
    names the request field, for an OpenAI-style 400."""


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must be: any JSON object, or one matching `schema`
    (canonical JSON text: sorted keys, no spaces, so equal schemas share a
    digest and a compiled grammar)."""

    kind: Literal["json_object", "json_schema"]
    schema: str = ANY_OBJECT

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ConstraintError("response_format", f"type must be one of {CONSTRAINT_KINDS}")
        if len(self.schema) > MAX_SCHEMA_CHARS:
            raise ConstraintError("response_format", f"schema over {MAX_SCHEMA_CHARS} characters")

    def digest(self) -> str:
        return hashlib.sha256(f"{self.kind}\n{self.schema}".encode()).hexdigest()

    def header(self) -> dict[str, str]:
        """The constraint as the `open` carries it."""
        return {"kind": self.kind, "schema": self.schema}

    @classmethod
    def from_header(cls, value: object) -> Constraint:
        """The constraint an `open` carries; raises ConstraintError."""
        if not isinstance(value, dict) or set(value) != {"kind", "schema"}:
            raise ConstraintError("constraint", "must be {kind, schema}")
        kind, schema = value["kind"], value["schema"]
        if not isinstance(kind, str) or not isinstance(schema, str):
            raise ConstraintError("constraint", "kind and schema must be text")
        if len(schema) > MAX_SCHEMA_CHARS:
            raise ConstraintError("constraint", f"schema over {MAX_SCHEMA_CHARS} characters")
        return cls(_kind(kind), _canonical(_parsed(schema, "constraint")))


def _kind(kind: str) -> Literal["json_object", "json_schema"]:
    if kind == "json_object":
        return "json_object"
    if kind == "json_schema":
        return "json_schema"
    raise ConstraintError("response_format", f"type must be one of {CONSTRAINT_KINDS}")


def _parsed(schema: str, param: str) -> dict[str, Any]:
    try:
        value = json.loads(schema)
    except ValueError:
        raise ConstraintError(param, "schema is not JSON") from None
    if not isinstance(value, dict):
        raise ConstraintError(param, "schema must be a JSON object")
    return value


def _canonical(schema: Mapping[str, Any]) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def json_schema_constraint(schema: Mapping[str, Any], param: str = "schema") -> Constraint:
    """The constraint "a JSON object matching `schema`", checked to compile.

    For structured output and for anything else that must be one JSON value
    of a known shape (a forced tool call's arguments: `tool_choice`).
    Raises ConstraintError naming `param`."""
    if not isinstance(schema, Mapping):
        raise ConstraintError(param, "must be a JSON object")
    text = _canonical(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise ConstraintError(param, f"over {MAX_SCHEMA_CHARS} characters")
    constraint = Constraint("json_schema", text)
    error = _grammar_error(constraint)
    if error:
        raise ConstraintError(param, f"the schema is not supported: {error}"[:300])
    return constraint


def response_format_from_request(body: Mapping[str, Any]) -> Constraint | None:
    """The constraint of a request's `response_format`, or None for text.

    OpenAI's shapes: `{"type": "text"}`, `{"type": "json_object"}`,
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
    Raises ConstraintError (param `response_format`)."""
    value = body.get("response_format")
    if value is None:
        return None
    param = "response_format"
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise ConstraintError(param, "must be an object with a type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise ConstraintError(param, "type must be text, json_object or json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise ConstraintError(param, "json_schema must be an object with a name")
    if spec.get("strict") is not None and type(spec["strict"]) is not bool:
        raise ConstraintError(param, "json_schema.strict must be a boolean")
    schema = spec.get("schema", {"type": "object"})
    return json_schema_constraint(schema, "response_format.json_schema.schema")


# --- the engine -------------------------------------------------------------------

_GRAMMARS: dict[str, str] = {}
"""Compiled grammar text by constraint digest (bounded: `_GRAMMAR_CACHE`)."""
_GRAMMAR_CACHE: Final = 256
"""Distinct schemas a process keeps compiled; past it the cache starts over."""
_LOCK = threading.Lock()


def _grammar(constraint: Constraint) -> str:
    """llguidance's grammar for `constraint`, compiled once per digest."""
    import llguidance

    key = constraint.digest()
    with _LOCK:
        found = _GRAMMARS.get(key)
    if found is None:
        found = llguidance.LLMatcher.grammar_from_json_schema(
            constraint.schema, overrides=JSON_LAYOUT
        )
        with _LOCK:
            if len(_GRAMMARS) >= _GRAMMAR_CACHE:
                _GRAMMARS.clear()
            _GRAMMARS[key] = found
    return found


def _grammar_error(constraint: Constraint) -> str:
    """Why llguidance refuses the constraint's schema; "" when it compiles."""
    import llguidance

    try:
        return llguidance.LLMatcher.validate_grammar(_grammar(constraint))
    except ValueError as exc:
        return str(exc)


class Vocabulary:
    """A model's tokenizer as the grammar engine sees it (building one costs
    ~1 s on a 150k vocabulary: a hop builds it once, on the first constraint)."""

    def __init__(self, tokenizer_dir: Path) -> None:
        import llguidance.hf
        from transformers import AutoTokenizer

        from runtime.model.backends import IMPORT_LOCK

        with IMPORT_LOCK:  # transformers' lazy imports are not thread-safe
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.tokens = llguidance.hf.from_tokenizer(tokenizer)  # type: ignore[arg-type]
        self.size = int(self.tokens.vocab_size)
        self.eos = int(self.tokens.eos_token)


class Matcher:
    """The grammar's state after some generated tokens: `allowed` is the
    mask for the next token, `advance` feeds the token drawn."""

    def __init__(self, vocabulary: Vocabulary, constraint: Constraint) -> None:
        import llguidance

        self._vocabulary = vocabulary
        self._matcher = llguidance.LLMatcher(vocabulary.tokens, _grammar(constraint))
        if self._matcher.is_error():
            raise ConstraintError("constraint", self._matcher.get_error()[:300])

    @classmethod
    def after(
        cls, vocabulary: Vocabulary, constraint: Constraint, history: Sequence[int]
    ) -> Matcher:
        """A matcher that has consumed `history` (tokens the grammar allowed)."""
        matcher = cls(vocabulary, constraint)
        for token in history:
            matcher.advance(token)
        return matcher

    def allowed(self, size: int) -> np.ndarray:
        """Which of `size` token ids (the logits' width, which may pad past
        the tokenizer's) may come next: a boolean vector. After the grammar
        is complete only end of sequence; ids past the tokenizer never."""
        import llguidance.numpy as llnp

        words = llnp.allocate_token_bitmask(1, self._vocabulary.size)
        llnp.fill_next_token_bitmask(self._matcher, words, 0)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self._vocabulary.size]
        mask = np.zeros(size, dtype=bool)
        width = min(size, bits.shape[0])
        mask[:width] = bits[:width].astype(bool)
        return mask

    def advance(self, token: int) -> None:
        """Feed a drawn token; ConstraintError if the grammar refuses it."""
        if not self._matcher.consume_token(int(token)):
            raise ConstraintError("constraint", f"token {token} breaks the grammar")
