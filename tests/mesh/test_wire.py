"""The wire format: round trips, exact drop reasons, and fuzzing.

Hostile input is crafted with cbor2 itself (the real encoder) or as raw
bytes, so each rejection test shows exactly which byte pattern is refused
and why.
"""

from __future__ import annotations

import array
import datetime
import random
import time
from typing import Any

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.messages import (
    Ack,
    Alive,
    Consensus,
    Dead,
    DialBack,
    DialRequest,
    Envelope,
    Gossip,
    Nack,
    Ping,
    PingReq,
    PushPull,
    Record,
    Suspect,
    SyncDelta,
    SyncDigest,
)
from mesh.sync import BUCKETS
from mesh.wire import (
    DIAL_NONCE_BYTES,
    DROP_REASONS,
    MAX_ADDR_CHARS,
    MAX_CBOR_ITEMS,
    MAX_CONTROL_MESSAGE_BYTES,
    MAX_DEPTH,
    MAX_MAP_ENTRIES,
    MAX_PUSHPULL_ENTRIES,
    MAX_RECENT_UPDATES,
    MAX_RECORD_BODY_BYTES,
    MAX_TENSOR_HEADER_BYTES,
    MAX_TENSOR_RANK,
    MAX_UINT,
    MAX_UPDATES_PER_MESSAGE,
    MESSAGE_TYPE_IDS,
    PROTOCOL_VERSION,
    REASON_BAD_FIELD,
    REASON_BAD_TENSOR,
    REASON_BAD_VERSION,
    REASON_FORBIDDEN_ITEM,
    REASON_FORBIDDEN_TAG,
    REASON_MALFORMED_CBOR,
    REASON_OVERSIZED,
    REASON_TOO_DEEP,
    REASON_TRAILING_BYTES,
    REASON_UNKNOWN_TYPE,
    TENSOR_DTYPES,
    UNEXPECTED,
    UPDATE_KIND_IDS,
    DecodeError,
    EncodeError,
    decode_envelope,
    decode_strict_cbor,
    decode_tensor,
    encode_envelope,
    encode_strict_cbor,
    encode_tensor,
)

NODE = bytes(range(32))
OTHER = bytes(range(32, 64))
SIG = bytes(range(64, 128))
ADDR = "tcp://10.0.0.12:7946"

ALIVE = Alive(NODE, 7, ADDR, SIG)
SUSPECT = Suspect(OTHER, 3, NODE, SIG)
DEAD = Dead(OTHER, 4, NODE, SIG)
RECORD = Record(NODE, 12, b"\xa1\x61a\x01", SIG)

EXAMPLES = [
    Ping(1, OTHER),
    Ping(2, OTHER, (ALIVE, SUSPECT)),
    PingReq(3, OTHER, "tcp://10.0.0.13:7946", (DEAD,)),
    Ack(4, (RECORD,)),
    Ack(5),
    Nack(6),
    Gossip((ALIVE,)),
    Gossip(()),
    PushPull(True, False, (ALIVE, SUSPECT, DEAD), (RECORD,)),
    PushPull(False, True, (), ()),
    Consensus(b"\x84\x06", SIG),
    SyncDigest((0,)),
    SyncDigest(tuple(range(BUCKETS))),
    SyncDigest((1, 2), (ALIVE, SUSPECT, DEAD), (RECORD,)),
    SyncDelta(False, 1, (0,), (ALIVE, SUSPECT, DEAD), (RECORD,)),
    SyncDelta(False, 8, (0, 32, 200), (ALIVE, SUSPECT), ()),
    SyncDelta(True, 0, (), (ALIVE, SUSPECT, DEAD), (RECORD,)),
    SyncDelta(True, 0, (), (), ()),
    DialRequest(bytes(range(16))),
    DialBack(bytes(range(16, 32))),
]

GOSSIP = Envelope(NODE, ADDR, Gossip((ALIVE,)))

# --- strategies -------------------------------------------------------------

