"""Field checks: one vocabulary for every value a node reads or writes.

The membership wire, node records, the Raft codec, the ledger and the
data-plane headers all check the same kinds of field (unsigned integers,
bools, bounded text, fixed-size bytes, finite numbers, layer spans), here,
so a rule and its message are written once. Every check takes the value,
then the field's name, then keyword-only bounds, and returns the value
(normalized where said) or raises `FieldError`, which each caller turns into
its own error at its boundary (`reraise_as`). Types are exact: `True` is
never a count. Messages name the field and the rule, never the value.

Details and each caller's error: docs/design/wire.md#field-checks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection
from typing import Any, Final, ParamSpec, TypeVar, cast

__all__ = [
    "MAX_UINT",
    "FieldError",
    "array",
    "boolean",
    "bounded_bytes",
    "fixed_bytes",
    "hex_text",
    "is_uint",
    "number",
    "one_of",
    "reraise_as",
    "sequence",
    "span",
    "text",
    "uint",
]

MAX_UINT: Final = 2**63 - 1
"""The largest integer field: counters, terms, epochs and indexes are stored as
sqlite INTEGER (signed 64-bit) and CBOR encodes them without bignum tags."""

_HEX_DIGITS: Final = frozenset("0123456789abcdef")

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound=str)


class FieldError(Exception):
    """A field that breaks its rule. `detail` names the field and the rule
    (never the value); `value` is the offending value, for trusted callers.

    Not a `ValueError` on purpose: it must reach its caller's boundary and be
    translated there, not be swallowed by an unrelated ``except ValueError``.
    """

    def __init__(self, detail: str, value: object = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.value = value


def reraise_as(
    to: Callable[[FieldError], Exception],
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator: a `FieldError` escaping the function is raised as ``to(error)``.

    For validation that runs in constructors (a record's or a ledger
    command's ``__post_init__``), where the caller's error is the contract.
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def translated(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except FieldError as exc:
                raise to(exc) from None

        return translated

    return decorate


def _interval(low: int, high: int) -> str:
    """``[low, high]``, or ``[low, 2**k)`` when high is one below a large power of two."""
    if high >= 2**16 and (high + 1) & high == 0:
        return f"[{low}, 2**{high.bit_length()})"
    return f"[{low}, {high}]"


# --- scalars ------------------------------------------------------------------


def is_uint(value: object, *, low: int = 0, high: int = MAX_UINT) -> bool:
    """Whether `value` is an int (not a bool) in [low, high]; for callers that
    branch rather than refuse."""
    return type(value) is int and low <= value <= high


def uint(value: object, name: str, *, low: int = 0, high: int = MAX_UINT) -> int:
    """An int (not a bool) in [low, high]; by default [0, 2**63)."""
    if type(value) is not int or not low <= value <= high:
        raise FieldError(f"{name} must be an integer in {_interval(low, high)}", value)
    return value


def boolean(value: object, name: str) -> bool:
    """True or False (not 0 or 1)."""
    if type(value) is not bool:
        raise FieldError(f"{name} must be a bool", value)
    return value


def number(value: object, name: str, *, non_negative: bool = False) -> float:
    """A finite real number (an int is accepted: another encoder may shrink 3.0
    to 3), returned as a float so that equal values compare and encode equal.
    NaN would make equal states compare unequal; inf means nothing here."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(f"{name} must be a finite number", value)
    result = float(value)
    if not math.isfinite(result):
        raise FieldError(f"{name} must be a finite number", value)
    if non_negative and result < 0:
        raise FieldError(f"{name} must be a finite number >= 0", value)
    return result


def _string_rule(kind: str, min_chars: int, max_chars: int) -> str:
    if min_chars == max_chars:
        return f"a {kind} of exactly {max_chars} chars"
    if min_chars == 0:
        return f"a {kind} of at most {max_chars} chars"
    if min_chars == 1:
        return f"a non-empty {kind} of at most {max_chars} chars"
    return f"a {kind} of {min_chars} to {max_chars} chars"


def text(
    value: object,
    name: str,
    *,
    max_chars: int,
    min_chars: int = 1,
    printable: bool = False,
    ascii_only: bool = False,
) -> str:
    """A str of `min_chars` to `max_chars` characters (non-empty by default).

    `printable` refuses control characters and line breaks (names shown in
    logs and tables); `ascii_only` with it makes an address loggable unescaped.
    """
    if (
        type(value) is not str
        or not min_chars <= len(value) <= max_chars
        or (printable and not value.isprintable())
        or (ascii_only and not value.isascii())
    ):
        kind = f"{'printable ' if printable else ''}{'ASCII ' if ascii_only else ''}string"
        raise FieldError(f"{name} must be {_string_rule(kind, min_chars, max_chars)}", value)
    return value


def hex_text(value: object, name: str, *, max_chars: int, min_chars: int = 1) -> str:
    """Lowercase hex digits (a digest, a session id): one spelling per value."""
    if (
        type(value) is not str
        or not min_chars <= len(value) <= max_chars
        or not _HEX_DIGITS.issuperset(value)
    ):
        raise FieldError(
            f"{name} must be {_string_rule('lowercase hex string', min_chars, max_chars)}", value
        )
    return value


def one_of(value: object, name: str, choices: Collection[S]) -> S:
    """One of a fixed set of names (a recipe, a tier, a setting), typed as the
    set's members are: with ``frozenset[Recipe]`` the result is a `Recipe`."""
    if type(value) is not str or value not in choices:
        raise FieldError(f"{name} must be one of {', '.join(sorted(choices))}", value)
    return cast(S, value)  # it is one of `choices`, whose items are S


def fixed_bytes(value: object, name: str, *, size: int) -> bytes:
    """Exactly `size` bytes (a node id, a signature)."""
    if type(value) is not bytes or len(value) != size:
        raise FieldError(f"{name} must be {size} bytes", value)
    return value


def bounded_bytes(
    value: object, name: str, *, max_bytes: int | None = None, non_empty: bool = False
) -> bytes:
    """Bytes, at most `max_bytes` of them (no cap when None: the frame's own
    cap bounds them), and at least one when `non_empty`."""
    if (
        type(value) is not bytes
        or (non_empty and not value)
        or (max_bytes is not None and len(value) > max_bytes)
    ):
        rule = "non-empty bytes" if non_empty else "bytes"
        if max_bytes is not None:
            rule = f"{rule} of at most {max_bytes}"
        raise FieldError(f"{name} must be {rule}", value)
    return value


# --- structures ---------------------------------------------------------------


def span(value: object, name: str, *, high: int = MAX_UINT) -> tuple[int, int]:
    """A half-open range [a, b) sent as a pair: 0 <= a < b <= high."""
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise FieldError(f"{name} must be a pair [a, b)", value)
    start = uint(value[0], f"{name}[0]", high=high)
    end = uint(value[1], f"{name}[1]", high=high)
    if start >= end:
        raise FieldError(f"{name} must satisfy a < b", value)
    return (start, end)


def array(value: object, name: str, *, size: int) -> list[Any]:
    """A decoded CBOR array of exactly `size` items (a message's fields)."""
    if type(value) is not list or len(value) != size:
        raise FieldError(f"{name} must be an array of {size}", value)
    return value


def sequence(value: object, name: str, *, max_items: int) -> list[Any] | tuple[Any, ...]:
    """A list or tuple of at most `max_items` items (items unchecked)."""
    if not isinstance(value, list | tuple) or len(value) > max_items:
        raise FieldError(f"{name} must be a sequence of <= {max_items}", value)
    return value
