"""Blame: a hop's signed account of what it sent, and the proof that points at one liar.

A hop's commitment (`runtime.inference.commitment`) says what it computed
from what it received; it says nothing about what went on the wire. A hop
that commits its honest output and forwards noise (a *transit liar*) leaves
a commitment that agrees with every recomputation, and the next hop, which
computed honestly on the noise, looks guilty. So every hop also signs a
`Receipt` for each step it passes on: the digest of its commitment and the
digest of exactly what it sent (the activations' rows, or the token it
emitted). The receiver (the next hop, or the entry for a token) checks the
receipt against what arrived before it uses it:

* what arrived agrees with the sender's commitment: the step goes on;
* the receipt's signature covers what arrived and the commitment it names
  says otherwise (another sketch of the rows, another token): the sender
  signed two accounts of one step that cannot both be true. That is a
  `Contradiction`, proof against the sender alone that anyone can check
  without recomputing anything (`Contradiction.fault`);
* the signature does not cover what arrived: nothing provable (anyone can
  send bytes with a broken signature); the receiver refuses the step.

Pure functions and data: no I/O. The rules in full:
docs/design/verified-compute.md#blame.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import cbor2
import numpy as np

from mesh.identity import SIGNATURE_BYTES, Signer, verify
from runtime.inference.commitment import Commitment, sketch
from runtime.inference.transcript import Transcript, rows_agree

__all__ = [
    "HANDOFF_TOLERANCE",
    "ROW_DIGEST_BYTES",
    "SENT_DOMAIN",
    "Contradiction",
    "Receipt",
    "check_emitted",
    "check_handoff",
    "find_equivocation",
    "joined_digest",
    "receipted",
    "row_digests",
    "rows_digest",
    "token_digest",
]

SENT_DOMAIN: Final = b"shardmesh-sent-v1"
ROW_DIGEST_BYTES: Final = 16
"""blake2b of one forwarded row: 128 bits, no second row with the same
digest within reach. A proof carries every row's digest (16 bytes a
position) and only the one row that disagrees."""

HANDOFF_TOLERANCE: Final = 1e-4
"""How far the receiver's sketch of the rows it got may be from the one the
sender committed: both sketch the same float32 bytes with the same
projection, so they differ only by the summation order of a matmul (1e-7
relative); noise that changes an answer moves a sketch by far more than
this, honest rounding never does."""


def row_digests(rows: np.ndarray) -> tuple[bytes, ...]:
    """Each forwarded row's digest, of its little-endian float32 bytes."""
    values = np.ascontiguousarray(rows, dtype="<f4")
    return tuple(
        hashlib.blake2b(row.tobytes(), digest_size=ROW_DIGEST_BYTES).digest() for row in values
    )


def joined_digest(digests: Sequence[bytes]) -> bytes:
    """The digest of rows from their digests (`rows_digest`)."""
    return hashlib.blake2b(b"".join(digests), digest_size=ROW_DIGEST_BYTES).digest()


def rows_digest(rows: np.ndarray) -> bytes:
    """What a receipt names as sent for activations, and what the receiver
    commits as received: the digest of the rows' digests, so a proof can
    show one row without all the others."""
    return joined_digest(row_digests(rows))


def token_digest(token: int) -> bytes:
    """What a receipt names as sent for an emitted token; ValueError for an
    id no vocabulary has (negative, or past 64 bits: it came from a peer)."""
    try:
        encoded = int(token).to_bytes(8, "little")
    except OverflowError:
        raise ValueError(f"token id {token} out of range") from None
    return hashlib.blake2b(encoded, digest_size=ROW_DIGEST_BYTES).digest()


@dataclass(frozen=True, slots=True)
class Receipt:
    """A hop's signed word on what it sent for one step: the digest of its
    commitment for that step (`Commitment.digest`) and of what went on the
    wire (`rows_digest` or `token_digest`). It binds the session and step
    itself too, so it cannot be replayed into another."""

    hop: bytes
    entry: bytes
    session: str
    step: int
    commitment: bytes
    sent: bytes
    signature: bytes = b""

    @classmethod
    def of(cls, commitment: Commitment, sent: bytes, signature: bytes = b"") -> Receipt:
        """The receipt for ``commitment``'s step, naming ``sent``."""
        c = commitment
        return cls(c.hop, c.entry, c.session, c.step, c.digest(), sent, signature)

    def signed_bytes(self) -> bytes:
        value = [SENT_DOMAIN, self.entry, self.session, self.step, self.commitment, self.sent]
        return cbor2.dumps(value, canonical=True)

    def signed(self, signer: Signer) -> Receipt:
        return Receipt(
            self.hop,
            self.entry,
            self.session,
            self.step,
            self.commitment,
            self.sent,
            signer.sign(self.signed_bytes()),
        )

    def verified(self) -> bool:
        """True when ``hop`` signed exactly this receipt."""
        return len(self.signature) == SIGNATURE_BYTES and verify(
            self.hop, self.signed_bytes(), self.signature
        )