node_ids = st.binary(min_size=32, max_size=32)
signatures = st.binary(min_size=64, max_size=64)
uints = st.integers(min_value=0, max_value=MAX_UINT)
addrs = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=MAX_ADDR_CHARS
)
alives = st.builds(Alive, node_ids, uints, addrs, signatures)
suspects = st.builds(Suspect, node_ids, uints, node_ids, signatures)
deads = st.builds(Dead, node_ids, uints, node_ids, signatures)
records = st.builds(Record, node_ids, uints, st.binary(max_size=MAX_RECORD_BODY_BYTES), signatures)
states = st.one_of(alives, suspects, deads)
updates = st.lists(st.one_of(states, records), max_size=4).map(tuple)
messages = st.one_of(
    st.builds(Ping, uints, node_ids, updates),
    st.builds(PingReq, uints, node_ids, addrs, updates),
    st.builds(Ack, uints, updates),
    st.builds(Nack, uints),
    st.builds(Gossip, updates),
    st.builds(
        PushPull,
        st.booleans(),
        st.booleans(),
        st.lists(states, max_size=4).map(tuple),
        st.lists(records, max_size=3).map(tuple),
    ),
    st.builds(Consensus, st.binary(min_size=1, max_size=256), signatures),
    st.builds(DialRequest, st.binary(min_size=16, max_size=16)),
    st.builds(DialBack, st.binary(min_size=16, max_size=16)),
    st.builds(
        SyncDigest,
        st.integers(0, 8)
        .flatmap(lambda k: st.lists(uints, min_size=1 << k, max_size=1 << k))
        .map(tuple),
        st.lists(states, max_size=4).map(tuple),
        st.lists(records, max_size=3).map(tuple),
    ),
    st.builds(
        lambda bits, extra, states, records: SyncDelta(
            False,
            bits,
            tuple(
                sorted({u.node[0] >> (8 - bits) for u in states + records} | {extra >> (8 - bits)})
            ),
            tuple(states),
            tuple(records),
        ),
        st.integers(0, 8),
        st.integers(0, 255),
        st.lists(states, max_size=4),
        st.lists(records, max_size=3),
    ),
    st.builds(
        SyncDelta,
        st.just(True),
        st.just(0),
        st.just(()),
        st.lists(states, max_size=4).map(tuple),
        st.lists(records, max_size=3).map(tuple),
    ),
)
envelopes = st.builds(Envelope, node_ids, addrs, messages)

# Arbitrary CBOR-able values, to reach the schema checks with wrong shapes.
cbor_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**64) + 1, max_value=2**64 - 1),
        st.binary(max_size=70),
        st.text(max_size=10),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.integers(-2, 6) | st.text(max_size=2), inner, max_size=6),
    ),
    max_leaves=20,
)

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reason_of(data: bytes) -> str:
    with pytest.raises(DecodeError) as info:
        decode_envelope(data)
    return info.value.reason


def raw(envelope: Envelope = GOSSIP) -> Any:
    """The envelope as plain CBOR values, ready to be tampered with."""
    return cbor2.loads(encode_envelope(envelope))


# --- round trips ------------------------------------------------------------


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips(message: Any) -> None:
    envelope = Envelope(NODE, ADDR, message)
    assert decode_envelope(encode_envelope(envelope)) == envelope


@FAST
@given(envelopes)
def test_any_valid_envelope_round_trips(envelope: Envelope) -> None:
    decoded = decode_envelope(encode_envelope(envelope))
    assert decoded == envelope
    for name in ("updates", "states", "records", "fingerprints", "buckets"):
        if hasattr(decoded.message, name):
            assert type(getattr(decoded.message, name)) is tuple


def test_type_ids_are_the_documented_append_only_table() -> None:
    assert dict(MESSAGE_TYPE_IDS) == {
        Ping: 1, PingReq: 2, Ack: 3, Nack: 4, Gossip: 5, PushPull: 6, Consensus: 7,
        SyncDigest: 8, SyncDelta: 9, DialRequest: 10, DialBack: 11,
    }  # fmt: skip
    assert dict(UPDATE_KIND_IDS) == {Alive: 1, Suspect: 2, Dead: 3, Record: 4}
    value = raw(GOSSIP)
    assert value[0] == PROTOCOL_VERSION == 1
    assert value[1] == 5
    assert value[4] == [[[1, NODE, 7, ADDR, SIG]]]


# Pinned bytes: what a peer of another version decodes. Old messages' bytes
# never change (a Ping pinned before the dial-back pair was added); the
# dial-back pair (issue 29) is pinned from its first version on.
_HEAD = "a5000101"  # map of 5: version 1, then the type id
_SENDER_ADDR = (
    "025820000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    "03747463703a2f2f31302e302e302e31323a37393436"
)


@pytest.mark.parametrize(
    ("message", "pinned"),
    [
        pytest.param(
            Ping(3, NODE),
            "01" + _SENDER_ADDR + "0483035820" + NODE.hex() + "80",
            id="ping",
        ),
        pytest.param(
            DialRequest(bytes(range(16))),
            "0a" + _SENDER_ADDR + "048150000102030405060708090a0b0c0d0e0f",
            id="dial-request",
        ),
        pytest.param(
            DialBack(bytes(range(16, 32))),
            "0b" + _SENDER_ADDR + "048150101112131415161718191a1b1c1d1e1f",
            id="dial-back",
        ),
    ],
)
def test_pinned_bytes(message: Any, pinned: str) -> None:
    envelope = Envelope(NODE, ADDR, message)
    assert encode_envelope(envelope).hex() == _HEAD + pinned
    assert decode_envelope(bytes.fromhex(_HEAD + pinned)) == envelope


