"""The data-plane protocol: the messages an entry and its hops exchange.

A chat request is carried through a chain of hops, each running one shard
of the model; the entry opens a session on every hop, pushes the prompt into
the first, each hop pushes its activations to the next, and the last hop
sends the sampled token back. This module is the vocabulary both sides
share: the ops, the header fields and their readers, the drop reasons and
the limits. The hop side is `runtime.inference.hop_server`, the entry side
`runtime.inference.chain`; `runtime.inference.dispatch` routes between them.

The message table, step and position, and how sessions are bound to peers:
docs/design/inference-protocol.md#the-data-plane-protocol.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from mesh.fields import MAX_UINT, FieldError, hex_text, is_uint, sequence, text, uint
from mesh.identity import NODE_ID_BYTES
from mesh.transport import Plane
from mesh.wire import MAX_ADDR_CHARS, encode_tensor
from runtime.model.grammar import Constraint, ConstraintError
from runtime.model.sampling import SamplingParams, token_logprobs

__all__ = [
    "ENTRY_OPS",
    "HOP_OPS",
    "MAX_CHAIN_HOPS",
    "MAX_LOGPROB_BYTES",
    "MAX_NAME_CHARS",
    "MAX_REASON_CHARS",
    "MAX_TOP_LOGPROBS",
    "OP_BUSY",
    "OP_CLOSE",
    "OP_COMMIT",
    "OP_ERROR",
    "OP_FORWARD",
    "OP_OPEN",
    "OP_OPENED",
    "OP_SEAL",
    "OP_TOKEN",
    "R_BAD_FIELD",
    "R_BAD_HANDOFF",
    "R_BAD_PAYLOAD",
    "R_BAD_POSITION",
    "R_BUDGET",
    "R_DUPLICATE",
    "R_LEAVING",
    "R_NOT_SESSION_PEER",
    "R_OVERLOADED",
    "R_SHARD_FAILED",
    "R_UNKNOWN_SESSION",
    "R_WRONG_SENT",
    "R_WRONG_SHARD",
    "SESSION_ID_BYTES",
    "BadMessage",
    "LogprobRow",
    "check_field",
    "compute_us_field",
    "constraint_field",
    "encode_message",
    "error_header",
    "generated_field",
    "logprob_header",
    "logprob_rows",
    "logprobs_field",
    "max_logprob_rows",
    "new_session_id",
    "node_field",
    "refuse_open",
    "sampling_from_header",
    "sampling_header",
    "session_field",
    "text_field",
    "uint_field",
]

# --- ops ----------------------------------------------------------------------

OP_OPEN: Final = "open"
OP_OPENED: Final = "opened"
OP_BUSY: Final = "busy"
OP_FORWARD: Final = "forward"
OP_TOKEN: Final = "token"
OP_ERROR: Final = "error"
OP_CLOSE: Final = "close"
OP_COMMIT: Final = "commit"
OP_SEAL: Final = "seal"
HOP_OPS: Final = frozenset({OP_OPEN, OP_FORWARD, OP_CLOSE})
ENTRY_OPS: Final = frozenset({OP_OPENED, OP_BUSY, OP_TOKEN, OP_ERROR, OP_COMMIT, OP_SEAL})

# --- limits -------------------------------------------------------------------

SESSION_ID_BYTES: Final = 16  # 128 random bits: collisions are never a concern
_SESSION_ID_CHARS: Final = 2 * SESSION_ID_BYTES
# Model names and error reasons are short text; capping them keeps a hostile
# header from making us hold or echo kilobytes.
MAX_NAME_CHARS: Final = 256
MAX_REASON_CHARS: Final = 300
MAX_CHAIN_HOPS: Final = 256
"""Most per-hop timings a step may carry: a hop holds at least one layer and
no model we know of has more layers; bounds what a header makes us parse."""

MAX_TOP_LOGPROBS: Final = 5
"""Most alternatives a token's logprobs name (OpenAI's legacy completions
take at most 5)."""
MAX_LOGPROB_BYTES: Final = 48 * 1024
"""What a `token` reply's logprobs may take of its header
(`mesh.wire.MAX_TENSOR_HEADER_BYTES`, 64 KiB, less room for the rest)."""

# --- drop reasons (counted as "engine.<reason>" in the node's drops) ----------

R_BAD_FIELD: Final = "bad_field"  # missing or mistyped header field
R_BAD_PAYLOAD: Final = "bad_payload"  # wrong dtype or shape for this hop
R_UNKNOWN_SESSION: Final = "unknown_session"
R_LEAVING: Final = "leaving"  # the hop is stopping: the entry routes around it
# A message about a session from a peer the session is not bound to (see
# "Sessions are bound to peers" above): dropped, the session untouched.
R_NOT_SESSION_PEER: Final = "not_session_peer"
R_BAD_POSITION: Final = "bad_position"  # does not continue the session's cache
R_BUDGET: Final = "budget_exceeded"
R_OVERLOADED: Final = "overloaded"  # too many steps queued for one session
R_SHARD_FAILED: Final = "shard_failed"
R_WRONG_SHARD: Final = "wrong_shard"  # open for a model or layers we do not serve
# A forward whose rows the sender's signed receipt does not cover, or comes
# without one: refused, nothing provable (runtime.inference.blame).
R_BAD_HANDOFF: Final = "bad_handoff"
# The sender signed rows (or a token) its own commitment disagrees with: the
# refusal carries the proof (a ``proof`` field), and the sender is to blame.
R_WRONG_SENT: Final = "wrong_sent"
R_DUPLICATE: Final = "duplicate_session"

_EMPTY: Final = np.zeros(0, dtype=np.uint8)


class BadMessage(Exception):
    """A data-plane header we refuse; ``reason`` is a drop reason."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def new_session_id() -> str:
    """A fresh session id (the entry makes one per hop per attempt)."""
    return secrets.token_hex(SESSION_ID_BYTES)


