"""Bytes <-> Raft messages, for the payload of a mesh control-plane envelope.

Raft messages come from peers, so decoding is as strict as the membership
wire: the same strict CBOR (`mesh.wire.decode_strict_cbor`), a size cap
checked before parsing, then every field checked. Every refusal is a
`RaftDecodeError` whose `reason` is one of `RAFT_DROP_REASONS`, so the driver
counts drops and never crashes on input; encoding applies the same rules
(`RaftEncodeError`), so we never send what an honest peer would drop. A
message is a CBOR array ``[type_id, fields...]`` with append-only type ids;
the layout table and field rules are in docs/design/raft.md ("On the wire").
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final, NoReturn

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
from mesh.fields import FieldError, array, boolean, bounded_bytes, fixed_bytes, sequence, uint
from mesh.identity import NODE_ID_BYTES
from mesh.wire import (
    MAX_CONTROL_MESSAGE_BYTES,
    MAX_UINT,
    REASON_BAD_FIELD,
    REASON_FORBIDDEN_ITEM,
    REASON_FORBIDDEN_TAG,
    REASON_MALFORMED_CBOR,
    REASON_OVERSIZED,
    REASON_TOO_DEEP,
    REASON_TRAILING_BYTES,
    REASON_UNKNOWN_TYPE,
    UNEXPECTED,
    DecodeError,
    EncodeError,
    decode_strict_cbor,
    encode_strict_cbor,
)

__all__ = [
    "MAX_CONFIG_MEMBERS",
    "MAX_ENTRIES_PER_MESSAGE",
    "MAX_ENTRY_DATA_BYTES",
    "MAX_INSTALL_SNAPSHOT_BYTES",
    "MAX_RAFT_MESSAGE_BYTES",
    "RAFT_DROP_REASONS",
    "RAFT_TYPE_IDS",
    "RaftDecodeError",
    "RaftEncodeError",
    "decode_raft",
    "encode_raft",
]

# --- limits -----------------------------------------------------------------

MAX_ENTRIES_PER_MESSAGE: Final = 64
"""Entries in one AppendEntries: the Raft core's default batch
(`RaftConfig.max_entries_per_append`). A larger configured batch would be
refused on encode, so a test pins the two together."""

MAX_CONFIG_MEMBERS: Final = 16_384
"""Voters + learners in a snapshot's configuration. Every member joins as a
learner (consensus.voters), so this is a swarm size, not a voter count; it
matches the membership wire's push-pull cap (`MAX_PUSHPULL_ENTRIES`)."""

MAX_ENTRY_DATA_BYTES: Final = 64 * 1024
"""One entry's data. Ledger commands are at most `MAX_COMMAND_BYTES` (4 KiB),
but a CONFIG entry lists every learner: ~34 bytes per member, so 64 KiB holds
a ~1,900-member configuration. Bigger swarms need a larger cap (see
MAX_CONFIG_MEMBERS) together with a larger message cap."""

_CBOR_SLACK_PER_ENTRY: Final = 32
"""Array head, term (up to 9 bytes), kind and the data's length prefix."""

MAX_RAFT_MESSAGE_BYTES: Final = (
    2 * (MAX_ENTRIES_PER_MESSAGE * (MAX_COMMAND_BYTES + _CBOR_SLACK_PER_ENTRY))
    + 2 * MAX_ENTRY_DATA_BYTES
)
"""Every message but InstallSnapshot (644 KiB). A full AppendEntries batch is
64 ledger commands of <= 4 KiB (~258 KiB with framing); twice that, plus room
for two maximal CONFIG entries, absorbs growth in command size without
letting one peer make us parse megabytes at heartbeat rate."""

_ENVELOPE_HEADROOM_BYTES: Final = 64 * 1024
"""Room for the mesh envelope around the payload (version, type, sender,
address, body framing) inside `MAX_CONTROL_MESSAGE_BYTES`."""

MAX_INSTALL_SNAPSHOT_BYTES: Final = MAX_CONTROL_MESSAGE_BYTES - _ENVELOPE_HEADROOM_BYTES
"""InstallSnapshot carries the whole state machine, so it gets its own, higher
cap: as large as fits in one control-plane frame (4 MiB less the envelope).
(An estimate, not measured: ~1 MiB for 1,000 nodes' assignments.) Larger snapshots
(the ledger allows up to 256 MiB) need chunked transfer, not a bigger frame."""

# --- type ids (append-only, see the module table) ---------------------------

_REQUEST_VOTE: Final = 1
_VOTE_RESPONSE: Final = 2
_APPEND_ENTRIES: Final = 3
_APPEND_RESPONSE: Final = 4
_INSTALL_SNAPSHOT: Final = 5
_TIMEOUT_NOW: Final = 6