@pytest.mark.parametrize("kind", [DialRequest, DialBack])
@pytest.mark.parametrize(
    "nonce",
    [b"", bytes(DIAL_NONCE_BYTES - 1), bytes(DIAL_NONCE_BYTES + 1), "0" * 16, 16, None],
    ids=["empty", "15-bytes", "17-bytes", "text", "int", "null"],
)
def test_a_dial_nonce_of_the_wrong_shape_is_refused_by_name(kind: type, nonce: object) -> None:
    value = raw(Envelope(NODE, ADDR, kind(bytes(DIAL_NONCE_BYTES))))
    value[4] = [nonce]
    with pytest.raises(DecodeError) as info:
        decode_envelope(cbor2.dumps(value))
    assert info.value.reason == REASON_BAD_FIELD
    assert f"dial nonce must be {DIAL_NONCE_BYTES} bytes" in str(info.value)
    with pytest.raises(EncodeError, match="dial nonce"):
        encode_envelope(Envelope(NODE, ADDR, kind(nonce)))


@pytest.mark.parametrize("body", [[], [bytes(16), bytes(16)], {0: bytes(16)}, bytes(16)])
def test_a_dial_body_of_the_wrong_shape_is_refused(body: object) -> None:
    value = raw(Envelope(NODE, ADDR, DialRequest(bytes(16))))
    value[4] = body
    assert reason_of(cbor2.dumps(value)) == REASON_BAD_FIELD


def test_bytes_like_input_is_accepted() -> None:
    data = encode_envelope(GOSSIP)
    assert decode_envelope(bytearray(data)) == GOSSIP  # type: ignore[arg-type]
    assert decode_envelope(memoryview(data)) == GOSSIP  # type: ignore[arg-type]


def test_limits_are_inclusive() -> None:
    most = Envelope(NODE, "a" * MAX_ADDR_CHARS, Gossip((ALIVE,) * MAX_UPDATES_PER_MESSAGE))
    assert decode_envelope(encode_envelope(most)) == most
    big = Envelope(NODE, ADDR, Ack(MAX_UINT, (Record(NODE, 0, bytes(MAX_RECORD_BODY_BYTES), SIG),)))
    assert decode_envelope(encode_envelope(big)) == big


# --- sizes ------------------------------------------------------------------


def test_gossip_with_one_alive_is_compact() -> None:
    # The gossip benchmark counts bytes per node per second; 128 of these
    # bytes are two node ids and a signature, which nothing can shrink.
    assert len(encode_envelope(GOSSIP)) < 200


def test_ping_without_updates_is_compact() -> None:
    assert len(encode_envelope(Envelope(NODE, ADDR, Ping(1, OTHER)))) < 110


def test_push_pull_of_a_thousand_node_swarm_fits() -> None:
    rng = random.Random(7)
    members = [rng.randbytes(32) for _ in range(1000)]
    envelope = Envelope(
        NODE,
        ADDR,
        PushPull(
            True,
            False,
            tuple(Alive(m, 1, ADDR, SIG) for m in members),
            tuple(Record(m, 1, rng.randbytes(2048), SIG) for m in members),
        ),
    )
    data = encode_envelope(envelope)
    assert len(data) < MAX_CONTROL_MESSAGE_BYTES
    assert decode_envelope(data) == envelope


# --- rejections: CBOR level -------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff",  # a break with nothing to end
        b"\x1c",  # reserved additional information
        b"\x5a\xff\xff\xff\xff",  # a byte string claiming 4 GiB
        b"\x9b" + b"\xff" * 8,  # an array claiming 2**64 - 1 items
        encode_envelope(GOSSIP)[:-1],  # truncated
    ],
)
def test_malformed_cbor_is_refused(data: bytes) -> None:
    assert reason_of(data) == REASON_MALFORMED_CBOR


def test_invalid_utf8_text_is_malformed() -> None:
    data = encode_envelope(GOSSIP)
    addr = ADDR.encode()
    assert reason_of(data.replace(addr, b"\xff" + addr[1:], 1)) == REASON_MALFORMED_CBOR


def test_duplicate_map_keys_are_malformed() -> None:
    # {0: 1, 0: 1, 2: ..., 3: ..., 4: ...}: five entries, key 0 twice.
    value = raw()
    body = b"".join(cbor2.dumps(k) + cbor2.dumps(value[k]) for k in (0, 0, 2, 3, 4))
    assert reason_of(b"\xa5" + body) == REASON_MALFORMED_CBOR


def test_size_cap_is_checked_before_parsing() -> None:
    # Garbage that would be malformed is refused as oversized: nothing parsed.
    assert reason_of(b"\xff" * (MAX_CONTROL_MESSAGE_BYTES + 1)) == REASON_OVERSIZED
    too_big = cbor2.dumps(bytes(MAX_CONTROL_MESSAGE_BYTES))
    assert reason_of(too_big) == REASON_OVERSIZED


def test_too_many_items_is_oversized() -> None:
    items = cbor2.dumps([0] * (MAX_CBOR_ITEMS + 1))
    assert len(items) < MAX_CONTROL_MESSAGE_BYTES
    assert reason_of(items) == REASON_OVERSIZED


def test_too_many_map_entries_is_a_bad_field() -> None:
    assert reason_of(cbor2.dumps({i: 0 for i in range(MAX_MAP_ENTRIES + 1)})) == REASON_BAD_FIELD