def encode_message(header: Mapping[str, Any], array: np.ndarray | None = None) -> list[Any]:
    """The two frames of one data-plane message. ``array`` (C-contiguous) is
    passed to ZeroMQ by reference, not copied; the caller must not modify it."""
    payload = _EMPTY if array is None else np.ascontiguousarray(array)
    return encode_tensor(header, payload.data, dtype=payload.dtype.name, shape=payload.shape)


# --- header fields --------------------------------------------------------------
# Readers shared by both sides: each returns the checked value or raises
# BadMessage(bad_field), so a handler validates as it reads.


def session_field(header: Mapping[str, Any], key: str = "session") -> str:
    """A session id: 32 lowercase hex characters."""
    try:
        return hex_text(
            header.get(key), key, min_chars=_SESSION_ID_CHARS, max_chars=_SESSION_ID_CHARS
        )
    except FieldError as exc:
        raise BadMessage(R_BAD_FIELD, exc.detail) from None


def uint_field(header: Mapping[str, Any], key: str, *, high: int = MAX_UINT) -> int:
    """An integer in [0, high]: a step, a position, a token, a budget, a seed."""
    try:
        return uint(header.get(key), key, high=high)
    except FieldError as exc:
        raise BadMessage(R_BAD_FIELD, exc.detail) from None


def compute_us_field(header: Mapping[str, Any]) -> tuple[int, ...]:
    """The per-hop compute times a step carries (none before the first hop)."""
    try:
        times = sequence(header.get("compute_us", []), "compute_us", max_items=MAX_CHAIN_HOPS)
        return tuple([uint(us, "compute_us[]") for us in times])
    except FieldError as exc:
        raise BadMessage(R_BAD_FIELD, exc.detail) from None


def check_field(header: Mapping[str, Any], budget: int) -> tuple[int, tuple[int, ...]] | None:
    """An ``open``'s ``check``: null, or the position of the first claimed
    token's logits and the claimed tokens (at most ``budget`` of them)."""
    value = header.get("check")
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"from", "tokens"}:
        raise BadMessage(R_BAD_FIELD, "check must be null or {from, tokens}")
    start = uint_field(value, "from", high=budget)
    try:
        claimed = sequence(value["tokens"], "check.tokens", max_items=budget)
        tokens = tuple([uint(t, "check.tokens[]") for t in claimed])
    except FieldError as exc:
        raise BadMessage(R_BAD_FIELD, exc.detail) from None
    if not tokens:
        raise BadMessage(R_BAD_FIELD, "check.tokens is empty")
    return start, tokens