RAFT_TYPE_IDS: Final[Mapping[type, int]] = MappingProxyType(
    {
        RequestVote: _REQUEST_VOTE,
        VoteResponse: _VOTE_RESPONSE,
        AppendEntries: _APPEND_ENTRIES,
        AppendResponse: _APPEND_RESPONSE,
        InstallSnapshot: _INSTALL_SNAPSHOT,
        TimeoutNow: _TIMEOUT_NOW,
    }
)

# The array head of an InstallSnapshot ([5, to, term, leader, snapshot]: a
# 5-item array, then the type id): only a payload starting so may exceed
# MAX_RAFT_MESSAGE_BYTES, checked before any parsing.
_INSTALL_SNAPSHOT_PREFIX: Final = bytes([0x85, _INSTALL_SNAPSHOT])

# --- errors -----------------------------------------------------------------

RAFT_DROP_REASONS: Final = frozenset(
    {
        REASON_OVERSIZED,
        REASON_MALFORMED_CBOR,
        REASON_TOO_DEEP,
        REASON_FORBIDDEN_TAG,
        REASON_FORBIDDEN_ITEM,
        REASON_TRAILING_BYTES,
        REASON_UNKNOWN_TYPE,
        REASON_BAD_FIELD,
    }
)
"""The wire's reasons, minus those for envelopes and tensors: a driver that
already counts `mesh.wire` drops counts these under the same names."""


class RaftDecodeError(DecodeError):
    """A Raft payload we refuse; `reason` is one of `RAFT_DROP_REASONS`.

    A `mesh.wire.DecodeError`, so a driver that drops bad envelopes drops bad
    Raft payloads with the same handler.
    """


class RaftEncodeError(EncodeError):
    """We were asked to send a Raft message peers would refuse (a caller bug)."""


