"""The Raft payload codec: round trips, every drop reason, and fuzzing.

Hostile payloads are built with cbor2 (the real encoder) from the valid
array of a message, changing one thing at a time, so each rejection test
shows which field is refused and why.
"""

from __future__ import annotations

from typing import Any

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consensus.codec import (
    MAX_CONFIG_MEMBERS,
    MAX_ENTRIES_PER_MESSAGE,
    MAX_ENTRY_DATA_BYTES,
    MAX_INSTALL_SNAPSHOT_BYTES,
    MAX_RAFT_MESSAGE_BYTES,
    RAFT_DROP_REASONS,
    RAFT_TYPE_IDS,
    RaftDecodeError,
    RaftEncodeError,
    decode_raft,
    encode_raft,
)
from consensus.commands import MAX_COMMAND_BYTES
from consensus.log import Entry, EntryKind, Snapshot
from consensus.raft import (
    AppendEntries,
    AppendResponse,
    InstallSnapshot,
    Message,
    RaftConfig,
    RequestVote,
    TimeoutNow,
    VoteResponse,
)
from mesh.wire import MAX_CONTROL_MESSAGE_BYTES, UNEXPECTED, DecodeError

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

A = bytes(range(32))
B = bytes(range(1, 33))
C = bytes(range(2, 34))

# --- strategies -------------------------------------------------------------

node_ids = st.binary(min_size=32, max_size=32)
uints = st.integers(min_value=0, max_value=2**63 - 1)
small = st.integers(min_value=0, max_value=1000)
kinds = st.sampled_from(list(EntryKind))


@st.composite
def append_entries(draw: st.DrawFn) -> AppendEntries:
    count = draw(st.integers(0, 8))
    prev = draw(st.one_of(small, st.integers(0, 2**63 - 1 - MAX_ENTRIES_PER_MESSAGE)))
    entries = tuple(
        Entry(
            term=draw(uints),
            index=prev + 1 + i,
            kind=draw(kinds),
            data=draw(st.binary(max_size=64)),
        )
        for i in range(count)
    )
    return AppendEntries(to=draw(node_ids), term=draw(uints), leader=draw(node_ids),
                         prev_index=prev, prev_term=draw(uints), entries=entries,
                         commit=draw(uints))  # fmt: skip


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    members = draw(st.lists(node_ids, max_size=8, unique=True))
    split = draw(st.integers(0, len(members)))
    return Snapshot(index=draw(uints), term=draw(uints), voters=frozenset(members[:split]),
                    learners=frozenset(members[split:]),
                    data=draw(st.binary(max_size=256)))  # fmt: skip


messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(RequestVote, to=node_ids, term=uints, candidate=node_ids, last_index=uints,
              last_term=uints, pre_vote=st.booleans(), transfer=st.booleans()),
    st.builds(VoteResponse, to=node_ids, term=uints, voter=node_ids, granted=st.booleans(),
              pre_vote=st.booleans()),
    append_entries(),
    st.builds(AppendResponse, to=node_ids, term=uints, follower=node_ids,
              success=st.booleans(), match_index=uints, reject_hint=uints),
    st.builds(InstallSnapshot, to=node_ids, term=uints, leader=node_ids, snapshot=snapshots()),
    st.builds(TimeoutNow, to=node_ids, term=uints, leader=node_ids),
)  # fmt: skip


def reason_of(data: Any) -> str:
    with pytest.raises(RaftDecodeError) as info:
        decode_raft(data)
    return info.value.reason


# --- round trips ------------------------------------------------------------


@FAST
@given(messages)
def test_every_message_round_trips(message: Message) -> None:
    data = encode_raft(message)
    assert decode_raft(data) == message
    assert encode_raft(decode_raft(data)) == data  # canonical: one encoding per message


def test_type_ids_are_the_documented_append_only_table() -> None:
    assert {cls.__name__: i for cls, i in RAFT_TYPE_IDS.items()} == {
        "RequestVote": 1,
        "VoteResponse": 2,
        "AppendEntries": 3,
        "AppendResponse": 4,
        "InstallSnapshot": 5,
        "TimeoutNow": 6,
    }
    for cls, type_id in RAFT_TYPE_IDS.items():
        assert type_id >= 1, cls


def test_a_heartbeat_is_small() -> None:
    heartbeat = AppendEntries(to=A, term=7, leader=B, prev_index=1000, prev_term=7,
                              entries=(), commit=1000)  # fmt: skip
    assert len(encode_raft(heartbeat)) < 90  # two ids are 68 bytes of it


def test_a_full_batch_of_maximal_commands_fits() -> None:
    batch = tuple(
        Entry(term=9, index=11 + i, kind=EntryKind.COMMAND, data=b"c" * MAX_COMMAND_BYTES)
        for i in range(MAX_ENTRIES_PER_MESSAGE)
    )
    message = AppendEntries(to=A, term=9, leader=B, prev_index=10, prev_term=9, entries=batch,
                            commit=10)  # fmt: skip
    data = encode_raft(message)
    assert len(data) <= MAX_RAFT_MESSAGE_BYTES
    assert decode_raft(data) == message


