"""Invitation tokens: what a voter signs, and every way a token can be wrong."""

from __future__ import annotations

import base64
import hashlib
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consensus.commands import MAX_INVITATION_USES
from consensus.invitations import (
    FIRST_PREFIX,
    TOKEN_PREFIX,
    InvitationError,
    decode_invitation,
    issue_invitation,
    redemption_bytes,
)
from mesh.identity import Identity, verify
from mesh.wire import encode_strict_cbor

FOUNDER = Identity.from_seed(b"f" * 32)
VOTER = Identity.from_seed(b"v" * 32)
STRANGER = Identity.from_seed(b"s" * 32)
NOW = 1_800_000_000
VOTERS = frozenset({FOUNDER.node_id, VOTER.node_id})


def invite(
    signer: Identity = VOTER, *, expires_at: int = NOW + 3600, voter: bool = False, uses: int = 1
):
    return issue_invitation(
        signer,
        swarm=FOUNDER.node_id,
        voter=voter,
        expires_at=expires_at,
        nonce=os.urandom(16),
        seed=f"{signer.node_id.hex()}@127.0.0.1:7000",
        api="http://127.0.0.1:8000",
        uses=uses,
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


def test_a_token_says_how_many_nodes_it_admits_and_no_one_can_raise_it() -> None:
    assert decode_invitation(invite().token()).admits == 1
    batch = decode_invitation(invite(uses=3).token())
    assert (batch.uses, batch.admits) == (3, 3)
    batch.check(swarm=FOUNDER.node_id, voters=VOTERS, now=NOW)
    raised = decode_invitation(batch.token())
    object.__setattr__(raised, "uses", MAX_INVITATION_USES)
    with pytest.raises(InvitationError, match="signature"):
        decode_invitation(raised.token()).check(swarm=FOUNDER.node_id, voters=VOTERS, now=NOW)
    # A voter's is for one node, even when a voter signs it for more.
    with pytest.raises(InvitationError, match="one node"):
        invite(voter=True, uses=2).check(swarm=FOUNDER.node_id, voters=VOTERS, now=NOW)
    for uses in (0, MAX_INVITATION_USES + 1):
        with pytest.raises(InvitationError, match="uses"):
            decode_invitation(invite(uses=uses).token())


def test_a_token_of_the_first_format_still_admits_one_node_under_its_old_digest() -> None:
    """`smi1.` tokens, issued before a token counted its uses, are read as
    for one node (what the CLI said) and keep the digest the ledger knows."""
    signed = [FOUNDER.node_id, VOTER.node_id, False, NOW + 60, b"n" * 16, "s@h:1", "http://h"]
    signing = b"shardmesh-invitation-v1\x00" + encode_strict_cbor(signed, max_bytes=2048)
    signature = VOTER.sign(signing)
    raw = encode_strict_cbor([*signed, signature], max_bytes=2048)
    token = FIRST_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")
    first = decode_invitation(token)
    first.check(swarm=FOUNDER.node_id, voters=VOTERS, now=NOW)
    assert (first.uses, first.admits, first.token()) == (None, 1, token)
    assert first.digest() == hashlib.sha256(signing + signature).digest()


@given(st.binary(max_size=600))
def test_garbage_is_a_clear_error_never_a_crash(junk: bytes) -> None:
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
