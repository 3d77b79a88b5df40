"""Invitation tokens: what a voter signs, and every way a token can be wrong."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consensus.invitations import (
    TOKEN_PREFIX,
    InvitationError,
    decode_invitation,
    issue_invitation,
    redemption_bytes,
)
from mesh.identity import Identity, verify

FOUNDER = Identity.from_seed(b"f" * 32)
VOTER = Identity.from_seed(b"v" * 32)
STRANGER = Identity.from_seed(b"s" * 32)
NOW = 1_800_000_000
VOTERS = frozenset({FOUNDER.node_id, VOTER.node_id})


def invite(signer: Identity = VOTER, *, expires_at: int = NOW + 3600, voter: bool = False):
    return issue_invitation(
        signer,
        swarm=FOUNDER.node_id,
        voter=voter,
        expires_at=expires_at,
        nonce=os.urandom(16),
        seed=f"{signer.node_id.hex()}@127.0.0.1:7000",
        api="http://127.0.0.1:8000",
    )


def test_a_voters_token_round_trips_and_admits_until_it_expires() -> None:
    invitation = invite(voter=True)
    token = invitation.token()
    assert token.startswith(TOKEN_PREFIX)
    again = decode_invitation(token)
    assert again == invitation and again.voter
    again.check(swarm=FOUNDER.node_id, voters=VOTERS, now=NOW)
    with pytest.raises(InvitationError, match="expired"):
        again.check(swarm=FOUNDER.node_id, voters=VOTERS, now=NOW + 3600)


def test_tokens_from_non_voters_other_swarms_or_forgers_are_refused() -> None:
    with pytest.raises(InvitationError, match="not signed by a voter"):
        invite(STRANGER).check(swarm=FOUNDER.node_id, voters=VOTERS, now=NOW)
    with pytest.raises(InvitationError, match="another swarm"):
        invite().check(swarm=STRANGER.node_id, voters=VOTERS, now=NOW)
    # A stranger rewrites a voter's token to make itself a voter-to-be and
    # extend it: the signature no longer holds.
    genuine = invite()
    forged = decode_invitation(genuine.token())
    object.__setattr__(forged, "voter", True)
    object.__setattr__(forged, "expires_at", NOW + 10**6)
    with pytest.raises(InvitationError, match="signature"):
        decode_invitation(forged.token()).check(swarm=FOUNDER.node_id, voters=VOTERS, now=NOW)


@given(st.binary(max_size=600))
def test_garbage_is_a_clear_error_never_a_crash(junk: bytes) -> None:
    import base64

    for token in (junk.decode("latin-1"), TOKEN_PREFIX + base64.urlsafe_b64encode(junk).decode()):
        with pytest.raises(InvitationError):
            decode_invitation(token)


def test_a_redemption_binds_the_token_to_the_newcomers_key() -> None:
    invitation = invite()
    newcomer = Identity.generate()
    signed = newcomer.sign(redemption_bytes(invitation, newcomer.node_id, NOW))
    assert verify(newcomer.node_id, redemption_bytes(invitation, newcomer.node_id, NOW), signed)
    # Replayed for another key, or at another time, it proves nothing.
    assert not verify(STRANGER.node_id, redemption_bytes(invitation, STRANGER.node_id, NOW), signed)
    assert not verify(
        newcomer.node_id, redemption_bytes(invitation, newcomer.node_id, NOW + 1), signed
    )