def test_limits_agree_with_the_core_and_the_envelope() -> None:
    assert RaftConfig().max_entries_per_append <= MAX_ENTRIES_PER_MESSAGE
    assert MAX_RAFT_MESSAGE_BYTES < MAX_INSTALL_SNAPSHOT_BYTES < MAX_CONTROL_MESSAGE_BYTES
    assert MAX_ENTRY_DATA_BYTES >= MAX_COMMAND_BYTES


def test_a_snapshot_may_exceed_the_ordinary_cap() -> None:
    snap = Snapshot(index=5, term=2, voters=frozenset({A}), learners=frozenset(),
                    data=b"s" * (MAX_RAFT_MESSAGE_BYTES + 1))  # fmt: skip
    message = InstallSnapshot(to=B, term=2, leader=A, snapshot=snap)
    data = encode_raft(message)
    assert len(data) > MAX_RAFT_MESSAGE_BYTES
    assert decode_raft(data) == message


def test_the_error_is_a_wire_decode_error() -> None:
    # One handler in the driver drops bad envelopes and bad Raft payloads alike.
    assert issubclass(RaftDecodeError, DecodeError)


# --- rejections, one per reason ---------------------------------------------


def vote_array() -> list[Any]:
    return [1, A, 3, B, 10, 2, False, False]


def append_array() -> list[Any]:
    return [3, A, 3, B, 10, 2, [[3, 1, b"x"], [3, 3, b""]], 9]


def snapshot_array() -> list[Any]:
    return [5, A, 3, B, [4, 2, [A], [B, C], b"state"]]


def test_the_fixture_arrays_are_valid() -> None:
    for value in (vote_array(), append_array(), snapshot_array()):
        decode_raft(cbor2.dumps(value))
    assert decode_raft(cbor2.dumps(append_array())).entries[1].index == 12  # type: ignore[union-attr]


def test_oversized_is_refused_before_parsing() -> None:
    big = cbor2.dumps([1, A, 3, B, 10, 2, False, False, b"x" * MAX_RAFT_MESSAGE_BYTES])
    assert reason_of(big) == "oversized"
    # Only an InstallSnapshot head may go past the ordinary cap, and not past its own.
    assert reason_of(b"\x85\x05" + b"\x00" * MAX_INSTALL_SNAPSHOT_BYTES) == "oversized"


def test_an_oversized_snapshot_is_refused_on_both_sides() -> None:
    snap = Snapshot(index=5, term=2, voters=frozenset({A}), learners=frozenset(),
                    data=b"s" * MAX_INSTALL_SNAPSHOT_BYTES)  # fmt: skip
    with pytest.raises(RaftEncodeError) as info:
        encode_raft(InstallSnapshot(to=B, term=2, leader=A, snapshot=snap))
    assert info.value.reason == "oversized"
    value = snapshot_array()
    value[4][4] = b"s" * MAX_INSTALL_SNAPSHOT_BYTES
    assert reason_of(cbor2.dumps(value)) == "oversized"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "malformed_cbor"),
        (b"\x88\x01", "malformed_cbor"),  # truncated array
        (cbor2.dumps(vote_array()) + b"\x00", "trailing_bytes"),
        (cbor2.dumps(cbor2.CBORTag(42, vote_array())), "forbidden_tag"),
        (cbor2.dumps([1, A, 3.0, B, 10, 2, False, False]), "forbidden_item"),
        (b"\x81" * 20 + b"\x00", "too_deep"),
    ],
)
def test_strict_cbor_reasons_pass_through(data: bytes, reason: str) -> None:
    assert reason_of(data) == reason


def test_not_bytes_is_malformed() -> None:
    assert reason_of("text") == "malformed_cbor"


@pytest.mark.parametrize("value", [[0, A], [7, A], [255], [2**40, A, 1]])
def test_unknown_type(value: list[Any]) -> None:
    assert reason_of(cbor2.dumps(value)) == "unknown_type"


def _mutated(base: list[Any], path: tuple[int, ...], new: Any) -> bytes:
    value = base
    for step in path[:-1]:
        value = value[step]
    value[path[-1]] = new
    return cbor2.dumps(base)


