"""Invitations to a private swarm: bearer tokens a voter signs.

A private swarm's nodes complete a handshake only with keys the ledger has
admitted (`consensus.commands.Admit`). A token names the swarm, its signer
(a voter), whether the newcomer may vote, an expiry, where to redeem it and
join, and how many nodes it admits (one unless minted for more; a voter's
always one: the ledger counts). The newcomer redeems it by signing
`redemption_bytes` with its own key, so a redemption admits exactly the key
that asked. It is a secret like a password until it is used up or expires.
The token is `smi2.` and the base64url of one strict CBOR array (`smi1.`,
without the count, is still read: it admits one). More in
docs/design/ledger.md ("Invitations").
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass, fields
from typing import Final

from consensus.commands import MAX_INVITATION_USES
from mesh.fields import FieldError, array, boolean, fixed_bytes, text, uint
from mesh.identity import NODE_ID_BYTES, SIGNATURE_BYTES, Signer, verify
from mesh.wire import DecodeError, EncodeError, decode_strict_cbor, encode_strict_cbor

__all__ = [
    "FIRST_PREFIX",
    "NONCE_BYTES",
    "TOKEN_PREFIX",
    "Invitation",
    "InvitationError",
    "decode_invitation",
    "issue_invitation",
    "redemption_bytes",
]

TOKEN_PREFIX: Final = "smi2."
FIRST_PREFIX: Final = "smi1."
"""The first format, before a token said how many nodes it admits."""
NONCE_BYTES: Final = 16
"""Random bytes that make two invitations with the same fields distinct
(and their digests, which admissions record)."""
MAX_TOKEN_BYTES: Final = 2048
"""Far above a real token (~400 bytes): two ids, a signature, two short
addresses; refused before any parsing above it."""
MAX_TEXT_CHARS: Final = 300
"""An address or URL inside a token (see `mesh.wire.MAX_ADDR_CHARS`)."""
_SIGNING_DOMAIN: Final = b"shardmesh-invitation-v2\x00"
_FIRST_SIGNING_DOMAIN: Final = b"shardmesh-invitation-v1\x00"
_REDEMPTION_DOMAIN: Final = b"shardmesh-redemption-v1\x00"


class InvitationError(Exception):
    """A token that cannot be used; the message says why, for the operator."""


@dataclass(frozen=True)
class Invitation:
    swarm: bytes
    """The founder's node id: the swarm's identity."""
    inviter: bytes
    voter: bool
    """The newcomer may be made a voter (see ADR-0026; issue 14 acts on it)."""
    expires_at: int
    """Unix seconds after which the token can no longer be redeemed."""
    nonce: bytes
    seed: str
    """`ID@H:P`: the inviter's id and control address, to join through."""
    api: str
    """The inviter's API, where the token is redeemed."""
    uses: int | None = 1
    """How many nodes it admits (`admits`); None: a token of the first
    format (`FIRST_PREFIX`), which had no such field."""
    signature: bytes = b""

    @property
    def admits(self) -> int:
        """How many nodes it admits: a first-format token one, as
        `shardmesh invite` said it would."""
        return 1 if self.uses is None else self.uses

    def signing_bytes(self) -> bytes:
        domain = _FIRST_SIGNING_DOMAIN if self.uses is None else _SIGNING_DOMAIN
        return domain + _encode(self._fields())

    def _fields(self) -> list[object]:
        skip = {"signature"} if self.uses is not None else {"signature", "uses"}
        return [getattr(self, f.name) for f in fields(self) if f.name not in skip]

    def token(self) -> str:
        raw = _encode([*self._fields(), self.signature])
        prefix = FIRST_PREFIX if self.uses is None else TOKEN_PREFIX
        return prefix + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def check(self, *, swarm: bytes, voters: frozenset[bytes], now: float) -> None:
        """Raise `InvitationError` unless this token admits to `swarm` now:
        signed by its inviter, the inviter one of `voters`, not expired, and
        a voter's for one node. (Whether it is used up is the ledger's.)"""
        if not verify(self.inviter, self.signing_bytes(), self.signature):
            raise InvitationError("the invitation's signature is not its inviter's")
        if self.voter and self.admits != 1:
            raise InvitationError("a voter's invitation admits one node only")
        if self.swarm != swarm:
            raise InvitationError("the invitation is for another swarm")
        if self.inviter not in voters:
            raise InvitationError("the invitation was not signed by a voter of this swarm")
        if now >= self.expires_at:
            raise InvitationError("the invitation has expired")

    def digest(self) -> bytes:
        """What an admission records: which invitation let the node in."""
        return hashlib.sha256(self.signing_bytes() + self.signature).digest()


