"""Invitations to a private swarm: bearer tokens a voter signs.

A private swarm's nodes complete a handshake only with keys the ledger has
admitted (`consensus.commands.Admit`). A token names the swarm, its signer
(a voter), whether the newcomer may vote, an expiry, and where to redeem it
and join; the newcomer redeems it by signing `redemption_bytes` with its own
key, so a redemption admits exactly the key that asked. It is a secret like
a password until it expires. The token is `smi1.` and the base64url of one
strict CBOR array. The redemption flow and the token's fields are in
docs/design/ledger.md ("Invitations").
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass, fields
from typing import Final

from mesh.fields import FieldError, array, boolean, fixed_bytes, text, uint
from mesh.identity import NODE_ID_BYTES, SIGNATURE_BYTES, Signer, verify
from mesh.wire import DecodeError, EncodeError, decode_strict_cbor, encode_strict_cbor

__all__ = [
    "NONCE_BYTES",
    "TOKEN_PREFIX",
    "Invitation",
    "InvitationError",
    "decode_invitation",
    "issue_invitation",
    "redemption_bytes",
]

TOKEN_PREFIX: Final = "smi1."
NONCE_BYTES: Final = 16
"""Random bytes that make two invitations with the same fields distinct
(and their digests, which admissions record)."""
MAX_TOKEN_BYTES: Final = 2048
"""Far above a real token (~400 bytes): two ids, a signature, two short
addresses; refused before any parsing above it."""
MAX_TEXT_CHARS: Final = 300
"""An address or URL inside a token (see `mesh.wire.MAX_ADDR_CHARS`)."""
_SIGNING_DOMAIN: Final = b"shardmesh-invitation-v1\x00"
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
    signature: bytes = b""

    def signing_bytes(self) -> bytes:
        return _SIGNING_DOMAIN + _encode(self._fields())

    def _fields(self) -> list[object]:
        return [getattr(self, f.name) for f in fields(self) if f.name != "signature"]

    def token(self) -> str:
        raw = _encode([*self._fields(), self.signature])
        return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def check(self, *, swarm: bytes, voters: frozenset[bytes], now: float) -> None:
        """Raise `InvitationError` unless this token admits to `swarm` now:
        signed by its inviter, the inviter one of `voters`, not expired."""
        if not verify(self.inviter, self.signing_bytes(), self.signature):
            raise InvitationError("the invitation's signature is not its inviter's")
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
) -> Invitation:
    """A signed invitation (time and randomness come from the caller)."""
    unsigned = Invitation(swarm, signer.node_id, voter, expires_at, nonce, seed, api)
    return Invitation(
        swarm, signer.node_id, voter, expires_at, nonce, seed, api,
        signer.sign(unsigned.signing_bytes()),
    )  # fmt: skip


def decode_invitation(token: str) -> Invitation:
    """Parse a token strictly; `InvitationError` names what is wrong. The
    signature is checked by `Invitation.check`, against the swarm's voters."""
    token = token.strip()
    if not token.startswith(TOKEN_PREFIX):
        raise InvitationError(f"not an invitation (it should start with {TOKEN_PREFIX!r})")
    body = token[len(TOKEN_PREFIX) :]
    if len(body) > MAX_TOKEN_BYTES * 2:
        raise InvitationError("the invitation is too long")
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        value = decode_strict_cbor(raw, max_bytes=MAX_TOKEN_BYTES)
        swarm, inviter, voter, expires_at, nonce, seed, api, signature = array(
            value, "invitation", size=8
        )
        return Invitation(
            swarm=fixed_bytes(swarm, "swarm", size=NODE_ID_BYTES),
            inviter=fixed_bytes(inviter, "inviter", size=NODE_ID_BYTES),
            voter=boolean(voter, "voter"),
            expires_at=uint(expires_at, "expires_at"),
            nonce=fixed_bytes(nonce, "nonce", size=NONCE_BYTES),
            seed=text(seed, "seed", max_chars=MAX_TEXT_CHARS, printable=True, ascii_only=True),
            api=text(api, "api", max_chars=MAX_TEXT_CHARS, printable=True, ascii_only=True),
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
