"""Membership messages and gossiped updates, as plain immutable values.

The membership core consumes and produces these objects; `mesh.wire` turns
them into CBOR envelopes and back. Keeping them free of any encoding lets the
simulator pass them between 10,000 simulated nodes without paying for CBOR,
while the real node and the benchmark's byte counts go through the real wire.

Signed updates carry a signature over a fixed binary layout (domain tag,
fields in order, integers big-endian) built by the `*_signing_bytes`
functions. The layout is not CBOR, so verifying never depends on re-encoding
a decoded map the same way twice.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- gossiped updates -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Alive:
    """`node` is alive at `incarnation`, reachable at `addr`. Signed by `node`.

    Only the subject can raise its own incarnation, so nobody can refute an
    accusation on another node's behalf or keep a dead node looking alive.
    """

    node: bytes
    incarnation: int
    addr: str
    signature: bytes


@dataclass(frozen=True, slots=True)
class Suspect:
    """`accuser` suspects `node` at `incarnation`. Signed by `accuser`."""

    node: bytes
    incarnation: int
    accuser: bytes
    signature: bytes


@dataclass(frozen=True, slots=True)
class Dead:
    """`accuser` declares `node` dead at `incarnation`. Signed by `accuser`.

    When `accuser == node` this is a graceful leave, and members mark the
    node `left` rather than `dead`.
    """

    node: bytes
    incarnation: int
    accuser: bytes
    signature: bytes


@dataclass(frozen=True, slots=True)
class Record:
    """A node record: `body` is the CBOR-encoded record (see `mesh.records`).

    Signed by its subject `node`; a higher `seq` replaces a lower one.
    """

    node: bytes
    seq: int
    body: bytes
    signature: bytes


Update = Alive | Suspect | Dead | Record

# --- messages ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ping:
    """A direct probe. `target` names the node we mean to reach: a different
    node now listening at that address must not answer for it."""

    seq: int
    target: bytes
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class PingReq:
    """Ask the receiver to probe `target` at `target_addr` on our behalf."""

    seq: int
    target: bytes
    target_addr: str
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class Ack:
    seq: int
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class Nack:
    """An indirect prober's "I asked, the target did not answer in time".

    Lifeguard: a nack proves the path to the helper works, so missing acks
    are not our own fault and our local-health score should not suffer.
    """

    seq: int


@dataclass(frozen=True, slots=True)
class Gossip:
    updates: tuple[Update, ...]


@dataclass(frozen=True, slots=True)
class PushPull:
    """Full-state exchange: every member's latest state update plus records.

    `join` marks the first exchange of a joining node; `reply` marks the
    answer, which must not itself be answered.
    """

    join: bool
    reply: bool
    states: tuple[Alive | Suspect | Dead, ...]
    records: tuple[Record, ...]


@dataclass(frozen=True, slots=True)
class Consensus:
    """A consensus-layer message riding the control plane, signed by its sender.

    The mesh does not look inside `payload` (`consensus.codec` bytes); it
    only carries them. Membership updates sign their *subject's* claims, but
    a Raft message is a claim by its sender (a vote, an acknowledgement), so
    the whole payload is signed by the envelope's sender: a forged vote
    would otherwise be one unauthenticated datagram away.
    """

    payload: bytes
    signature: bytes


Message = Ping | PingReq | Ack | Nack | Gossip | PushPull | Consensus


@dataclass(frozen=True, slots=True)
class Envelope:
    """What travels: who sent it, where to answer, and the message.

    `sender` and `addr` are claims, not proofs; every update that changes
    state carries its own signature.
    """

    sender: bytes
    addr: str
    message: Message


# --- signing layouts --------------------------------------------------------

_ALIVE_TAG = b"shardmesh/alive/1\x00"
_SUSPECT_TAG = b"shardmesh/suspect/1\x00"
_DEAD_TAG = b"shardmesh/dead/1\x00"
_RECORD_TAG = b"shardmesh/record/1\x00"
_CONSENSUS_TAG = b"shardmesh/consensus/1\x00"


def alive_signing_bytes(node: bytes, incarnation: int, addr: str) -> bytes:
    return _ALIVE_TAG + node + incarnation.to_bytes(8, "big") + addr.encode()


def suspect_signing_bytes(node: bytes, incarnation: int, accuser: bytes) -> bytes:
    return _SUSPECT_TAG + node + incarnation.to_bytes(8, "big") + accuser


def dead_signing_bytes(node: bytes, incarnation: int, accuser: bytes) -> bytes:
    return _DEAD_TAG + node + incarnation.to_bytes(8, "big") + accuser


def record_signing_bytes(node: bytes, seq: int, body: bytes) -> bytes:
    return _RECORD_TAG + node + seq.to_bytes(8, "big") + body


def consensus_signing_bytes(sender: bytes, payload: bytes) -> bytes:
    """What a `Consensus` message's sender signs. The sender is included so
    a signature can never be re-attributed, whatever the verifier keys on."""
    return _CONSENSUS_TAG + sender + payload


def signing_bytes(update: Update) -> bytes:
    """The exact bytes whose signature `update` carries."""
    match update:
        case Alive(node, incarnation, addr, _):
            return alive_signing_bytes(node, incarnation, addr)
        case Suspect(node, incarnation, accuser, _):
            return suspect_signing_bytes(node, incarnation, accuser)
        case Dead(node, incarnation, accuser, _):
            return dead_signing_bytes(node, incarnation, accuser)
        case Record(node, seq, body, _):
            return record_signing_bytes(node, seq, body)
    raise TypeError(f"not an update: {update!r}")


def signer_of(update: Update) -> bytes:
    """The node whose key must have signed `update`."""
    if isinstance(update, Suspect | Dead):
        return update.accuser
    return update.node