def test_nesting_up_to_the_cap_parses_and_one_more_is_too_deep() -> None:
    assert decode_strict_cbor(b"\x81" * MAX_DEPTH + b"\x00", max_bytes=64) is not None
    assert reason_of(b"\x81" * (MAX_DEPTH + 1) + b"\x00") == REASON_TOO_DEEP
    assert reason_of(b"\x81" * (MAX_DEPTH + 1) + b"\x80") == REASON_TOO_DEEP  # empty innermost


@pytest.mark.parametrize(
    "bomb",
    [
        b"\x81" * 100_000 + b"\x00",  # nested arrays
        b"\xa1\x00" * 100_000 + b"\x00",  # nested maps
        b"\x9f" * 100_000,  # nested indefinite arrays, never closed
    ],
    ids=["arrays", "maps", "indefinite"],
)
def test_depth_bombs_fail_fast(bomb: bytes) -> None:
    start = time.perf_counter()
    reason = reason_of(bomb)
    assert time.perf_counter() - start < 0.05
    assert reason in {REASON_TOO_DEEP, REASON_FORBIDDEN_ITEM}
    if bomb[0] != 0x9F:
        assert reason == REASON_TOO_DEEP


def test_huge_depth_bomb_is_oversized() -> None:
    assert reason_of(b"\x81" * (MAX_CONTROL_MESSAGE_BYTES + 1)) == REASON_OVERSIZED


@pytest.mark.parametrize(
    "tagged",
    [
        cbor2.CBORTag(2, b"\x01"),  # bignum: cbor2 would decode it silently
        cbor2.CBORTag(1, 1),  # epoch datetime
        cbor2.CBORTag(28, 7),  # shared value (references could form cycles)
        cbor2.CBORTag(5000, 7),  # an unregistered tag
    ],
    ids=["bignum", "datetime", "shareable", "unknown"],
)
def test_any_tag_is_forbidden(tagged: cbor2.CBORTag) -> None:
    value = raw()
    value[4][0][0][2] = tagged  # the incarnation
    assert reason_of(cbor2.dumps(value)) == REASON_FORBIDDEN_TAG


def test_self_describe_prefix_is_a_forbidden_tag() -> None:
    assert reason_of(b"\xd9\xd9\xf7" + encode_envelope(GOSSIP)) == REASON_FORBIDDEN_TAG


@pytest.mark.parametrize(
    "incarnation",
    [7.0, cbor2.undefined, cbor2.CBORSimpleValue(99)],
    ids=["float", "undefined", "simple"],
)
def test_values_outside_the_dialect_are_forbidden(incarnation: object) -> None:
    value = raw()
    value[4][0][0][2] = incarnation
    assert reason_of(cbor2.dumps(value)) == REASON_FORBIDDEN_ITEM


def test_indefinite_length_is_forbidden() -> None:
    indefinite = cbor2.dumps(raw(), indefinite_containers=True)
    assert decode_strict_cbor(cbor2.dumps(raw()), max_bytes=1024)  # same value, definite
    assert reason_of(indefinite) == REASON_FORBIDDEN_ITEM


def test_trailing_bytes_are_refused() -> None:
    assert reason_of(encode_envelope(GOSSIP) + b"\x00") == REASON_TRAILING_BYTES


# --- rejections: envelope and schema ----------------------------------------


@pytest.mark.parametrize("version", [0, 2, 2**40])
def test_other_protocol_versions_are_refused(version: int) -> None:
    value = raw()
    value[0] = version
    assert reason_of(cbor2.dumps(value)) == REASON_BAD_VERSION


def test_a_future_version_is_bad_version_even_with_an_unknown_layout() -> None:
    assert reason_of(cbor2.dumps({0: 2, 9: "whatever"})) == REASON_BAD_VERSION


@pytest.mark.parametrize("type_id", [0, 12, 99, MAX_UINT])
def test_unknown_message_types_are_refused(type_id: int) -> None:
    value = raw()
    value[1] = type_id
    assert reason_of(cbor2.dumps(value)) == REASON_UNKNOWN_TYPE


def _tamper(path: tuple[Any, ...], new: object, envelope: Envelope = GOSSIP) -> bytes:
    value = raw(envelope)
    target = value
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = new
    return cbor2.dumps(value)


ALIVE_AT = (4, 0, 0)  # envelope body > updates > first update
PUSH_PULL = Envelope(NODE, ADDR, PushPull(True, False, (ALIVE,), (RECORD,)))
DIGEST = Envelope(NODE, ADDR, SyncDigest((1, 2)))
DELTA = Envelope(NODE, ADDR, SyncDelta(False, 8, (NODE[0], OTHER[0]), (ALIVE, SUSPECT), ()))
REPLY = Envelope(NODE, ADDR, SyncDelta(True, 0, (), (ALIVE,), (RECORD,)))