@dataclass(frozen=True, slots=True, eq=False)
class Contradiction:
    """Proof that a hop signed two accounts of one step that cannot both be
    true: its commitment (what it computed) and its receipt for what it
    sent. Either the receipt names that commitment and what was sent
    contradicts it (the last hop emitted ``token`` where its commitment
    names another, or a hop forwarded rows, ``digests``, one of which,
    ``row`` at ``index``, is shown, whose sketch is not the one committed);
    or the receipt, which the next hop relayed, names another commitment
    (``named``) for the same step than the one the hop sent the entry
    (an equivocation: ``commitment``, proven through ``links``; ``sent`` is
    what the next hop committed it received)."""

    commitment: Commitment
    signature: bytes
    """The receipt's signature: the receipt itself follows from the rest."""
    token: int | None = None
    digests: tuple[bytes, ...] = ()
    index: int = 0
    row: np.ndarray | None = None
    named: bytes = b""
    sent: bytes = b""
    links: tuple[Commitment, ...] = ()

    @property
    def accused(self) -> bytes:
        return self.commitment.hop

    def receipt(self) -> Receipt:
        c = self.commitment
        if self.named:
            return Receipt(c.hop, c.entry, c.session, c.step, self.named, self.sent, self.signature)
        sent = token_digest(self.token) if self.token is not None else joined_digest(self.digests)
        return Receipt.of(c, sent, self.signature)

    def fault(self) -> str:
        """What the accused did, for the record; ValueError when this is no
        proof (forged, malformed, or the two accounts agree)."""
        c = self.commitment
        if not self.receipt().verified():
            raise ValueError("the receipt's signature does not verify for this commitment")
        if self.named:
            if self.named == c.digest():
                raise ValueError("the receipt names the commitment itself")
            if not c.verified_through(self.links):
                raise ValueError("the commitment's signature does not verify (nor its chain's)")
            return f"signed another commitment for step {c.step} to the next hop than to the entry"
        if self.token is not None:
            if c.token is None or c.token == self.token:
                raise ValueError("the emitted token is the committed one")
            return f"emitted token {self.token} at step {c.step}, signed token {c.token}"
        row = self.row
        if row is None or c.token is not None or not 0 <= self.index < c.count:
            raise ValueError("no forwarded row of the commitment's step is shown")
        if len(self.digests) != c.count or row.ndim != 1 or c.outputs.shape[0] != c.count:
            raise ValueError("the forwarded rows do not match the commitment's step")
        if row_digests(row[None, :])[0] != self.digests[self.index]:
            raise ValueError("the row shown is not the one the receipt names")
        claimed = c.outputs[self.index : self.index + 1]
        if rows_agree(claimed, sketch(row[None, :], c.sketch_seed), HANDOFF_TOLERANCE):
            raise ValueError("the row shown agrees with the commitment")
        position = c.pos + self.index
        return f"forwarded other activations than it signed at step {c.step}, position {position}"

    def to_json(self) -> dict[str, Any]:
        return {
            "commitment": self.commitment.to_json(),
            "signature": self.signature.hex(),
            "token": self.token,
            "digests": [d.hex() for d in self.digests],
            "index": self.index,
            "row": None if self.row is None else _encode(self.row),
            "named": self.named.hex(),
            "sent": self.sent.hex(),
            "links": [link.to_json() for link in self.links],
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Contradiction:
        """ValueError for anything malformed (it came from another node);
        whether it proves anything is :meth:`fault`'s to say."""
        try:
            token, row = value["token"], value["row"]
            built = cls(
                commitment=Commitment.from_json(value["commitment"]),
                signature=bytes.fromhex(value["signature"]),
                token=None if token is None else int(token),
                digests=tuple(bytes.fromhex(d) for d in value["digests"]),
                index=int(value["index"]),
                row=None if row is None else _decode(row),
                named=bytes.fromhex(value.get("named", "")),
                sent=bytes.fromhex(value.get("sent", "")),
                links=tuple(Commitment.from_json(link) for link in value.get("links", [])[:16]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed contradiction: {exc}") from None
        if any(len(d) != ROW_DIGEST_BYTES for d in built.digests):
            raise ValueError(f"malformed contradiction: row digests are {ROW_DIGEST_BYTES} bytes")
        return built


def check_handoff(
    commitment: Commitment, signature: bytes, rows: np.ndarray, digests: Sequence[bytes]
) -> Contradiction | str | None:
    """The receiving hop's check of a forward: ``rows`` (whose
    `row_digests` are ``digests``) arrived with the sender's ``commitment``
    for the step and its receipt's ``signature``. None: they agree, take
    the step (and relay the receipt to the entry, which compares the
    commitment it names with the one the sender sent it). A
    `Contradiction`: the sender signed rows its commitment disagrees with
    (proof). Text: the step is refused and nothing is provable (the
    receipt does not cover what arrived). The receipt is verified on every
    step: a relayed receipt nobody checked would prove nothing later."""
    if commitment.count != rows.shape[0] or commitment.outputs.shape[0] != rows.shape[0]:
        return "the handoff's commitment does not cover the rows sent"
    if not Receipt.of(commitment, joined_digest(digests), signature).verified():
        return "the sender's receipt does not cover the rows it sent"
    mine = sketch(rows, commitment.sketch_seed)
    bad = [
        i
        for i in range(rows.shape[0])
        if not rows_agree(commitment.outputs[i : i + 1], mine[i : i + 1], HANDOFF_TOLERANCE)
    ]
    if not bad:
        return None
    row = np.array(rows[bad[0]], dtype=np.float32)
    return Contradiction(commitment, signature, digests=tuple(digests), index=bad[0], row=row)


def find_equivocation(transcript: Transcript) -> Contradiction | None:
    """A hop that sent the entry one commitment for a step and the next hop
    another, caught by the receipt the next hop relayed (the one it took
    the step on): proof, once the entry's copy is proven by its chain.
    None when every relayed receipt names the commitment the entry holds
    (or cannot be judged yet: a commitment missing, a chain not signed)."""
    for (index, step), (named, signature) in sorted(transcript.relays.items()):
        sender = transcript.commitments.get((index - 1, step))
        received = transcript.commitments.get((index, step))
        if sender is None or received is None or named == sender.digest():
            continue
        links = transcript.links(index - 1, step)
        proof = Contradiction(
            sender, signature, named=named, sent=received.inputs_digest, links=links
        )
        try:
            proof.fault()
        except ValueError:
            continue
        return proof
    return None


def check_emitted(
    commitment: Commitment, signature: bytes, token: int
) -> Contradiction | str | None:
    """The entry's check of a token before it is emitted: the last hop's
    ``commitment`` for the step and its receipt's ``signature`` for
    ``token``. None: the token is the signed one. A `Contradiction`: the
    hop signed that it emits ``token`` for a commitment naming another.
    Text: the receipt does not verify, so the token is not signed."""
    receipt = Receipt.of(commitment, token_digest(token), signature)
    if not receipt.verified():
        return "the token's receipt does not verify"
    if commitment.token != token:
        return Contradiction(commitment, signature, token=token)
    return None


def receipted(commitment: Commitment, signature: bytes) -> bool:
    """A last hop's commitment proven by the receipt for the token it
    emitted (the entry checked it before emitting, `check_emitted`): every
    token is signed so, though the hash chain signs only one step in
    `SIGN_EVERY` and a hop may withhold its seal."""
    if commitment.token is None:
        return False
    return Receipt.of(commitment, token_digest(commitment.token), signature).verified()


def _encode(row: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(row, dtype="<f4").tobytes()).decode()


def _decode(value: object) -> np.ndarray:
    if not isinstance(value, str):
        raise ValueError("a row must be base64 text")
    data = base64.b64decode(value, validate=True)
    if not data or len(data) % 4:
        raise ValueError("a row must be float32")
    row = np.frombuffer(data, dtype="<f4").astype(np.float32)
    if not np.isfinite(row).all():
        raise ValueError("a row must be finite")
    return row
