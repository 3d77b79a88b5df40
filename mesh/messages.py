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

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

FINGERPRINT_BITS = 63
"""Fingerprints (see `Signed.fingerprint`) are 63-bit, so that one fits the
wire's unsigned integer (below 2**63) and an XOR of many still does."""

_FINGERPRINT_MASK = (1 << FINGERPRINT_BITS) - 1
_UNSET = -1
"""A fingerprint not computed yet: most updates are only ever checked and
relayed, never stored, so they never need one."""

Verifier = Callable[[bytes, bytes, bytes], bool]
"""`mesh.identity.Verifier`: (signer id, signed bytes, signature) -> holds."""


# --- gossiped updates -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Signed:
    """What the four gossiped updates share: two facts about an update's
    immutable fields, each worked out at most once per object and kept on
    it (the simulator hands one update object to thousands of cores, each
    of which would otherwise hash and verify it again)."""

    _fingerprint: int = field(default=_UNSET, init=False, repr=False, compare=False)
    _verified_by: object = field(default=None, init=False, repr=False, compare=False)

    def fingerprint(self) -> int:
        """A 63-bit hash of what this update claims, for delta syncs
        (`mesh.sync`): equal claims hash equal whoever made them, and
        different claims, or claims about different nodes, differ with
        overwhelming probability."""
        if self._fingerprint == _UNSET:
            digest = hashlib.blake2b(self._claim(), digest_size=8).digest()
            object.__setattr__(self, "_fingerprint", int.from_bytes(digest) & _FINGERPRINT_MASK)
        return self._fingerprint

    def verified(self, verifier: Verifier) -> bool:
        """Whether the signature holds under `verifier`: by `signer_of`,
        over `signing_bytes`. A success is remembered for that verifier: it
        is a function of bytes that never change, so asking again could only
        give the same answer."""
        if self._verified_by is verifier:
            return True
        update: Update = self  # type: ignore[assignment]  # Signed is only ever one of these
        if not verifier(signer_of(update), signing_bytes(update), update.signature):
            return False
        object.__setattr__(self, "_verified_by", verifier)
        return True

    def _claim(self) -> bytes:
        """The bytes `fingerprint` hashes; each of the four updates defines
        its own (Signed itself is never built)."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Alive(Signed):
    """`node` is alive at `incarnation`, reachable at `addr`. Signed by `node`.

    Only the subject can raise its own incarnation, so nobody can refute an
    accusation on another node's behalf or keep a dead node looking alive.
    """

    node: bytes
    incarnation: int
    addr: str
    signature: bytes

    def _claim(self) -> bytes:
        return alive_signing_bytes(self.node, self.incarnation, self.addr)


@dataclass(frozen=True, slots=True)
class Suspect(Signed):
    """`accuser` suspects `node` at `incarnation`. Signed by `accuser`."""

    node: bytes
    incarnation: int
    accuser: bytes
    signature: bytes

    def _claim(self) -> bytes:
        """ "`node` is suspect at `incarnation`", whoever the accuser: two
        members that hold the same suspicion from different accusers hold
        the same state."""
        return _SUSPECT_CLAIM_TAG + self.node + self.incarnation.to_bytes(8, "big")


@dataclass(frozen=True, slots=True)
class Dead(Signed):
    """`accuser` declares `node` dead at `incarnation`. Signed by `accuser`.

    When `accuser == node` this is a graceful leave, and members mark the
    node `left` rather than `dead`.
    """

    node: bytes
    incarnation: int
    accuser: bytes
    signature: bytes

    def _claim(self) -> bytes:
        """ "`node` is dead (or, self-signed, has left) at `incarnation`",
        whoever the accuser."""
        tag = _LEFT_CLAIM_TAG if self.accuser == self.node else _DEAD_CLAIM_TAG
        return tag + self.node + self.incarnation.to_bytes(8, "big")


@dataclass(frozen=True, slots=True)
class Record(Signed):
    """A node record: `body` is the CBOR-encoded record (see `mesh.records`).

    Signed by its subject `node`; a higher `seq` replaces a lower one.
    """

    node: bytes
    seq: int
    body: bytes
    signature: bytes

    def _claim(self) -> bytes:
        return record_signing_bytes(self.node, self.seq, self.body)


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

    A joiner's first exchange with its seed and a stranger's introduction;
    members that know each other sync by digest instead (`SyncDigest`,
    `SyncDelta`). `join` marks the first exchange of a joining node; `reply`
    marks the answer, which must not itself be answered.
    """

    join: bool
    reply: bool
    states: tuple[Alive | Suspect | Dead, ...]
    records: tuple[Record, ...]


@dataclass(frozen=True, slots=True)
class SyncDigest:
    """Delta sync, step one: the sender's member table as 2**k bucket
    fingerprints (`mesh.sync`), k <= `mesh.sync.MAX_BUCKET_BITS`. A member
    is in the bucket its id's first k bits name; a bucket's fingerprint is
    the XOR of its members' (their Alive, accusation and record). `states`
    and `records` are the sender's state, as a full state carries it, for
    the members it changed most recently (`mesh.sync.MAX_RECENT`)."""

    fingerprints: tuple[int, ...]
    states: tuple[Alive | Suspect | Dead, ...] = ()
    records: tuple[Record, ...] = ()


@dataclass(frozen=True, slots=True)
class SyncDelta:
    """Delta sync, steps two and three (`mesh.sync`).

    Step two (`reply` False) answers a digest: `buckets` are those, at
    `bits` bits, whose fingerprints differ (ascending), and `states` and
    `records` are all the sender holds for its members in them, as a full
    state carries them. Step three (`reply` True, no buckets) sends back the
    sender's state for the members the other side held differently or not
    at all, and is never answered."""

    reply: bool
    bits: int
    buckets: tuple[int, ...]
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


@dataclass(frozen=True, slots=True)
class DialRequest:
    """ "Dial me back" (`mesh.reachability`): the receiver opens a fresh
    connection to the control address in the sender's own signed record
    (never one this message could name: it names none) and sends `DialBack`
    with this `nonce` over it."""

    nonce: bytes


@dataclass(frozen=True, slots=True)
class DialBack:
    """The answer to a `DialRequest`, sent over a fresh connection to the
    requester's advertised address: that it arrived proves peers can dial
    the requester there. `nonce` is the request's, so an old or unasked
    dial-back counts for nothing."""

    nonce: bytes


Message = (
    Ping
    | PingReq
    | Ack
    | Nack
    | Gossip
    | PushPull
    | SyncDigest
    | SyncDelta
    | Consensus
    | DialRequest
    | DialBack
)


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
# Fingerprint claims (never signed, so they share no layout with the above).
_SUSPECT_CLAIM_TAG = b"shardmesh/claim/suspect/1\x00"
_DEAD_CLAIM_TAG = b"shardmesh/claim/dead/1\x00"
_LEFT_CLAIM_TAG = b"shardmesh/claim/left/1\x00"


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