@pytest.mark.parametrize(
    ("data"),
    [
        pytest.param(_tamper((*ALIVE_AT, 2), "7"), id="incarnation-as-text"),
        pytest.param(_tamper((*ALIVE_AT, 2), -1), id="negative-incarnation"),
        pytest.param(_tamper((*ALIVE_AT, 2), 2**63), id="incarnation-2**63"),
        pytest.param(_tamper((*ALIVE_AT, 2), True), id="incarnation-as-bool"),
        pytest.param(_tamper((*ALIVE_AT, 1), NODE[:31]), id="node-id-31-bytes"),
        pytest.param(_tamper((*ALIVE_AT, 1), NODE + b"\x00"), id="node-id-33-bytes"),
        pytest.param(_tamper((*ALIVE_AT, 1), NODE.hex()), id="node-id-as-text"),
        pytest.param(_tamper((*ALIVE_AT, 4), SIG[:63]), id="signature-63-bytes"),
        pytest.param(_tamper((*ALIVE_AT, 3), "tcp://x\n"), id="addr-control-char"),
        pytest.param(_tamper((*ALIVE_AT, 3), "tcp://é"), id="addr-non-ascii"),
        pytest.param(_tamper((*ALIVE_AT, 3), "a" * (MAX_ADDR_CHARS + 1)), id="addr-too-long"),
        pytest.param(_tamper((*ALIVE_AT, 0), 9), id="unknown-update-kind"),
        pytest.param(_tamper((*ALIVE_AT, 0), "alive"), id="update-kind-as-text"),
        pytest.param(_tamper(ALIVE_AT, [1, NODE, 7, ADDR]), id="update-too-short"),
        pytest.param(_tamper(ALIVE_AT, []), id="update-empty"),
        pytest.param(_tamper((4, 0), {}), id="updates-as-map"),
        pytest.param(_tamper((4,), []), id="body-too-short"),
        pytest.param(_tamper((4,), {0: []}), id="body-as-map"),
        pytest.param(_tamper((2,), NODE[:31]), id="sender-31-bytes"),
        pytest.param(_tamper((3,), 5), id="envelope-addr-as-int"),
        pytest.param(_tamper((1,), "5"), id="type-as-text"),
        pytest.param(_tamper((0,), "1"), id="version-as-text"),
        pytest.param(_tamper((4, 0), [[1, NODE, 7, ADDR, SIG]] * 257), id="too-many-updates"),
        pytest.param(_tamper((4, 0), 1, PUSH_PULL), id="join-as-int"),
        pytest.param(_tamper((4, 2, 0), [4, NODE, 1, b"", SIG], PUSH_PULL), id="record-in-states"),
        pytest.param(_tamper((4, 3, 0), [1, NODE, 1, ADDR, SIG], PUSH_PULL), id="alive-in-records"),
        pytest.param(
            _tamper((4, 3, 0, 3), bytes(MAX_RECORD_BODY_BYTES + 1), PUSH_PULL),
            id="record-body-too-big",
        ),
        pytest.param(_tamper((4, 0), [1, 2, 3], DIGEST), id="digest-of-three"),
        pytest.param(_tamper((4, 0), [], DIGEST), id="digest-empty"),
        pytest.param(_tamper((4, 0), [0] * (BUCKETS * 2), DIGEST), id="digest-too-long"),
        pytest.param(_tamper((4, 0, 0), -1, DIGEST), id="fingerprint-negative"),
        pytest.param(_tamper((4, 0, 0), 2**63, DIGEST), id="fingerprint-2**63"),
        pytest.param(
            _tamper((4, 1), [[1, NODE, 1, ADDR, SIG]] * (MAX_RECENT_UPDATES + 1), DIGEST),
            id="digest-with-too-many-recent-states",
        ),
        pytest.param(
            _tamper((4, 2), [[1, NODE, 1, ADDR, SIG]], DIGEST), id="digest-alive-in-records"
        ),
        pytest.param(_tamper((4,), [[1, 2]], DIGEST), id="digest-without-recent-state"),
        pytest.param(_tamper((4, 1), 9, DELTA), id="delta-bits-9"),
        pytest.param(_tamper((4, 2), [OTHER[0], NODE[0]], DELTA), id="buckets-descending"),
        pytest.param(_tamper((4, 2), [NODE[0], NODE[0]], DELTA), id="buckets-repeated"),
        pytest.param(_tamper((4, 2), [], DELTA), id="delta-without-buckets"),
        pytest.param(_tamper((4, 2), [NODE[0]], DELTA), id="member-outside-buckets"),
        pytest.param(_tamper((4, 2), [NODE[0], OTHER[0], 256], DELTA), id="bucket-past-bits"),
        pytest.param(_tamper((4, 2), [0], REPLY), id="reply-with-buckets"),
        pytest.param(_tamper((4, 1), 3, REPLY), id="reply-with-bits"),
        pytest.param(_tamper((4, 0), 0, DELTA), id="delta-reply-as-int"),
        pytest.param(
            _tamper((4, 4, 0), [1, NODE, 1, ADDR, SIG], REPLY), id="delta-alive-in-records"
        ),
        pytest.param(
            _tamper((4, 3, 0), [4, NODE, 1, b"", SIG], REPLY), id="delta-record-in-states"
        ),
        pytest.param(cbor2.dumps([1, 5, NODE, ADDR, [[]]]), id="envelope-as-array"),
        pytest.param(cbor2.dumps({False: 1, 1: 5, 2: NODE, 3: ADDR, 4: [[]]}), id="bool-key"),
        pytest.param(cbor2.dumps({0: 1, 1: 5, 2: NODE, 3: ADDR}), id="missing-body"),
        pytest.param(cbor2.dumps({1: 5, 2: NODE, 3: ADDR, 4: [[]]}), id="missing-version"),
        pytest.param(cbor2.dumps({0: 1, 1: 5, 2: NODE, 3: ADDR, 4: [[]], 5: 0}), id="unknown-key"),
    ],
)
def test_schema_violations_are_bad_fields(data: bytes) -> None:
    assert reason_of(data) == REASON_BAD_FIELD


