"""Following the ledger outside Raft: whose notices count, what a pull must prove."""

from __future__ import annotations

import time

import pytest

from consensus.commands import Found, encode_command
from consensus.ledger import PlacementLedger, snapshot_digest
from mesh.identity import Identity
from mesh.records import Addresses, LedgerNotice, NodeRecord
from runtime.node.ledger_follower import (
    LAZY_PULL_S,
    REFRESH_S,
    ClaimRefused,
    LedgerClaim,
    LedgerFollower,
    signed_headers,
    verify_pull,
)

VOTER, OTHER_VOTER, STRANGER, SEED = (Identity.generate() for _ in range(4))


def ledger_at(index: int) -> PlacementLedger:
    ledger = PlacementLedger()
    ledger.apply(index, encode_command(Found(VOTER.node_id, "open", 1.0)))
    return ledger


def answer(signer: Identity, ledger: PlacementLedger, voters: tuple[bytes, ...] = ()) -> tuple:
    body = ledger.snapshot()
    claim = LedgerClaim(3, ledger.applied_index, snapshot_digest(body), voters)
    return signed_headers(signer, claim), body


def test_a_trusted_voters_signed_ledger_verifies_and_names_the_next_voters() -> None:
    voters = (VOTER.node_id, OTHER_VOTER.node_id)
    headers, body = answer(VOTER, ledger_at(5), voters)
    claim = verify_pull(VOTER.node_id, headers, body, trusted=[VOTER.node_id])
    assert claim.index == 5 and claim.voters == voters and claim.term == 3


@pytest.mark.parametrize(
    "case",
    ["untrusted signer", "other signer", "tampered body", "tampered claim", "no signature"],
)
def test_a_pull_that_proves_less_is_refused(case: str) -> None:
    headers, body = answer(VOTER, ledger_at(5))
    signer, trusted = VOTER.node_id, [VOTER.node_id]
    if case == "untrusted signer":
        headers, body = answer(STRANGER, ledger_at(5))
        signer = STRANGER.node_id
    elif case == "other signer":
        headers, _ = answer(STRANGER, ledger_at(5))  # a stranger's signature, sent as the voter's
    elif case == "tampered body":
        body = ledger_at(6).snapshot()
    elif case == "tampered claim":
        headers = {
            **headers,
            "x-shardmesh-ledger-claim": headers["x-shardmesh-ledger-claim"].replace(
                '"index":5', '"index":9'
            ),
        }
    else:
        headers = {k: v for k, v in headers.items() if "signature" not in k}
    with pytest.raises(ClaimRefused):
        verify_pull(signer, headers, body, trusted=trusted)


def record_with(notice: LedgerNotice | None) -> NodeRecord:
    return NodeRecord(
        addresses=Addresses("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "http://127.0.0.1:3"),
        started_at=time.time(),
        ledger=notice,
    )


def follower(records: dict[bytes, NodeRecord], held: int = 0) -> LedgerFollower:
    return LedgerFollower(
        node_id=b"\x07" * 32,
        seeds=[SEED.node_id],
        in_configuration=lambda: False,
        record=records.get,
        api_of=lambda node: "http://127.0.0.1:3" if node in records else None,
        install=lambda ledger: None,
        held=lambda: held,
    )


def test_only_a_trusted_voters_newer_notice_makes_a_member_pull() -> None:
    digest = "ab" * 32
    records = {
        SEED.node_id: record_with(None),
        STRANGER.node_id: record_with(LedgerNotice(10**9, 10**9, digest)),  # a loud stranger
    }
    member = follower(records, held=4)
    assert member.trusted == (SEED.node_id,)  # nothing pulled yet: the seeds
    assert member.newest_notice() is None  # the stranger's notice does not count
    assert member.source(now=0.0) == SEED.node_id  # the first pull goes to a seed
    member.voters = (VOTER.node_id,)
    records[VOTER.node_id] = record_with(LedgerNotice(3, 4, digest))
    assert member.newest_notice() is None  # not newer than the copy held
    records[VOTER.node_id] = record_with(LedgerNotice(3, 5, digest))
    assert member.newest_notice() == (VOTER.node_id, LedgerNotice(3, 5, digest))
    assert member.source(now=0.0) == VOTER.node_id  # never pulled: pull now
    member.note_pull(100.0)
    assert member.source(now=101.0) is None  # a commit about others: lazily
    assert member.source(now=100.0 + LAZY_PULL_S) == VOTER.node_id
    mine = (member.node_id.hex(), 5)
    records[VOTER.node_id] = record_with(LedgerNotice(3, 5, digest, (mine,)))
    assert member.source(now=101.0) == VOTER.node_id  # its own assignment changed: at once
    records[VOTER.node_id] = record_with(LedgerNotice(3, 4, digest))
    assert member.source(now=101.0) is None  # up to date, voters heard from recently
    assert member.source(now=100.0 + REFRESH_S) == VOTER.node_id  # refresh the voters


def test_a_member_is_caught_up_only_once_its_copy_is_as_new_as_the_notice_heard() -> None:
    """What auto-join waits for: a node that started before its ledger
    arrived must not choose a gap on the empty copy it began with."""
    digest = "ab" * 32
    records = {SEED.node_id: record_with(None)}
    held = [0]
    member = LedgerFollower(
        node_id=b"\x07" * 32,
        seeds=[SEED.node_id],
        in_configuration=lambda: False,
        record=records.get,
        api_of=lambda node: None,
        install=lambda ledger: None,
        held=lambda: held[0],
    )
    assert not member.caught_up()  # no notice heard yet: nothing to be sure of
    records[SEED.node_id] = record_with(LedgerNotice(2, 7, digest))
    assert not member.caught_up()  # the leader has applied 7, this copy 0
    held[0] = 7
    assert member.caught_up()
    records[STRANGER.node_id] = record_with(LedgerNotice(10**9, 10**9, digest))
    assert member.caught_up()  # a stranger's notice is no reason to wait