def _encode(value: list[object]) -> bytes:
    try:
        return encode_strict_cbor(value, max_bytes=MAX_TOKEN_BYTES)
    except EncodeError as exc:
        raise InvitationError(f"the invitation cannot be encoded: {exc}") from None


def issue_invitation(
    signer: Signer,
    *,
    swarm: bytes,
    voter: bool,
    expires_at: int,
    nonce: bytes,
    seed: str,
    api: str,
    uses: int = 1,
) -> Invitation:
    """A signed invitation for `uses` nodes (time and randomness come from the caller)."""
    unsigned = Invitation(swarm, signer.node_id, voter, expires_at, nonce, seed, api, uses)
    return Invitation(
        swarm, signer.node_id, voter, expires_at, nonce, seed, api, uses,
        signer.sign(unsigned.signing_bytes()),
    )  # fmt: skip


def decode_invitation(token: str) -> Invitation:
    """Parse a token strictly; `InvitationError` names what is wrong. The
    signature is checked by `Invitation.check`, against the swarm's voters."""
    token = token.strip()
    first = token.startswith(FIRST_PREFIX)
    if not first and not token.startswith(TOKEN_PREFIX):
        raise InvitationError(f"not an invitation (it should start with {TOKEN_PREFIX!r})")
    body = token[len(FIRST_PREFIX if first else TOKEN_PREFIX) :]
    if len(body) > MAX_TOKEN_BYTES * 2:
        raise InvitationError("the invitation is too long")
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        value = decode_strict_cbor(raw, max_bytes=MAX_TOKEN_BYTES)
        items = array(value, "invitation", size=8 if first else 9)
        swarm, inviter, voter, expires_at, nonce, seed, api = items[:7]
        uses, signature = (None, items[7]) if first else items[7:]
        return Invitation(
            swarm=fixed_bytes(swarm, "swarm", size=NODE_ID_BYTES),
            inviter=fixed_bytes(inviter, "inviter", size=NODE_ID_BYTES),
            voter=boolean(voter, "voter"),
            expires_at=uint(expires_at, "expires_at"),
            nonce=fixed_bytes(nonce, "nonce", size=NONCE_BYTES),
            seed=text(seed, "seed", max_chars=MAX_TEXT_CHARS, printable=True, ascii_only=True),
            api=text(api, "api", max_chars=MAX_TEXT_CHARS, printable=True, ascii_only=True),
            uses=None if first else uint(uses, "uses", low=1, high=MAX_INVITATION_USES),
            signature=fixed_bytes(signature, "signature", size=SIGNATURE_BYTES),
        )
    except (binascii.Error, ValueError) as exc:
        raise InvitationError(f"the invitation is not valid base64: {exc}") from None
    except (DecodeError, FieldError) as exc:
        raise InvitationError(f"the invitation is malformed: {exc}") from None


def redemption_bytes(invitation: Invitation, node: bytes, at: int) -> bytes:
    """What a newcomer signs to redeem `invitation` for its own key `node`
    at unix time `at` (the redeeming node checks that `at` is recent)."""
    return _REDEMPTION_DOMAIN + invitation.digest() + node + at.to_bytes(8, "big")
