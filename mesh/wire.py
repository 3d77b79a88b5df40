"""The wire format: bytes <-> membership envelopes, and tensor frames.

Everything a peer sends is hostile until proven otherwise, so decoding is
strict and cheap to refuse: the size cap first, then a scanner over the CBOR
item heads (no tags, floats, indefinite lengths or trailing bytes; depth and
item counts capped), only then cbor2, then a schema check of every field.
Every refusal is a `DecodeError` with a fixed `reason`, so drops are counted
per reason and input never crashes the node. Envelopes are CBOR maps with
small integer keys; message type ids and update kinds are append-only.
Tensors travel as a strict CBOR header frame and a raw little-endian frame.
This module only converts: no sockets, no signature checks.

Why the scanner, the envelope layout, and the numbering tables:
docs/design/wire.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, NoReturn

import cbor2

from mesh import fields
from mesh.fields import (
    FieldError,
    array,
    boolean,
    bounded_bytes,
    fixed_bytes,
    sequence,
    text,
    uint,
)
from mesh.identity import NODE_ID_BYTES, SIGNATURE_BYTES
from mesh.messages import (
    Ack,
    Alive,
    Consensus,
    Dead,
    DialBack,
    DialRequest,
    Envelope,
    Gossip,
    Message,
    Nack,
    Ping,
    PingReq,
    PushPull,
    Record,
    Suspect,
    SyncDelta,
    SyncDigest,
    Update,
)
from mesh.sync import BUCKETS, MAX_BUCKET_BITS, MAX_RECENT, bits_for, well_formed_delta

PROTOCOL_VERSION: Final = 1

# --- limits -----------------------------------------------------------------

# The largest control-plane frame we parse. The biggest legitimate message is
# a push-pull: for a 1,000-node swarm each state is ~140 bytes (node id,
# signature, counter and address) and each record ~1-2 KiB (addresses,
# backend, assignment, capability report, models) plus ~100 bytes of id,
# signature and framing; with 2 KiB records that measures 2.28 MB. 4 MiB
# leaves room for fatter records while bounding what one peer can make us
# allocate; the transport should set ZMQ_MAXMSGSIZE to the same value.
MAX_CONTROL_MESSAGE_BYTES: Final = 4 * 1024 * 1024

# Container nesting we accept. Our deepest envelope has 4 levels (envelope
# map > body array > update list > update array); 8 leaves room for one more
# nested structure in a future body or header, and keeps a depth bomb (e.g.
# 100,000 nested arrays) a refusal after 9 bytes rather than a deep recursion.
MAX_DEPTH: Final = 8

# Updates piggybacked on one Ping/PingReq/Ack/Gossip. Each costs an Ed25519
# verification (~50-100 us), so 256 bounds one message to ~25 ms of crypto,
# far above SWIM's usual piggyback of a few dozen updates per message.
MAX_UPDATES_PER_MESSAGE: Final = 256

# Entries in each of a push-pull's two lists (states, records). A 10,000-node
# simulation must fit with headroom; the byte cap above still applies, so in
# practice records at realistic sizes fit for a couple of thousand nodes.
MAX_PUSHPULL_ENTRIES: Final = 16_384

# States (an Alive and an accusation each) or records a delta-sync digest
# carries for the members its sender changed last (mesh.sync.MAX_RECENT).
MAX_RECENT_UPDATES: Final = 2 * MAX_RECENT

# Characters in an address such as "tcp://host:port": a DNS name is at most
# 253 characters, plus "tcp://" and ":65535" is 265; an ipc path is at most
# 107. Addresses are printable ASCII, so one can be logged without escaping.
MAX_ADDR_CHARS: Final = 300

# A node record's CBOR body (see mesh.records). Records are gossiped and held
# for every member, so this caps both gossip amplification and memory per
# member (16 KiB x 1,000 members = 16 MiB at worst).
MAX_RECORD_BODY_BYTES: Final = 16 * 1024

# Largest integer field: counters are stored as sqlite INTEGER (signed 64-bit)
# and signed as 8 big-endian bytes, so [0, 2**63) fits both (mesh.fields' rule).
MAX_UINT: Final = fields.MAX_UINT

# Entries in any one CBOR map. Our maps have at most 5; tensor headers a
# handful. Small maps also stop a map of many integer keys with colliding
# hashes from making dict construction quadratic.
MAX_MAP_ENTRIES: Final = 64

# Items (every scalar and container counts one) in one frame. A maximal
# push-pull is 2 x 16,384 updates x 6 items + ~20 = 196,628; without a cap a
# 4 MiB frame of 1-byte integers would be 4 million items for the scanner and
# cbor2 to walk. At the cap the pure-Python scanner spends ~30 ms, the most
# one hostile frame can cost; a real 1,000-node push-pull costs ~2 ms.
MAX_CBOR_ITEMS: Final = 2**18

# A tensor's CBOR header frame. It carries dtype, shape and a few request
# fields (ids, positions, layer range); 64 KiB is generous and keeps header
# parsing trivial next to the tensor itself.
MAX_TENSOR_HEADER_BYTES: Final = 64 * 1024

# Tensor rank. Activations are rank 2-4 (batch, sequence, hidden, heads);
# 8 leaves slack without letting a header declare thousands of dims.
MAX_TENSOR_RANK: Final = 8

# Allowed tensor dtypes and their sizes in bytes. bfloat16 is just 2 bytes per
# element here; interpreting it is the backend's job.
TENSOR_DTYPES: Final[Mapping[str, int]] = MappingProxyType(
    {
        "float64": 8,
        "float32": 4,
        "float16": 2,
        "bfloat16": 2,
        "int64": 8,
        "int32": 4,
        "int16": 2,
        "int8": 1,
        "uint8": 1,
        "bool": 1,
    }
)

# --- drop reasons -----------------------------------------------------------

REASON_OVERSIZED: Final = "oversized"  # frame or item count over its cap
REASON_MALFORMED_CBOR: Final = "malformed_cbor"  # not well-formed CBOR, bad UTF-8...
REASON_TOO_DEEP: Final = "too_deep"  # nesting past MAX_DEPTH
REASON_FORBIDDEN_TAG: Final = "forbidden_tag"  # any CBOR tag: we allow none
# Well-formed CBOR outside our dialect: floats (outside tensor headers),
# undefined and other simple values, indefinite-length strings and containers.
REASON_FORBIDDEN_ITEM: Final = "forbidden_item"
REASON_BAD_VERSION: Final = "bad_version"
REASON_UNKNOWN_TYPE: Final = "unknown_type"
REASON_BAD_FIELD: Final = "bad_field"  # missing, mistyped, out of range, too many
REASON_TRAILING_BYTES: Final = "trailing_bytes"
REASON_BAD_TENSOR: Final = "bad_tensor"  # dtype, shape or frame layout wrong

DROP_REASONS: Final = frozenset(
    {
        REASON_OVERSIZED,
        REASON_MALFORMED_CBOR,
        REASON_TOO_DEEP,
        REASON_FORBIDDEN_TAG,
        REASON_FORBIDDEN_ITEM,
        REASON_BAD_VERSION,
        REASON_UNKNOWN_TYPE,
        REASON_BAD_FIELD,
        REASON_TRAILING_BYTES,
        REASON_BAD_TENSOR,
    }
)


# The detail of a DecodeError raised by the safety net rather than by an
# explicit check: the fuzz tests assert it never appears, so every refusal
# has a deliberate reason.
UNEXPECTED: Final = "unexpected"


class DecodeError(Exception):
    """Received bytes we refuse. `reason` is one of `DROP_REASONS`.

    The node drops the message and counts it under `reason`; `detail` is a
    short, fixed description for debugging logs (never the peer's bytes).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class EncodeError(ValueError):
    """We were asked to send something peers would refuse (a bug in the caller).

    Encoding applies the same rules as decoding, so a node never puts on the
    wire a message that every honest peer drops. `reason` is a drop reason.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class _Invalid(Exception):
    """Internal: a rule was broken; the public boundary picks the error class."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


def _fail(reason: str, detail: str) -> NoReturn:
    raise _Invalid(reason, detail)


# --- strict CBOR ------------------------------------------------------------

# The scanner classifies each possible head byte once, here, so its loop does
# one table lookup per item instead of decoding major type and argument.
_SCALAR, _STRING, _CONTAINER, _FLOAT, _REFUSED = range(5)
_MAJOR_TAG, _MAJOR_SIMPLE = 6, 7
_INFO_FALSE, _INFO_TRUE, _INFO_NULL = 20, 21, 22
_INFO_FLOATS = (25, 26, 27)  # half, single, double precision
_INFO_INDEFINITE = 31


def _classify_head(head: int) -> tuple[int, int, str, str]:
    """(action, argument bytes that follow, refusal reason, detail) for a head byte."""
    major, info = head >> 5, head & 0x1F
    arg_bytes = 1 << (info - 24) if 24 <= info <= 27 else 0
    if major == _MAJOR_TAG:
        return _REFUSED, 0, REASON_FORBIDDEN_TAG, "CBOR tags are not allowed"
    if major == _MAJOR_SIMPLE:
        if info in (_INFO_FALSE, _INFO_TRUE, _INFO_NULL):
            return _SCALAR, 0, "", ""
        if info in _INFO_FLOATS:
            return _FLOAT, arg_bytes, REASON_FORBIDDEN_ITEM, "floats are not allowed here"
        if info == _INFO_INDEFINITE:
            return _REFUSED, 0, REASON_MALFORMED_CBOR, "break outside an indefinite item"
        if info >= 28:
            return _REFUSED, 0, REASON_MALFORMED_CBOR, "reserved additional information"
        return _REFUSED, 0, REASON_FORBIDDEN_ITEM, "simple values other than false/true/null"
    if info == _INFO_INDEFINITE and major >= 2:
        return _REFUSED, 0, REASON_FORBIDDEN_ITEM, "indefinite-length items are not allowed"
    if info >= 28:
        return _REFUSED, 0, REASON_MALFORMED_CBOR, "reserved additional information"
    action = (_SCALAR, _SCALAR, _STRING, _STRING, _CONTAINER, _CONTAINER)[major]
    return action, arg_bytes, "", ""


_HEADS: Final = tuple(_classify_head(head) for head in range(256))
_HEAD_ACTION: Final = bytes(entry[0] for entry in _HEADS)
_HEAD_ARG_BYTES: Final = bytes(entry[1] for entry in _HEADS)
_MAP_HEADS: Final = range(0xA0, 0xC0)


def _scan(data: bytes, *, allow_floats: bool, max_items: int = MAX_CBOR_ITEMS) -> None:
    """Check that `data` is exactly one CBOR item in our strict dialect.

    Walks item heads iteratively (strings are skipped, not read), so its
    cost is bounded by `MAX_CBOR_ITEMS` (about 0.1 us per item) and its stack
    by `MAX_DEPTH`, whatever the input. Raises `_Invalid`.

    `pending` counts the items still owed by every open container; a
    container opened when `pending` was P is complete when it falls back to
    P, so a stack of those marks gives the depth without per-item bookkeeping.
    """
    n = len(data)
    pos = 0
    pending = 1  # the top-level item
    declared = 1
    closes_at = -1  # mark of the innermost open container; -1: none
    outer_marks: list[int] = []
    action_of, arg_bytes_of = _HEAD_ACTION, _HEAD_ARG_BYTES
    while pending:
        if pos >= n:
            _fail(REASON_MALFORMED_CBOR, "truncated")
        head = data[pos]
        pos += 1
        pending -= 1
        action = action_of[head]
        if action == _SCALAR:
            pos += arg_bytes_of[head]  # overruns are caught at the next item or the end
        elif action == _STRING:
            size = arg_bytes_of[head]
            if size:
                pos += size + int.from_bytes(data[pos : pos + size], "big")
            else:
                pos += head & 0x1F
        elif action == _CONTAINER:
            size = arg_bytes_of[head]
            if size:
                if pos + size > n:
                    _fail(REASON_MALFORMED_CBOR, "truncated")
                children = int.from_bytes(data[pos : pos + size], "big")
                pos += size
            else:
                children = head & 0x1F
            if head in _MAP_HEADS:
                if children > MAX_MAP_ENTRIES:
                    _fail(REASON_BAD_FIELD, "too many map entries")
                children *= 2
            if pending + children > n - pos:  # every owed item takes at least a byte
                _fail(REASON_MALFORMED_CBOR, "truncated")
            if len(outer_marks) >= MAX_DEPTH:
                _fail(REASON_TOO_DEEP, "nesting too deep")
            declared += children
            if declared > max_items:
                _fail(REASON_OVERSIZED, "too many CBOR items")
            if children:
                outer_marks.append(closes_at)
                closes_at = pending
                pending += children
                continue
        elif action == _FLOAT and allow_floats:
            pos += arg_bytes_of[head]
        else:
            _, _, reason, detail = _HEADS[head]
            _fail(reason, detail)
        while pending == closes_at:  # this item completed one or more containers
            closes_at = outer_marks.pop()
    if pos > n:
        _fail(REASON_MALFORMED_CBOR, "truncated")
    if pos < n:
        _fail(REASON_TRAILING_BYTES, "bytes after the CBOR item")


def _refuse_tag(*_args: object) -> NoReturn:
    # Never reached: _scan refuses every tag first. Kept so that cbor2 alone
    # would refuse too, should the scanner ever be bypassed.
    raise _Invalid(REASON_FORBIDDEN_TAG, "CBOR tags are not allowed")


def _loads(
    data: object, *, max_bytes: int, allow_floats: bool, max_items: int = MAX_CBOR_ITEMS
) -> Any:
    """Strictly decode one CBOR item; raises `_Invalid` for any input."""
    if not isinstance(data, bytes):
        try:
            view = memoryview(data)  # type: ignore[arg-type]  # any buffer will do
        except TypeError:
            _fail(REASON_MALFORMED_CBOR, "not a bytes-like object")
        if view.nbytes > max_bytes:  # before copying it
            _fail(REASON_OVERSIZED, "frame over the size cap")
        data = view.tobytes()
    if len(data) > max_bytes:
        _fail(REASON_OVERSIZED, "frame over the size cap")
    _scan(data, allow_floats=allow_floats, max_items=max_items)
    try:
        return cbor2.loads(
            data,
            tag_hook=_refuse_tag,
            max_depth=MAX_DEPTH,
            allow_indefinite=False,
            allow_duplicate_keys=False,
            str_errors="strict",
        )
    except _Invalid:
        raise
    except Exception as exc:  # cbor2 wraps hook errors; anything else is bad input
        if isinstance(exc.__cause__, _Invalid):
            raise exc.__cause__ from None
        _fail(REASON_MALFORMED_CBOR, type(exc).__name__)


def decode_strict_cbor(
    data: bytes, *, max_bytes: int, allow_floats: bool = False, max_items: int = MAX_CBOR_ITEMS
) -> Any:
    """Decode one CBOR item under the control plane's strict rules.

    For other modules that carry CBOR inside a message (a node record's
    body) or store it (the placement ledger's snapshot), so that every CBOR
    we accept obeys one dialect. `max_items` raises the item cap for a large
    document whose byte size is already capped; the scan stays linear in it.
    Raises only `DecodeError`.
    """
    try:
        return _loads(data, max_bytes=max_bytes, allow_floats=allow_floats, max_items=max_items)
    except _Invalid as exc:
        raise DecodeError(exc.reason, exc.detail) from None


def encode_strict_cbor(value: Any, *, max_bytes: int, allow_floats: bool = False) -> bytes:
    """Encode `value`, refusing anything `decode_strict_cbor` would refuse.

    A datetime, set or big integer would become a tag, a tuple nested too deep
    would break the depth cap: better an `EncodeError` here than a peer
    silently dropping what we signed.
    """
    try:
        data = cbor2.dumps(value)
    except Exception as exc:
        raise EncodeError(REASON_BAD_FIELD, f"not encodable: {type(exc).__name__}") from None
    if len(data) > max_bytes:
        raise EncodeError(REASON_OVERSIZED, "value over the size cap")
    try:
        _scan(data, allow_floats=allow_floats)
    except _Invalid as exc:
        raise EncodeError(exc.reason, exc.detail) from None
    return data


# --- field checks (shared by encode and decode) -----------------------------
# The rules are mesh.fields'; a FieldError becomes REASON_BAD_FIELD at the
# public boundary (encode_envelope, decode_envelope). These name our fields' bounds.


def _node_id(value: object, what: str) -> bytes:
    return fixed_bytes(value, what, size=NODE_ID_BYTES)


def _signature(value: object) -> bytes:
    return fixed_bytes(value, "signature", size=SIGNATURE_BYTES)


def _addr(value: object, what: str) -> str:
    # May be empty (a node that has no address to give yet); printable ASCII,
    # so it can be logged unescaped.
    return text(value, what, max_chars=MAX_ADDR_CHARS, min_chars=0, printable=True, ascii_only=True)


def _record_body(value: object) -> bytes:
    return bounded_bytes(value, "record body", max_bytes=MAX_RECORD_BODY_BYTES)


# --- updates ----------------------------------------------------------------

UPDATE_KIND_IDS: Final[Mapping[type, int]] = MappingProxyType(
    {Alive: 1, Suspect: 2, Dead: 3, Record: 4}
)
_ALIVE, _SUSPECT, _DEAD, _RECORD = 1, 2, 3, 4


def _update_value(update: object) -> list[Any]:
    """An update as its wire array, checking every field on the way out."""
    match update:
        case Alive(node, incarnation, addr, signature):
            return [
                _ALIVE,
                _node_id(node, "alive node"),
                uint(incarnation, "incarnation"),
                _addr(addr, "alive addr"),
                _signature(signature),
            ]
        case Suspect(node, incarnation, accuser, signature) | Dead(
            node, incarnation, accuser, signature
        ):
            return [
                _SUSPECT if isinstance(update, Suspect) else _DEAD,
                _node_id(node, "accused node"),
                uint(incarnation, "incarnation"),
                _node_id(accuser, "accuser"),
                _signature(signature),
            ]
        case Record(node, seq, body, signature):
            return [
                _RECORD,
                _node_id(node, "record node"),
                uint(seq, "record seq"),
                _record_body(body),
                _signature(signature),
            ]
    _fail(REASON_BAD_FIELD, "not an update")


def _update(value: object) -> Update:
    """Check a wire array and build the update it describes."""
    if not isinstance(value, list) or not value or type(value[0]) is not int:
        _fail(REASON_BAD_FIELD, "update must be an array starting with its kind")
    kind = value[0]
    if kind == _ALIVE:
        _, node, incarnation, addr, signature = array(value, "alive", size=5)
        return Alive(
            _node_id(node, "alive node"),
            uint(incarnation, "incarnation"),
            _addr(addr, "alive addr"),
            _signature(signature),
        )
    if kind in (_SUSPECT, _DEAD):
        _, node, incarnation, accuser, signature = array(value, "accusation", size=5)
        cls = Suspect if kind == _SUSPECT else Dead
        return cls(
            _node_id(node, "accused node"),
            uint(incarnation, "incarnation"),
            _node_id(accuser, "accuser"),
            _signature(signature),
        )
    if kind == _RECORD:
        _, node, seq, body, signature = array(value, "record", size=5)
        return Record(
            _node_id(node, "record node"),
            uint(seq, "record seq"),
            _record_body(body),
            _signature(signature),
        )
    _fail(REASON_BAD_FIELD, "unknown update kind")


def _updates_value(updates: object, limit: int, what: str) -> list[list[Any]]:
    return [_update_value(u) for u in sequence(updates, what, max_items=limit)]


def _updates(value: object, limit: int, what: str) -> tuple[Update, ...]:
    if not isinstance(value, list):  # decoded CBOR arrays are lists, never tuples
        _fail(REASON_BAD_FIELD, f"{what} must be an array")
    return tuple(_update(u) for u in sequence(value, what, max_items=limit))


def _states_value(states: object) -> list[list[Any]]:
    items = sequence(states, "states", max_items=MAX_PUSHPULL_ENTRIES)
    if not all(type(s) in (Alive, Suspect, Dead) for s in items):
        _fail(REASON_BAD_FIELD, "states must be alive/suspect/dead updates")
    return [_update_value(s) for s in items]


def _states(value: object) -> tuple[Alive | Suspect | Dead, ...]:
    updates = _updates(value, MAX_PUSHPULL_ENTRIES, "states")
    if any(type(u) is Record for u in updates):
        _fail(REASON_BAD_FIELD, "states must be alive/suspect/dead updates")
    return updates  # type: ignore[return-value]


def _records_value(records: object) -> list[list[Any]]:
    items = sequence(records, "records", max_items=MAX_PUSHPULL_ENTRIES)
    if not all(type(r) is Record for r in items):
        _fail(REASON_BAD_FIELD, "records must be record updates")
    return [_update_value(r) for r in items]


def _records(value: object) -> tuple[Record, ...]:
    updates = _updates(value, MAX_PUSHPULL_ENTRIES, "records")
    if any(type(u) is not Record for u in updates):
        _fail(REASON_BAD_FIELD, "records must be record updates")
    return updates  # type: ignore[return-value]


# --- messages ---------------------------------------------------------------

MESSAGE_TYPE_IDS: Final[Mapping[type, int]] = MappingProxyType(
    {
        Ping: 1,
        PingReq: 2,
        Ack: 3,
        Nack: 4,
        Gossip: 5,
        PushPull: 6,
        Consensus: 7,
        SyncDigest: 8,
        SyncDelta: 9,
        DialRequest: 10,
        DialBack: 11,
    }
)

_U = MAX_UPDATES_PER_MESSAGE


def _body_value(message: Any) -> list[Any]:
    """A message's fields as its wire array (the caller checked its type)."""
    match message:
        case Ping():
            return [
                uint(message.seq, "seq"),
                _node_id(message.target, "target"),
                _updates_value(message.updates, _U, "updates"),
            ]
        case PingReq():
            return [
                uint(message.seq, "seq"),
                _node_id(message.target, "target"),
                _addr(message.target_addr, "target addr"),
                _updates_value(message.updates, _U, "updates"),
            ]
        case Ack():
            return [uint(message.seq, "seq"), _updates_value(message.updates, _U, "updates")]
        case Nack():
            return [uint(message.seq, "seq")]
        case Gossip():
            return [_updates_value(message.updates, _U, "updates")]
        case PushPull():
            return [
                boolean(message.join, "join"),
                boolean(message.reply, "reply"),
                _states_value(message.states),
                _records_value(message.records),
            ]
        case Consensus():
            return [_consensus_payload(message.payload), _signature(message.signature)]
        case SyncDigest():
            return [
                _fingerprints(message.fingerprints),
                _recent_value(message.states, _states_value),
                _recent_value(message.records, _records_value),
            ]
        case SyncDelta():
            return _delta_value(message)
        case DialRequest() | DialBack():
            return [_nonce(message.nonce)]
    _fail(REASON_UNKNOWN_TYPE, "not a message")


def _ping(body: object) -> Ping:
    seq, target, updates = array(body, "ping", size=3)
    return Ping(uint(seq, "seq"), _node_id(target, "target"), _updates(updates, _U, "updates"))


def _ping_req(body: object) -> PingReq:
    seq, target, target_addr, updates = array(body, "ping-req", size=4)
    return PingReq(
        uint(seq, "seq"),
        _node_id(target, "target"),
        _addr(target_addr, "target addr"),
        _updates(updates, _U, "updates"),
    )


def _ack(body: object) -> Ack:
    seq, updates = array(body, "ack", size=2)
    return Ack(uint(seq, "seq"), _updates(updates, _U, "updates"))


def _nack(body: object) -> Nack:
    (seq,) = array(body, "nack", size=1)
    return Nack(uint(seq, "seq"))


def _gossip(body: object) -> Gossip:
    (updates,) = array(body, "gossip", size=1)
    return Gossip(_updates(updates, _U, "updates"))


def _push_pull(body: object) -> PushPull:
    join, reply, states, records = array(body, "push-pull", size=4)
    return PushPull(
        boolean(join, "join"), boolean(reply, "reply"), _states(states), _records(records)
    )


def _consensus_payload(value: object) -> bytes:
    # The envelope's own cap bounds it; an empty payload is never a message.
    return bounded_bytes(value, "consensus payload", non_empty=True)


def _consensus(body: object) -> Consensus:
    payload, signature = array(body, "consensus", size=2)
    return Consensus(_consensus_payload(payload), _signature(signature))


# A dial-back's nonce (mesh.reachability): 16 random bytes, so one cannot be
# guessed, and a fixed size, so there is nothing to bound.
DIAL_NONCE_BYTES: Final = 16


def _nonce(value: object) -> bytes:
    return fixed_bytes(value, "dial nonce", size=DIAL_NONCE_BYTES)


def _dial_request(body: object) -> DialRequest:
    (nonce,) = array(body, "dial request", size=1)
    return DialRequest(_nonce(nonce))


def _dial_back(body: object) -> DialBack:
    (nonce,) = array(body, "dial back", size=1)
    return DialBack(_nonce(nonce))


# --- delta sync (mesh.sync) -------------------------------------------------


def _fingerprints(value: object) -> list[int]:
    items = sequence(value, "fingerprints", max_items=BUCKETS)
    if bits_for(len(items)) is None:
        _fail(REASON_BAD_FIELD, f"a digest has a power of two of at most {BUCKETS} fingerprints")
    return [uint(item, "fingerprint") for item in items]


def _bits(value: object) -> int:
    return uint(value, "bits", high=MAX_BUCKET_BITS)


def _buckets(value: object) -> tuple[int, ...]:
    return tuple(uint(b, "bucket") for b in sequence(value, "buckets", max_items=BUCKETS))


def _check_delta(delta: SyncDelta) -> SyncDelta:
    """How a delta's checked fields fit together: the rule the core applies
    too (`mesh.sync.well_formed_delta`)."""
    fits = well_formed_delta(delta.reply, delta.bits, delta.buckets, delta.states, delta.records)
    if not fits:
        _fail(
            REASON_BAD_FIELD, "a delta names ascending buckets within bits, and only their members"
        )
    return delta


def _delta_value(message: SyncDelta) -> list[Any]:
    value = [
        boolean(message.reply, "reply"),
        _bits(message.bits),
        list(_buckets(message.buckets)),
        _states_value(message.states),
        _records_value(message.records),
    ]
    _check_delta(message)
    return value


def _recent_value(
    updates: Sequence[Update], encode: Callable[[object], list[list[Any]]]
) -> list[list[Any]]:
    """A digest's recent states or records: as a full state's, fewer."""
    if len(updates) > MAX_RECENT_UPDATES:
        _fail(REASON_BAD_FIELD, "a digest carries the state of a few members")
    return encode(updates)


def _sync_digest(body: object) -> SyncDigest:
    fingerprints, states, records = array(body, "sync digest", size=3)
    for recent in (states, records):
        if type(recent) is list and len(recent) > MAX_RECENT_UPDATES:
            _fail(REASON_BAD_FIELD, "a digest carries the state of a few members")
    return SyncDigest(tuple(_fingerprints(fingerprints)), _states(states), _records(records))


def _sync_delta(body: object) -> SyncDelta:
    reply, bits, buckets, states, records = array(body, "sync delta", size=5)
    return _check_delta(
        SyncDelta(
            boolean(reply, "reply"),
            _bits(bits),
            _buckets(buckets),
            _states(states),
            _records(records),
        )
    )


_BODY_DECODERS: Final[Mapping[int, Callable[[object], Message]]] = MappingProxyType(
    {
        MESSAGE_TYPE_IDS[Ping]: _ping,
        MESSAGE_TYPE_IDS[PingReq]: _ping_req,
        MESSAGE_TYPE_IDS[Ack]: _ack,
        MESSAGE_TYPE_IDS[Nack]: _nack,
        MESSAGE_TYPE_IDS[Gossip]: _gossip,
        MESSAGE_TYPE_IDS[PushPull]: _push_pull,
        MESSAGE_TYPE_IDS[Consensus]: _consensus,
        MESSAGE_TYPE_IDS[SyncDigest]: _sync_digest,
        MESSAGE_TYPE_IDS[SyncDelta]: _sync_delta,
        MESSAGE_TYPE_IDS[DialRequest]: _dial_request,
        MESSAGE_TYPE_IDS[DialBack]: _dial_back,
    }
)

# --- envelopes --------------------------------------------------------------

_K_VERSION, _K_TYPE, _K_SENDER, _K_ADDR, _K_BODY = 0, 1, 2, 3, 4
_ENVELOPE_KEYS: Final = frozenset({_K_VERSION, _K_TYPE, _K_SENDER, _K_ADDR, _K_BODY})


def encode_envelope(envelope: Envelope) -> bytes:
    """The wire bytes of `envelope`.

    Checks every field by the rules `decode_envelope` applies, and raises
    `EncodeError` rather than emit bytes that peers would drop.
    """
    try:
        if type(envelope) is not Envelope:
            _fail(REASON_BAD_FIELD, "not an envelope")
        type_id = MESSAGE_TYPE_IDS.get(type(envelope.message))
        if type_id is None:
            _fail(REASON_UNKNOWN_TYPE, "not a message")
        value = {
            _K_VERSION: PROTOCOL_VERSION,
            _K_TYPE: type_id,
            _K_SENDER: _node_id(envelope.sender, "sender"),
            _K_ADDR: _addr(envelope.addr, "addr"),
            _K_BODY: _body_value(envelope.message),
        }
    except _Invalid as exc:
        raise EncodeError(exc.reason, exc.detail) from None
    except FieldError as exc:
        raise EncodeError(REASON_BAD_FIELD, exc.detail) from None
    data = cbor2.dumps(value)
    if len(data) > MAX_CONTROL_MESSAGE_BYTES:
        raise EncodeError(REASON_OVERSIZED, "message over the size cap; split it")
    return data


def decode_envelope(data: bytes) -> Envelope:
    """The envelope in `data`; raises `DecodeError` (and nothing else) for any input."""
    try:
        return _decode_envelope(data)
    except _Invalid as exc:
        raise DecodeError(exc.reason, exc.detail) from None
    except FieldError as exc:
        raise DecodeError(REASON_BAD_FIELD, exc.detail) from None
    except Exception as exc:  # a gap in the checks must still only drop the message
        raise DecodeError(REASON_BAD_FIELD, f"{UNEXPECTED} {type(exc).__name__}") from None


def _check_versioned_map(value: Any, version_key: int, keys: frozenset[int], what: str) -> None:
    """`value` is a map with exactly `keys` (ints) whose version is ours.

    The version is checked before the key set, so a peer speaking a future
    version is told "bad_version", not "bad_field"."""
    # Keys must really be ints: False == 0 and hashes alike, so check types first.
    if type(value) is not dict or any(type(key) is not int for key in value):
        _fail(REASON_BAD_FIELD, f"{what} must be a map with integer keys")
    version = value.get(version_key)
    if type(version) is not int:
        _fail(REASON_BAD_FIELD, f"{what} has no version")
    if version != PROTOCOL_VERSION:
        _fail(REASON_BAD_VERSION, "unsupported protocol version")
    if value.keys() != keys:
        _fail(REASON_BAD_FIELD, f"{what} keys are wrong")


def _decode_envelope(data: bytes) -> Envelope:
    raw = _loads(data, max_bytes=MAX_CONTROL_MESSAGE_BYTES, allow_floats=False)
    _check_versioned_map(raw, _K_VERSION, _ENVELOPE_KEYS, "envelope")
    type_id = raw[_K_TYPE]
    decode_body = _BODY_DECODERS.get(type_id) if type(type_id) is int else None
    if decode_body is None:
        if type(type_id) is not int:
            _fail(REASON_BAD_FIELD, "message type must be an integer")
        _fail(REASON_UNKNOWN_TYPE, "unknown message type")
    return Envelope(
        sender=_node_id(raw[_K_SENDER], "sender"),
        addr=_addr(raw[_K_ADDR], "addr"),
        message=decode_body(raw[_K_BODY]),
    )


# --- tensor frames ----------------------------------------------------------

_T_VERSION, _T_DTYPE, _T_SHAPE, _T_HEADER = 0, 1, 2, 3
_TENSOR_KEYS: Final = frozenset({_T_VERSION, _T_DTYPE, _T_SHAPE, _T_HEADER})


def _tensor_layout(dtype: object, shape: object, nbytes: int) -> tuple[str, tuple[int, ...]]:
    """Check dtype and shape against the raw byte count; raises `_Invalid`."""
    if type(dtype) is not str or dtype not in TENSOR_DTYPES:
        _fail(REASON_BAD_TENSOR, "dtype not allowed")
    if not isinstance(shape, list | tuple) or len(shape) > MAX_TENSOR_RANK:
        _fail(REASON_BAD_TENSOR, f"shape must be a sequence of <= {MAX_TENSOR_RANK} dims")
    dims = tuple(shape)
    if not all(type(d) is int and 0 <= d <= MAX_UINT for d in dims):
        _fail(REASON_BAD_TENSOR, "shape dims must be integers in [0, 2**63)")
    if math.prod(dims) * TENSOR_DTYPES[dtype] != nbytes:
        _fail(REASON_BAD_TENSOR, "shape and dtype do not match the raw frame size")
    return dtype, dims


def _header_dict(value: object) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(type(key) is str for key in value):
        _fail(REASON_BAD_FIELD, "tensor header must be a map with text keys")
    return value


def _byte_view(data: object) -> memoryview:
    """A flat byte view of a buffer, without copying; raises `_Invalid`."""
    try:
        view = memoryview(data)  # type: ignore[arg-type]  # any buffer, checked here
    except TypeError:
        _fail(REASON_BAD_TENSOR, "raw frame is not a buffer")
    if not view.c_contiguous:
        _fail(REASON_BAD_TENSOR, "raw frame is not contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def encode_tensor(
    header: Mapping[str, Any],
    array_bytes: bytes | memoryview,
    *,
    dtype: str,
    shape: tuple[int, ...],
) -> list[bytes | memoryview]:
    """Two ZeroMQ frames: a strict CBOR header, then the raw element bytes.

    `array_bytes` is sent as is (no copy): C-contiguous, little-endian
    elements of `dtype`. Floats are allowed in `header` (the data plane may
    carry e.g. a sampling temperature) but tags and the rest are not.
    Raises `EncodeError`.
    """
    try:
        raw: bytes | memoryview = (
            array_bytes if type(array_bytes) is bytes else _byte_view(array_bytes)
        )
        nbytes = len(raw)
        dtype, dims = _tensor_layout(dtype, shape, nbytes)
        head_value = {
            _T_VERSION: PROTOCOL_VERSION,
            _T_DTYPE: dtype,
            _T_SHAPE: list(dims),
            _T_HEADER: _header_dict(dict(header) if isinstance(header, Mapping) else header),
        }
    except _Invalid as exc:
        raise EncodeError(exc.reason, exc.detail) from None
    head = encode_strict_cbor(head_value, max_bytes=MAX_TENSOR_HEADER_BYTES, allow_floats=True)
    return [head, raw]


def decode_tensor(
    frames: Sequence[bytes],
) -> tuple[dict[str, Any], str, tuple[int, ...], memoryview]:
    """(header, dtype, shape, raw bytes view) from a tensor's two frames.

    The raw view shares memory with the received frame: no copy, no
    per-element decoding. Raises `DecodeError` (and nothing else).
    """
    try:
        return _decode_tensor(frames)
    except _Invalid as exc:
        raise DecodeError(exc.reason, exc.detail) from None
    except Exception as exc:  # a gap in the checks must still only drop the frames
        raise DecodeError(REASON_BAD_TENSOR, f"{UNEXPECTED} {type(exc).__name__}") from None


def _decode_tensor(
    frames: Sequence[bytes],
) -> tuple[dict[str, Any], str, tuple[int, ...], memoryview]:
    if len(frames) != 2:
        _fail(REASON_BAD_TENSOR, "a tensor is exactly two frames")
    head_frame, raw_frame = frames
    try:
        head_view = memoryview(head_frame)
    except TypeError:
        _fail(REASON_BAD_TENSOR, "header frame is not a buffer")
    if head_view.nbytes > MAX_TENSOR_HEADER_BYTES:
        _fail(REASON_OVERSIZED, "tensor header over the size cap")
    value = _loads(head_view.tobytes(), max_bytes=MAX_TENSOR_HEADER_BYTES, allow_floats=True)
    _check_versioned_map(value, _T_VERSION, _TENSOR_KEYS, "tensor header")
    raw = _byte_view(raw_frame)
    dtype, dims = _tensor_layout(value[_T_DTYPE], value[_T_SHAPE], raw.nbytes)
    return _header_dict(value[_T_HEADER]), dtype, dims, raw