def test_too_many_push_pull_entries_are_refused() -> None:
    alive = [1, NODE, 1, "", SIG]
    assert reason_of(_tamper((4, 2), [alive] * (MAX_PUSHPULL_ENTRIES + 1), PUSH_PULL)) == (
        REASON_BAD_FIELD
    )


def test_too_many_delta_entries_are_refused() -> None:
    alive = [1, NODE, 1, "", SIG]
    too_many = _tamper((4, 3), [alive] * (MAX_PUSHPULL_ENTRIES + 1), REPLY)
    assert reason_of(too_many) == REASON_BAD_FIELD


def test_non_bytes_input_is_a_decode_error() -> None:
    with pytest.raises(DecodeError) as info:
        decode_envelope("not bytes")  # type: ignore[arg-type]
    assert info.value.reason == REASON_MALFORMED_CBOR


# --- encoding refuses what decoding would -----------------------------------


@pytest.mark.parametrize(
    ("envelope", "reason"),
    [
        (Envelope(NODE[:31], ADDR, Nack(1)), REASON_BAD_FIELD),
        (Envelope(NODE, ADDR, Nack(-1)), REASON_BAD_FIELD),
        (Envelope(NODE, ADDR, Nack(True)), REASON_BAD_FIELD),
        (Envelope(NODE, ADDR, Nack(2**63)), REASON_BAD_FIELD),
        (Envelope(NODE, "tcp://\x1b[31m", Nack(1)), REASON_BAD_FIELD),
        (Envelope(NODE, ADDR, Gossip((Alive(NODE, 1, ADDR, SIG[:10]),))), REASON_BAD_FIELD),
        (Envelope(NODE, ADDR, Gossip((ALIVE,) * (MAX_UPDATES_PER_MESSAGE + 1))), REASON_BAD_FIELD),
        (Envelope(NODE, ADDR, Gossip(("not an update",))), REASON_BAD_FIELD),  # type: ignore[arg-type]
        (Envelope(NODE, ADDR, PushPull(1, False, (), ())), REASON_BAD_FIELD),  # type: ignore[arg-type]
        (Envelope(NODE, ADDR, PushPull(True, False, (RECORD,), ())), REASON_BAD_FIELD),  # type: ignore[arg-type]
        (Envelope(NODE, ADDR, PushPull(True, False, (), (ALIVE,))), REASON_BAD_FIELD),  # type: ignore[arg-type]
        (Envelope(NODE, ADDR, SyncDigest((1, 2, 3))), REASON_BAD_FIELD),
        (Envelope(NODE, ADDR, SyncDigest((2**63,))), REASON_BAD_FIELD),
        (Envelope(NODE, ADDR, SyncDelta(False, 8, (OTHER[0],), (ALIVE,), ())), REASON_BAD_FIELD),
        (Envelope(NODE, ADDR, SyncDelta(True, 0, (), (RECORD,), ())), REASON_BAD_FIELD),  # type: ignore[arg-type]
        (Envelope(NODE, ADDR, Consensus(b"", SIG)), REASON_BAD_FIELD),
        (Envelope(NODE, ADDR, Consensus(b"x", SIG[:63])), REASON_BAD_FIELD),
        (Envelope(NODE, ADDR, "hello"), REASON_UNKNOWN_TYPE),  # type: ignore[arg-type]
    ],
)
def test_encoding_refuses_what_peers_would_drop(envelope: Envelope, reason: str) -> None:
    with pytest.raises(EncodeError) as info:
        encode_envelope(envelope)
    assert info.value.reason == reason


def test_encoding_an_oversized_message_asks_to_split_it() -> None:
    body = bytes(MAX_RECORD_BODY_BYTES)
    many = tuple(Record(NODE, i, body, SIG) for i in range(300))  # ~4.9 MB
    with pytest.raises(EncodeError) as info:
        encode_envelope(Envelope(NODE, ADDR, PushPull(False, False, (), many)))
    assert info.value.reason == REASON_OVERSIZED