class _Invalid(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


def _fail(detail: str, reason: str = REASON_BAD_FIELD) -> NoReturn:
    raise _Invalid(reason, detail)


# --- field checks (shared by encode and decode) -----------------------------
# The rules are mesh.fields'; a FieldError becomes REASON_BAD_FIELD at the
# public boundary (encode_raft, decode_raft).


def _node_id(value: object, what: str) -> bytes:
    return fixed_bytes(value, what, size=NODE_ID_BYTES)


def _kind(value: object) -> EntryKind:
    # type() rather than isinstance: a bool is an int, and True must not pass as 1.
    if type(value) is not int and not isinstance(value, EntryKind):
        _fail("entry kind must be an integer")
    try:
        return EntryKind(value)
    except ValueError:
        _fail("unknown entry kind")


def _members(value: object, what: str) -> frozenset[bytes]:
    """Decode a sorted, duplicate-free id array (sorted so encoding is canonical)."""
    ids = [_node_id(member, what) for member in sequence(value, what, max_items=MAX_CONFIG_MEMBERS)]
    if any(a >= b for a, b in itertools.pairwise(ids)):
        _fail(f"{what} must be sorted and distinct")
    return frozenset(ids)


def _members_value(value: object, what: str) -> list[bytes]:
    if not isinstance(value, frozenset | set) or len(value) > MAX_CONFIG_MEMBERS:
        _fail(f"{what} must be a set of <= {MAX_CONFIG_MEMBERS} node ids")
    return sorted(_node_id(member, what) for member in value)


# --- encode -----------------------------------------------------------------


def _entries_value(entries: object, prev_index: int) -> list[list[Any]]:
    out = []
    for position, entry in enumerate(
        sequence(entries, "entries", max_items=MAX_ENTRIES_PER_MESSAGE)
    ):
        if not isinstance(entry, Entry):
            _fail("entries must be Entry values")
        if uint(entry.index, "entry index") != prev_index + 1 + position:
            _fail("entries must be consecutive after prev_index")
        out.append(
            [
                uint(entry.term, "entry term"),
                int(_kind(entry.kind)),
                bounded_bytes(entry.data, "entry data", max_bytes=MAX_ENTRY_DATA_BYTES),
            ]
        )
    return out


def _snapshot_value(snapshot: object) -> list[Any]:
    if not isinstance(snapshot, Snapshot):
        _fail("snapshot must be a Snapshot")
    voters = _members_value(snapshot.voters, "voters")
    learners = _members_value(snapshot.learners, "learners")
    if len(voters) + len(learners) > MAX_CONFIG_MEMBERS:
        _fail(f"configuration must have <= {MAX_CONFIG_MEMBERS} members")
    if set(voters) & set(learners):
        _fail("voters and learners must be disjoint")
    return [
        uint(snapshot.index, "snapshot index"),
        uint(snapshot.term, "snapshot term"),
        voters,
        learners,
        bounded_bytes(snapshot.data, "snapshot data", max_bytes=MAX_INSTALL_SNAPSHOT_BYTES),
    ]


def _message_value(m: object) -> list[Any]:
    match m:
        case RequestVote():
            return [_REQUEST_VOTE, _node_id(m.to, "to"), uint(m.term, "term"),
                    _node_id(m.candidate, "candidate"), uint(m.last_index, "last_index"),
                    uint(m.last_term, "last_term"), boolean(m.pre_vote, "pre_vote"),
                    boolean(m.transfer, "transfer")]  # fmt: skip
        case VoteResponse():
            return [_VOTE_RESPONSE, _node_id(m.to, "to"), uint(m.term, "term"),
                    _node_id(m.voter, "voter"), boolean(m.granted, "granted"),
                    boolean(m.pre_vote, "pre_vote")]  # fmt: skip
        case AppendEntries():
            prev_index = uint(m.prev_index, "prev_index")
            return [_APPEND_ENTRIES, _node_id(m.to, "to"), uint(m.term, "term"),
                    _node_id(m.leader, "leader"), prev_index, uint(m.prev_term, "prev_term"),
                    _entries_value(m.entries, prev_index), uint(m.commit, "commit")]  # fmt: skip
        case AppendResponse():
            return [_APPEND_RESPONSE, _node_id(m.to, "to"), uint(m.term, "term"),
                    _node_id(m.follower, "follower"), boolean(m.success, "success"),
                    uint(m.match_index, "match_index"),
                    uint(m.reject_hint, "reject_hint")]  # fmt: skip
        case InstallSnapshot():
            return [_INSTALL_SNAPSHOT, _node_id(m.to, "to"), uint(m.term, "term"),
                    _node_id(m.leader, "leader"), _snapshot_value(m.snapshot)]  # fmt: skip
        case TimeoutNow():
            return [_TIMEOUT_NOW, _node_id(m.to, "to"), uint(m.term, "term"),
                    _node_id(m.leader, "leader")]  # fmt: skip
    _fail(f"not a Raft message: {type(m).__name__}", REASON_UNKNOWN_TYPE)


def _cap_for(message: object) -> int:
    return (
        MAX_INSTALL_SNAPSHOT_BYTES
        if isinstance(message, InstallSnapshot)
        else MAX_RAFT_MESSAGE_BYTES
    )


def encode_raft(message: Message) -> bytes:
    """The payload bytes for `message`; `RaftEncodeError` if a peer would refuse them."""
    try:
        value = _message_value(message)
    except _Invalid as exc:
        raise RaftEncodeError(exc.reason, exc.detail) from None
    except FieldError as exc:
        raise RaftEncodeError(REASON_BAD_FIELD, exc.detail) from None
    try:
        return encode_strict_cbor(value, max_bytes=_cap_for(message))
    except EncodeError as exc:
        raise RaftEncodeError(exc.reason, exc.detail) from None


# --- decode -----------------------------------------------------------------


def _entries(value: object, prev_index: int) -> tuple[Entry, ...]:
    value = sequence(value, "entries", max_items=MAX_ENTRIES_PER_MESSAGE)
    if prev_index + len(value) > MAX_UINT:
        _fail("entry index out of range")
    entries = []
    for position, item in enumerate(value):
        term, kind, data = array(item, "entry", size=3)
        entries.append(
            Entry(
                term=uint(term, "entry term"),
                index=prev_index + 1 + position,
                kind=_kind(kind),
                data=bounded_bytes(data, "entry data", max_bytes=MAX_ENTRY_DATA_BYTES),
            )
        )
    return tuple(entries)


def _snapshot(value: object) -> Snapshot:
    index, term, voters, learners, data = array(value, "snapshot", size=5)
    voter_set = _members(voters, "voters")
    learner_set = _members(learners, "learners")
    if len(voter_set) + len(learner_set) > MAX_CONFIG_MEMBERS:
        _fail(f"configuration must have <= {MAX_CONFIG_MEMBERS} members")
    if voter_set & learner_set:
        _fail("voters and learners must be disjoint")
    return Snapshot(
        index=uint(index, "snapshot index"),
        term=uint(term, "snapshot term"),
        voters=voter_set,
        learners=learner_set,
        data=bounded_bytes(data, "snapshot data", max_bytes=MAX_INSTALL_SNAPSHOT_BYTES),
    )


def _request_vote(f: list[Any]) -> RequestVote:
    to, term, candidate, last_index, last_term, pre_vote, transfer = f
    return RequestVote(to=_node_id(to, "to"), term=uint(term, "term"),
                       candidate=_node_id(candidate, "candidate"),
                       last_index=uint(last_index, "last_index"),
                       last_term=uint(last_term, "last_term"),
                       pre_vote=boolean(pre_vote, "pre_vote"),
                       transfer=boolean(transfer, "transfer"))  # fmt: skip


def _vote_response(f: list[Any]) -> VoteResponse:
    to, term, voter, granted, pre_vote = f
    return VoteResponse(to=_node_id(to, "to"), term=uint(term, "term"),
                        voter=_node_id(voter, "voter"), granted=boolean(granted, "granted"),
                        pre_vote=boolean(pre_vote, "pre_vote"))  # fmt: skip


def _append_entries(f: list[Any]) -> AppendEntries:
    to, term, leader, prev_index, prev_term, entries, commit = f
    prev = uint(prev_index, "prev_index")
    return AppendEntries(to=_node_id(to, "to"), term=uint(term, "term"),
                         leader=_node_id(leader, "leader"), prev_index=prev,
                         prev_term=uint(prev_term, "prev_term"),
                         entries=_entries(entries, prev),
                         commit=uint(commit, "commit"))  # fmt: skip


def _append_response(f: list[Any]) -> AppendResponse:
    to, term, follower, success, match_index, reject_hint = f
    return AppendResponse(to=_node_id(to, "to"), term=uint(term, "term"),
                          follower=_node_id(follower, "follower"),
                          success=boolean(success, "success"),
                          match_index=uint(match_index, "match_index"),
                          reject_hint=uint(reject_hint, "reject_hint"))  # fmt: skip


def _install_snapshot(f: list[Any]) -> InstallSnapshot:
    to, term, leader, snapshot = f
    return InstallSnapshot(to=_node_id(to, "to"), term=uint(term, "term"),
                           leader=_node_id(leader, "leader"),
                           snapshot=_snapshot(snapshot))  # fmt: skip


def _timeout_now(f: list[Any]) -> TimeoutNow:
    to, term, leader = f
    return TimeoutNow(to=_node_id(to, "to"), term=uint(term, "term"),
                      leader=_node_id(leader, "leader"))  # fmt: skip


# type id -> (field count after the id, decoder)
_DECODERS: Final[dict[int, tuple[int, Callable[[list[Any]], Message]]]] = {
    _REQUEST_VOTE: (7, _request_vote),
    _VOTE_RESPONSE: (5, _vote_response),
    _APPEND_ENTRIES: (7, _append_entries),
    _APPEND_RESPONSE: (6, _append_response),
    _INSTALL_SNAPSHOT: (4, _install_snapshot),
    _TIMEOUT_NOW: (3, _timeout_now),
}


def _decode(data: object) -> Message:
    if not isinstance(data, bytes | bytearray | memoryview):
        _fail("not a bytes-like object", REASON_MALFORMED_CBOR)
    size = memoryview(data).nbytes
    if size > MAX_INSTALL_SNAPSHOT_BYTES or (
        size > MAX_RAFT_MESSAGE_BYTES and bytes(data[:2]) != _INSTALL_SNAPSHOT_PREFIX
    ):
        _fail("payload over the size cap", REASON_OVERSIZED)
    try:
        value = decode_strict_cbor(bytes(data), max_bytes=MAX_INSTALL_SNAPSHOT_BYTES)
    except DecodeError as exc:
        raise _Invalid(exc.reason, exc.detail) from None
    if type(value) is not list or not value:
        _fail("a Raft message is a non-empty array")
    type_id = value[0]
    if type(type_id) is not int:
        _fail("type id must be an integer")
    if type_id not in _DECODERS:
        _fail("unknown Raft message type", REASON_UNKNOWN_TYPE)
    count, decoder = _DECODERS[type_id]
    fields = value[1:]
    if len(fields) != count:
        _fail(f"message type {type_id} has {count} fields")
    return decoder(fields)


def decode_raft(data: bytes) -> Message:
    """The Raft message in `data`. Raises only `RaftDecodeError`, whatever the input."""
    try:
        return _decode(data)
    except _Invalid as exc:
        raise RaftDecodeError(exc.reason, exc.detail) from None
    except FieldError as exc:
        raise RaftDecodeError(REASON_BAD_FIELD, exc.detail) from None
    except Exception as exc:  # a bug, not input: still never escape as anything else
        raise RaftDecodeError(REASON_BAD_FIELD, f"{UNEXPECTED} {type(exc).__name__}") from None


def _check_config_cap() -> None:
    # Import-time guard: the core's default batch must fit in one message.
    if RaftConfig().max_entries_per_append > MAX_ENTRIES_PER_MESSAGE:  # pragma: no cover
        raise RuntimeError("RaftConfig batches more entries than the codec accepts")


_check_config_cap()
