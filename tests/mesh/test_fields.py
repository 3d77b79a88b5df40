"""The field checks every decoder shares (`mesh.fields`): each returns the
value (normalized where it says so) or raises `FieldError` naming the field
and the rule, never the value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mesh.fields import (
    MAX_UINT,
    FieldError,
    array,
    boolean,
    bounded_bytes,
    fixed_bytes,
    hex_text,
    is_uint,
    number,
    one_of,
    reraise_as,
    sequence,
    span,
    text,
    uint,
)


def refused(check: object, *args: object, **kwargs: object) -> FieldError:
    assert callable(check)
    with pytest.raises(FieldError) as caught:
        check(*args, **kwargs)
    return caught.value


def test_uint_takes_exact_ints_in_range_and_never_a_bool() -> None:
    assert uint(0, "n") == 0
    assert uint(MAX_UINT, "n") == MAX_UINT
    assert uint(5, "n", low=5, high=5) == 5
    for bad in (-1, MAX_UINT + 1, True, 1.0, "1", None):
        error = refused(uint, bad, "term")
        assert error.detail == "term must be an integer in [0, 2**63)"
        assert error.value == bad
    assert refused(uint, 9, "hops", low=1, high=8).detail == "hops must be an integer in [1, 8]"


def test_is_uint_answers_instead_of_refusing() -> None:
    assert is_uint(3)
    assert is_uint(3, low=3, high=3)
    assert not is_uint(True)
    assert not is_uint(-1)
    assert not is_uint(4, high=3)


def test_boolean_is_true_or_false_not_one_or_zero() -> None:
    assert boolean(True, "b") is True
    assert boolean(False, "b") is False
    for bad in (1, 0, None, "true"):
        assert refused(boolean, bad, "spare").detail == "spare must be a bool"


def test_number_is_finite_and_always_a_plain_float() -> None:
    assert number(3, "x") == 3.0 and type(number(3, "x")) is float
    assert type(number(np.float64(0.5), "x")) is float
    assert number(-2.5, "x") == -2.5
    for bad in (math.nan, math.inf, -math.inf, True, "1", None):
        assert refused(number, bad, "rate").detail == "rate must be a finite number"
    assert refused(number, -0.1, "rate", non_negative=True).detail == (
        "rate must be a finite number >= 0"
    )
    assert number(0, "rate", non_negative=True) == 0.0


def test_text_bounds_length_and_optionally_printable_ascii() -> None:
    assert text("abc", "name", max_chars=3) == "abc"
    assert text("", "note", max_chars=3, min_chars=0) == ""
    assert refused(text, "", "name", max_chars=3).detail == (
        "name must be a non-empty string of at most 3 chars"
    )
    assert refused(text, "abcd", "name", max_chars=3, min_chars=0).detail == (
        "name must be a string of at most 3 chars"
    )
    assert refused(text, "ab", "id", max_chars=4, min_chars=4).detail == (
        "id must be a string of exactly 4 chars"
    )
    assert refused(text, "a", "x", max_chars=4, min_chars=2).detail == (
        "x must be a string of 2 to 4 chars"
    )
    assert refused(text, "a\nb", "model", max_chars=8, printable=True).detail == (
        "model must be a non-empty printable string of at most 8 chars"
    )
    assert refused(text, "hé", "addr", max_chars=8, printable=True, ascii_only=True).detail == (
        "addr must be a non-empty printable ASCII string of at most 8 chars"
    )
    assert refused(text, b"abc", "name", max_chars=3).value == b"abc"


def test_hex_text_has_one_spelling_per_value() -> None:
    assert hex_text("00ff", "digest", max_chars=4) == "00ff"
    for bad in ("00FF", "0x1", "zz", "", 12):
        assert refused(hex_text, bad, "digest", max_chars=4).detail == (
            "digest must be a non-empty lowercase hex string of at most 4 chars"
        )


def test_one_of_names_the_choices_sorted() -> None:
    assert one_of("q8", "recipe", frozenset({"fp32", "q8"})) == "q8"
    error = refused(one_of, "q3", "recipe", frozenset({"q8", "fp32", "bf16"}))
    assert error.detail == "recipe must be one of bf16, fp32, q8"
    assert refused(one_of, 8, "recipe", {"q8"}).value == 8


def test_byte_strings_exact_or_bounded() -> None:
    assert fixed_bytes(b"\x00" * 32, "node", size=32) == b"\x00" * 32
    assert refused(fixed_bytes, b"\x00" * 31, "node", size=32).detail == "node must be 32 bytes"
    assert refused(fixed_bytes, bytearray(32), "node", size=32).detail == "node must be 32 bytes"
    assert bounded_bytes(b"", "body") == b""
    assert bounded_bytes(b"ab", "body", max_bytes=2) == b"ab"
    assert refused(bounded_bytes, b"abc", "body", max_bytes=2).detail == (
        "body must be bytes of at most 2"
    )
    assert refused(bounded_bytes, b"", "body", non_empty=True).detail == (
        "body must be non-empty bytes"
    )
    assert refused(bounded_bytes, "ab", "body").detail == "body must be bytes"


def test_span_is_a_half_open_pair_returned_as_a_tuple() -> None:
    assert span([0, 3], "layers") == (0, 3)
    assert span((2, 5), "layers", high=5) == (2, 5)
    assert refused(span, [3, 3], "layers").detail == "layers must satisfy a < b"
    assert refused(span, [0, 6], "layers", high=5).detail == (
        "layers[1] must be an integer in [0, 5]"
    )
    assert refused(span, [-1, 2], "layers").detail == "layers[0] must be an integer in [0, 2**63)"
    for bad in ([0], [0, 1, 2], "01", None):
        assert refused(span, bad, "layers").detail == "layers must be a pair [a, b)"


def test_array_and_sequence_bound_their_items() -> None:
    assert array([1, 2], "body", size=2) == [1, 2]
    assert refused(array, (1, 2), "body", size=2).detail == "body must be an array of 2"
    assert refused(array, [1], "body", size=2).detail == "body must be an array of 2"
    assert sequence((1, 2), "models", max_items=2) == (1, 2)
    assert sequence([], "models", max_items=2) == []
    assert refused(sequence, [1, 2, 3], "models", max_items=2).detail == (
        "models must be a sequence of <= 2"
    )
    assert refused(sequence, "ab", "models", max_items=2).detail == (
        "models must be a sequence of <= 2"
    )


def test_reraise_as_translates_at_the_callers_boundary() -> None:
    class RecordError(Exception):
        pass

    @reraise_as(lambda error: RecordError(f"record_bad_field: {error.detail}"))
    def build(value: object) -> int:
        return uint(value, "seq")

    assert build(4) == 4
    with pytest.raises(RecordError, match=r"^record_bad_field: seq must be an integer") as caught:
        build(-4)
    assert caught.value.__cause__ is None
    assert build.__name__ == "build"


def test_a_field_error_is_not_a_value_error() -> None:
    """It must reach its caller's boundary, not an unrelated `except ValueError`."""
    assert not issubclass(FieldError, ValueError)