def test_strict_cbor_helpers_share_the_dialect() -> None:
    value = {"addrs": ["tcp://a:1"], "seq": 3, "spare": True, "note": None}
    assert decode_strict_cbor(encode_strict_cbor(value, max_bytes=1024), max_bytes=1024) == value
    for bad, reason in [
        ({"when": datetime.datetime.now(datetime.UTC)}, REASON_FORBIDDEN_TAG),
        ({"ids": {1, 2}}, REASON_FORBIDDEN_TAG),
        ({"big": 2**70}, REASON_FORBIDDEN_TAG),
        ({"ratio": 0.5}, REASON_FORBIDDEN_ITEM),
        ([[[[[[[[[1]]]]]]]]], REASON_TOO_DEEP),
        (object(), REASON_BAD_FIELD),
    ]:
        with pytest.raises(EncodeError) as info:
            encode_strict_cbor(bad, max_bytes=1024)
        assert info.value.reason == reason
    assert encode_strict_cbor({"ratio": 0.5}, max_bytes=64, allow_floats=True)
    with pytest.raises(EncodeError) as info:
        encode_strict_cbor(b"x" * 100, max_bytes=64)
    assert info.value.reason == REASON_OVERSIZED


# --- fuzzing: only DecodeError, ever ----------------------------------------


def _decodes_or_drops(data: bytes) -> None:
    """The property every input must satisfy: a valid envelope or a counted drop."""
    try:
        envelope = decode_envelope(data)
    except DecodeError as exc:
        assert exc.reason in DROP_REASONS
        assert not exc.detail.startswith(UNEXPECTED), exc  # refused by a deliberate check
        return
    # Whatever we accept, we can relay: it re-encodes and decodes to itself.
    assert decode_envelope(encode_envelope(envelope)) == envelope


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_only_raise_decode_error(data: bytes) -> None:
    _decodes_or_drops(data)


mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "set", "insert", "delete"]),
        st.integers(0, 10**6),
        st.integers(0, 255),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(envelopes, mutations)
def test_mutated_valid_encodings_only_raise_decode_error(
    envelope: Envelope, edits: list[tuple[str, int, int]]
) -> None:
    data = bytearray(encode_envelope(envelope))
    for op, where, byte in edits:
        i = where % (len(data) + 1)
        if op == "insert":
            data.insert(i, byte)
        elif i < len(data):
            if op == "flip":
                data[i] ^= 1 << (byte % 8)
            elif op == "set":
                data[i] = byte
            else:
                del data[i]
    _decodes_or_drops(bytes(data))


@FAST
@given(cbor_values)
def test_arbitrary_cbor_values_only_raise_decode_error(value: object) -> None:
    _decodes_or_drops(cbor2.dumps(value))


@FAST
@given(st.sampled_from(sorted(MESSAGE_TYPE_IDS.values())), cbor_values, cbor_values)
def test_envelope_shaped_junk_only_raises_decode_error(
    type_id: int, sender: object, body: object
) -> None:
    _decodes_or_drops(cbor2.dumps({0: 1, 1: type_id, 2: sender, 3: ADDR, 4: body}))
    _decodes_or_drops(cbor2.dumps({0: 1, 1: type_id, 2: NODE, 3: ADDR, 4: [body] * 4}))


# --- tensor frames ----------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(TENSOR_DTYPES))
def test_tensor_round_trips_for_every_dtype(dtype: str) -> None:
    shape = (2, 3, 4)
    raw_bytes = bytes(i % 251 for i in range(24 * TENSOR_DTYPES[dtype]))
    header = {"request": "r-1", "layers": [0, 16], "pos": 5, "temperature": 0.7}
    frames = encode_tensor(header, raw_bytes, dtype=dtype, shape=shape)
    assert len(frames) == 2
    assert frames[1] is raw_bytes  # sent as is, never re-encoded
    got_header, got_dtype, got_shape, view = decode_tensor(frames)  # type: ignore[arg-type]
    assert (got_header, got_dtype, got_shape) == (header, dtype, shape)
    assert isinstance(view, memoryview)
    assert view.obj is raw_bytes  # no copy of the tensor on the way in either
    assert bytes(view) == raw_bytes