def text_field(header: Mapping[str, Any], key: str, limit: int) -> str:
    """Non-empty text of at most ``limit`` characters (a model name, an address)."""
    try:
        return text(header.get(key), key, max_chars=limit)
    except FieldError as exc:
        raise BadMessage(R_BAD_FIELD, exc.detail) from None


# --- composite parts ------------------------------------------------------------


def error_header(session_id: str, step: object, reason: str, detail: str = "") -> dict[str, Any]:
    """An ``error`` message's header; ``step`` is echoed only when it is a
    valid step (the hop may be refusing that very field)."""
    return {
        "op": OP_ERROR,
        "session": session_id,
        "step": step if is_uint(step) else None,
        "reason": (f"{reason}: {detail}" if detail else reason)[:MAX_REASON_CHARS],
    }


def refuse_open(
    plane: Plane, opener: bytes, header: Mapping[str, Any], reason: str, detail: str = ""
) -> None:
    """Answer a refused ``open`` from node ``opener`` with ``error``, so the
    entry fails over at once instead of waiting for its open timeout; silent
    when the header names no valid reply address and session (there is no
    one to answer)."""
    try:
        reply = text_field(header, "reply", MAX_ADDR_CHARS)
        session_id = session_field(header)
    except BadMessage:
        return
    plane.send(reply, encode_message(error_header(session_id, None, reason, detail)), peer=opener)


def node_field(header: Mapping[str, Any], name: str) -> bytes:
    """A node id field (64 lowercase hex characters)."""
    try:
        chars = 2 * NODE_ID_BYTES
        return bytes.fromhex(hex_text(header.get(name), name, min_chars=chars, max_chars=chars))
    except FieldError as exc:
        raise BadMessage(R_BAD_FIELD, exc.detail) from None


_SAMPLING_KEYS: Final = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")


def sampling_header(params: SamplingParams) -> dict[str, Any]:
    """What the last hop needs of the sampling parameters (max_tokens and stop
    sequences stay with the entry; the constraint has its own field)."""
    return {name: getattr(params, name) for name in _SAMPLING_KEYS}


def sampling_from_header(value: object, constraint: Constraint | None = None) -> SamplingParams:
    """Rebuild and validate the parameters an ``open`` carries (the
    penalties may be absent: an entry from before them); raises
    :class:`BadMessage`."""
    keys = set(_SAMPLING_KEYS)
    if (
        not isinstance(value, dict)
        or not keys - {"presence_penalty", "frequency_penalty"} <= set(value) <= keys
    ):
        raise BadMessage(R_BAD_FIELD, "sampling must be {temperature, top_p, top_k, penalties}")
    try:
        return SamplingParams(**value, constraint=constraint)
    except ValueError as exc:  # SamplingParams checks types and ranges
        raise BadMessage(R_BAD_FIELD, f"sampling.{exc}") from None


def constraint_field(header: Mapping[str, Any]) -> Constraint | None:
    """An ``open``'s ``constraint``: null, or ``{kind, schema}`` with a
    schema of at most ``runtime.model.grammar.MAX_SCHEMA_CHARS`` (what
    the output must be; the last hop masks its logits by it)."""
    value = header.get("constraint")
    if value is None:
        return None
    try:
        return Constraint.from_header(value)
    except ConstraintError as exc:
        raise BadMessage(R_BAD_FIELD, str(exc)) from None


def generated_field(header: Mapping[str, Any], budget: int) -> tuple[int, ...]:
    """An ``open``'s ``generated``: the tokens the generation produced
    before this session (a replay after failover), at most ``budget``; the
    last hop's penalties and constraint continue from them."""
    value = header.get("generated")
    if value is None:
        return ()
    try:
        tokens = sequence(value, "generated", max_items=budget)
        return tuple([uint(t, "generated[]") for t in tokens])
    except FieldError as exc:
        raise BadMessage(R_BAD_FIELD, exc.detail) from None