@pytest.mark.parametrize(
    ("base", "path", "new", "why"),
    [
        (vote_array, (1,), A[:31], "node id too short"),
        (vote_array, (1,), A + b"\x00", "node id too long"),
        (vote_array, (1,), A.hex(), "node id as text"),
        (vote_array, (2,), -1, "negative term"),
        (vote_array, (2,), 2**63, "term past 2**63"),
        (vote_array, (2,), True, "bool as an integer"),
        (vote_array, (6,), 0, "integer as a bool"),
        (vote_array, (7,), None, "null as a bool"),
        (append_array, (6,), [[3, 9, b""]], "unknown entry kind"),
        (append_array, (6,), [[3, True, b""]], "bool as an entry kind"),
        (append_array, (6,), [[3, 1]], "entry of two fields"),
        (append_array, (6,), [[3, 1, "text"]], "entry data as text"),
        (append_array, (6,), [[3, 1, b"x" * (MAX_ENTRY_DATA_BYTES + 1)]], "entry data too big"),
        (append_array, (6,), [[3, 1, b""]] * (MAX_ENTRIES_PER_MESSAGE + 1), "too many entries"),
        (append_array, (6,), {}, "entries as a map"),
        (append_array, (4,), 2**63 - 2, "entry index past 2**63"),
        (snapshot_array, (4, 2), [B, A], "voters unsorted"),
        (snapshot_array, (4, 3), [B, B], "duplicate learner"),
        (snapshot_array, (4, 3), [A], "voter also a learner"),
        (snapshot_array, (4,), [4, 2, [A], [B]], "snapshot of four fields"),
        (snapshot_array, (4, 2), [A[:4]], "short voter id"),
        (snapshot_array, (4, 3), [C] * (MAX_CONFIG_MEMBERS + 1), "too many learners"),
    ],
)
def test_bad_field(base: Any, path: tuple[int, ...], new: Any, why: str) -> None:
    assert reason_of(_mutated(base(), path, new)) == "bad_field", why


@pytest.mark.parametrize(
    "value",
    [
        {1: A},  # a map, not an array
        [],
        ["1", A],  # type id as text
        vote_array()[:-1],  # a field missing
        [*vote_array(), False],  # a field too many
        [6, A, 3, B, 0],
    ],
)
def test_wrong_shapes_are_bad_fields(value: Any) -> None:
    assert reason_of(cbor2.dumps(value)) == "bad_field"


@pytest.mark.parametrize(
    "message",
    [
        TimeoutNow(to=A[:5], term=1, leader=B),
        VoteResponse(to=A, term=-1, voter=B, granted=True),
        RequestVote(to=A, term=1, candidate=B, last_index=0, last_term=0, pre_vote=1),  # type: ignore[arg-type]
        AppendEntries(  # index 7 does not follow prev_index 5
            to=A,
            term=1,
            leader=B,
            prev_index=5,
            prev_term=1,
            commit=0,
            entries=(Entry(1, 7, EntryKind.NOOP),),
        ),
        AppendEntries(  # entry kind 9 does not exist
            to=A,
            term=1,
            leader=B,
            prev_index=0,
            prev_term=0,
            commit=0,
            entries=(Entry(1, 1, 9),),  # type: ignore[arg-type]
        ),
        InstallSnapshot(  # A is both voter and learner
            to=A,
            term=1,
            leader=B,
            snapshot=Snapshot(1, 1, frozenset({A}), frozenset({A}), b""),
        ),
    ],
)
def test_encode_refuses_what_peers_would_drop(message: Any) -> None:
    with pytest.raises(RaftEncodeError) as info:
        encode_raft(message)
    assert info.value.reason == "bad_field"


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(RaftEncodeError) as info:
        encode_raft(object())  # type: ignore[arg-type]
    assert info.value.reason == "unknown_type"


# --- fuzzing ----------------------------------------------------------------


def _decodes_or_refuses(data: bytes) -> None:
    try:
        message = decode_raft(data)
    except RaftDecodeError as exc:
        assert exc.reason in RAFT_DROP_REASONS
        assert not exc.detail.startswith(UNEXPECTED), exc.detail  # every refusal is deliberate
        return
    assert decode_raft(encode_raft(message)) == message


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_only_raise_raft_decode_error(data: bytes) -> None:
    _decodes_or_refuses(data)


mutations = st.lists(
    st.tuples(st.sampled_from(["flip", "cut", "insert", "delete"]), st.integers(0, 10_000),
              st.integers(0, 255)),
    min_size=1, max_size=4,
)  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages, mutations)
def test_mutated_messages_only_raise_raft_decode_error(
    message: Message, edits: list[tuple[str, int, int]]
) -> None:
    data = bytearray(encode_raft(message))
    for op, where, byte in edits:
        pos = where % (len(data) + 1)
        if op == "flip" and pos < len(data):
            data[pos] ^= byte or 1
        elif op == "cut":
            del data[pos:]
        elif op == "insert":
            data.insert(pos, byte)
        elif op == "delete" and pos < len(data):
            del data[pos]
    _decodes_or_refuses(bytes(data))


any_cbor = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.binary(max_size=40)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=8),
    max_leaves=30,
)  # fmt: skip


@FAST
@given(st.integers(0, 8), st.lists(any_cbor, max_size=9))
def test_well_formed_cbor_of_any_shape_only_raises_raft_decode_error(
    type_id: int, fields: list[Any]
) -> None:
    _decodes_or_refuses(cbor2.dumps([type_id, *fields]))