def test_tensor_from_a_typed_buffer_is_sent_as_bytes() -> None:
    values = array.array("f", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    frames = encode_tensor({}, memoryview(values), dtype="float32", shape=(2, 3))
    _, _, shape, view = decode_tensor([bytes(frames[0]), bytes(frames[1])])
    assert shape == (2, 3)
    assert view.nbytes == 24
    assert array.array("f", bytes(view)) == values


def test_empty_and_scalar_tensors() -> None:
    assert decode_tensor(encode_tensor({}, b"", dtype="int32", shape=(0, 8)))[2] == (0, 8)  # type: ignore[arg-type]
    assert decode_tensor(encode_tensor({}, b"\x01\x00", dtype="bfloat16", shape=()))[2] == ()  # type: ignore[arg-type]


def _tensor_reason(frames: list[Any]) -> str:
    with pytest.raises(DecodeError) as info:
        decode_tensor(frames)
    return info.value.reason


def _head(**changes: Any) -> bytes:
    value: dict[int, Any] = {0: PROTOCOL_VERSION, 1: "float16", 2: [2, 2], 3: {}}
    for key, new in changes.items():
        value[{"version": 0, "dtype": 1, "shape": 2, "header": 3}[key]] = new
    return cbor2.dumps(value)


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        pytest.param([_head(dtype="float128"), bytes(8)], REASON_BAD_TENSOR, id="dtype"),
        pytest.param([_head(dtype=2), bytes(8)], REASON_BAD_TENSOR, id="dtype-as-int"),
        pytest.param([_head(), bytes(7)], REASON_BAD_TENSOR, id="too-few-bytes"),
        pytest.param([_head(), bytes(9)], REASON_BAD_TENSOR, id="too-many-bytes"),
        pytest.param([_head(shape=[-2, -2]), bytes(8)], REASON_BAD_TENSOR, id="negative-dims"),
        pytest.param([_head(shape=[2.0, 2]), bytes(8)], REASON_BAD_TENSOR, id="float-dim"),
        pytest.param([_head(shape=7), bytes(8)], REASON_BAD_TENSOR, id="shape-not-array"),
        pytest.param(
            [_head(shape=[1] * (MAX_TENSOR_RANK + 1)), bytes(2)], REASON_BAD_TENSOR, id="rank"
        ),
        pytest.param([_head()], REASON_BAD_TENSOR, id="one-frame"),
        pytest.param([_head(), bytes(8), b""], REASON_BAD_TENSOR, id="three-frames"),
        pytest.param([_head(), 12345], REASON_BAD_TENSOR, id="raw-not-a-buffer"),
        pytest.param([_head(version=2), bytes(8)], REASON_BAD_VERSION, id="version"),
        pytest.param([_head(header=[1]), bytes(8)], REASON_BAD_FIELD, id="header-not-map"),
        pytest.param([_head(header={1: 2}), bytes(8)], REASON_BAD_FIELD, id="header-int-key"),
        pytest.param([cbor2.dumps({0: 1}), bytes(8)], REASON_BAD_FIELD, id="missing-keys"),
        pytest.param(
            [_head(header={"t": cbor2.CBORTag(1, 0)}), bytes(8)], REASON_FORBIDDEN_TAG, id="tag"
        ),
        pytest.param([_head() + b"\x00", bytes(8)], REASON_TRAILING_BYTES, id="trailing"),
        pytest.param([b"\xff", bytes(8)], REASON_MALFORMED_CBOR, id="malformed"),
        pytest.param(
            [bytes(MAX_TENSOR_HEADER_BYTES + 1), bytes(8)], REASON_OVERSIZED, id="huge-header"
        ),
        pytest.param(
            [b"\x81" * (MAX_DEPTH + 1) + b"\x00", bytes(8)], REASON_TOO_DEEP, id="deep-header"
        ),
    ],
)
def test_bad_tensor_frames_are_refused(frames: list[Any], reason: str) -> None:
    assert _tensor_reason(frames) == reason


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"dtype": "complex64", "shape": (2,)}, REASON_BAD_TENSOR),
        ({"dtype": "float32", "shape": (3,)}, REASON_BAD_TENSOR),
        ({"dtype": "float32", "shape": (-1, -2)}, REASON_BAD_TENSOR),
        ({"dtype": "float32", "shape": (1,) * 9 + (2,)}, REASON_BAD_TENSOR),
    ],
)
def test_encode_tensor_refuses_inconsistent_layouts(kwargs: dict[str, Any], reason: str) -> None:
    with pytest.raises(EncodeError) as info:
        encode_tensor({}, bytes(8), **kwargs)
    assert info.value.reason == reason


def test_encode_tensor_refuses_headers_peers_would_drop() -> None:
    with pytest.raises(EncodeError) as info:
        encode_tensor({"at": datetime.date(2024, 1, 1)}, bytes(2), dtype="uint8", shape=(2,))
    assert info.value.reason == REASON_FORBIDDEN_TAG
    with pytest.raises(EncodeError) as info:
        encode_tensor({1: "x"}, bytes(2), dtype="uint8", shape=(2,))  # type: ignore[dict-item]
    assert info.value.reason == REASON_BAD_FIELD


def _tensor_decodes_or_drops(frames: list[Any]) -> None:
    try:
        decode_tensor(frames)
    except DecodeError as exc:
        assert exc.reason in DROP_REASONS
        assert not exc.detail.startswith(UNEXPECTED), exc


@FAST
@given(st.lists(st.binary(max_size=64), max_size=3))
def test_arbitrary_tensor_frames_only_raise_decode_error(frames: list[bytes]) -> None:
    _tensor_decodes_or_drops(frames)


@FAST
@given(cbor_values, st.binary(max_size=64))
def test_tensor_header_junk_only_raises_decode_error(header: object, raw_bytes: bytes) -> None:
    for head in (cbor2.dumps(header), _head(header=header), _head(shape=header)):
        _tensor_decodes_or_drops([head, raw_bytes])