# --- logprobs -------------------------------------------------------------------
# An entry that wants logprobs asks the last hop in its ``open``:
# ``logprobs: {top, echo}``, ``top`` alternatives per token, and ``echo``
# the prompt's tokens after its first, scored from the logits of the step
# at position 0 (empty: only generated tokens). Each ``token`` reply then
# carries ``lp`` (float32 [rows, 1 + top]: each row's token's log-softmax,
# then its alternatives') and ``lp_ids`` (int32 [rows, top]): the echo
# rows first, then the sampled token's. Raw little-endian bytes, not CBOR
# lists: a prompt's rows fit one header.


@dataclass(frozen=True, slots=True)
class LogprobRow:
    """One token's log-probability and its ``top`` alternatives, best first."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


LOGPROB_SLACK: Final = 1e-3
"""A log-softmax is at most 0; float rounding may put one a hair above."""


def max_logprob_rows(top: int) -> int:
    """How many rows of ``top`` alternatives one reply carries."""
    return MAX_LOGPROB_BYTES // (4 * (2 * top + 1))


def logprobs_field(header: Mapping[str, Any], budget: int) -> tuple[int, tuple[int, ...]] | None:
    """An ``open``'s ``logprobs``: null, or ``top`` and the echoed tokens."""
    value = header.get("logprobs")
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"top", "echo"}:
        raise BadMessage(R_BAD_FIELD, "logprobs must be null or {top, echo}")
    top = uint_field(value, "top", high=MAX_TOP_LOGPROBS)
    try:
        listed = sequence(value["echo"], "logprobs.echo", max_items=budget)
        echo = tuple([uint(t, "logprobs.echo[]") for t in listed])
    except FieldError as exc:
        raise BadMessage(R_BAD_FIELD, exc.detail) from None
    if len(echo) > max_logprob_rows(top):
        raise BadMessage(R_BAD_FIELD, "logprobs.echo does not fit one reply")
    return top, echo


def logprob_header(
    asked: tuple[int, tuple[int, ...]], pos: int, logits: np.ndarray, token: int
) -> dict[str, Any]:
    """The last hop's ``lp`` and ``lp_ids`` for a step from ``pos`` whose
    ``logits`` sampled ``token`` (``asked`` as `logprobs_field` read it)."""
    top, echo = asked
    rows = min(len(echo), logits.shape[0] - 1) if pos == 0 else 0
    scored = np.concatenate([logits[:rows], logits[-1:]])
    values, ids = token_logprobs(scored, [*echo[:rows], token], top)
    return {"lp": values.astype("<f4").tobytes(), "lp_ids": ids.astype("<i4").tobytes()}


def logprob_rows(header: Mapping[str, Any], top: int) -> tuple[LogprobRow, ...]:
    """A ``token`` reply's logprobs (none when it carries none); BadMessage
    when they are malformed."""
    raw, raw_ids = header.get("lp"), header.get("lp_ids")
    if raw is None and raw_ids is None:
        return ()
    if type(raw) is not bytes or type(raw_ids) is not bytes:
        raise BadMessage(R_BAD_FIELD, "lp and lp_ids must be bytes")
    width = 4 * (1 + top)
    rows = len(raw) // width
    if rows < 1 or len(raw) != rows * width or len(raw_ids) != rows * 4 * top:
        raise BadMessage(R_BAD_FIELD, "lp and lp_ids do not fit the logprobs asked")
    values = np.frombuffer(raw, dtype="<f4").reshape(rows, 1 + top).astype(float)
    ids = np.frombuffer(raw_ids, dtype="<i4").reshape(rows, top)
    if np.isnan(values).any() or (values > LOGPROB_SLACK).any() or (ids < 0).any():
        raise BadMessage(R_BAD_FIELD, "logprobs must be at most 0, token ids at least 0")
    return tuple(_row(v, i) for v, i in zip(values.tolist(), ids.tolist(), strict=True))


def _row(values: Sequence[float], ids: Sequence[int]) -> LogprobRow:
    return LogprobRow(values[0], tuple(ids), tuple(values[1:]))
