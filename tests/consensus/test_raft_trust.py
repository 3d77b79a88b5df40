"""Raft that only the configuration can move, as scenarios in the core.

Issue 14: a message from a key outside the configuration, or a leader's
message from a member that is not a voter (nor eligible), is dropped and
counted before Raft's term rules can act on it; and an operator can refound
a cluster whose voters are gone for good.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio

from consensus.codec import encode_raft
from consensus.commands import Found, encode_command
from consensus.config import ConsensusConfig
from consensus.ledger import PlacementLedger
from consensus.log import Entry, EntryKind, Snapshot
from consensus.raft import (
    AppendEntries,
    InstallSnapshot,
    RequestVote,
    TimeoutNow,
    encode_config,
)
from consensus.storage import RaftStorage
from runtime.node.raft_driver import RaftDriver
from tests.consensus.test_raft import Network, commands

A, B, C, L, X = b"a", b"b", b"c", b"l", b"x"
"""Three voters, a learner and a stranger."""
HUGE = 10**15


def three_voters_and_a_learner() -> Network:
    net = Network([A, B, C, L], learners=frozenset({L}), seed=5)
    net.elect(A)
    net.propose(A, b"before")
    net.tick(1)
    return net


def takeover(sender: bytes, to: bytes) -> list[object]:
    only = frozenset({sender})
    config = Entry(HUGE, 1, EntryKind.CONFIG, encode_config(only, frozenset()))
    return [
        InstallSnapshot(
            to=to,
            term=HUGE,
            leader=sender,
            snapshot=Snapshot(10**6, HUGE, only, frozenset(), b"theirs"),
        ),
        AppendEntries(
            to=to, term=HUGE, leader=sender, prev_index=0, prev_term=0, entries=(config,), commit=1
        ),
        TimeoutNow(to=to, term=HUGE, leader=sender),
        RequestVote(to=to, term=HUGE, candidate=sender, last_index=10**9, last_term=HUGE),
    ]


@pytest.mark.parametrize("target", [A, B, L])
def test_a_stranger_moves_no_term_and_no_configuration(target: bytes) -> None:
    net = three_voters_and_a_learner()
    node = net.nodes[target]
    term, voters = node.term, node.voters
    for message in takeover(X, target):
        node.step(message)  # type: ignore[arg-type]
        net.flush()
    assert node.term == term and node.voters == voters and node.leader == A
    assert node.refused["not_in_configuration"] == 4
    net.propose(A, b"after")
    net.tick(1)
    assert commands(net, target) == [b"before", b"after"]


@pytest.mark.parametrize("target", [A, B, C])
def test_a_learner_cannot_lead_or_depose(target: bytes) -> None:
    net = three_voters_and_a_learner()
    node = net.nodes[target]
    term = node.term
    for message in takeover(L, target)[:3]:  # the leader's messages
        node.step(message)  # type: ignore[arg-type]
        net.flush()
    assert node.term == term and L not in node.voters
    assert node.refused["leader_message_from_non_voter"] == 3


def test_an_eligible_learner_is_followed_by_a_node_that_missed_its_promotion() -> None:
    # C misses the entry promoting L, and A hands leadership to L.
    D, E = b"d", b"e"
    net = Network([A, B, C, D, E, L], learners=frozenset({L}), seed=7)
    net.eligible = frozenset({A, B, C, D, E, L})
    for node in net.nodes.values():
        node.eligible = net.eligible
    net.elect(A)
    net.isolate(C)
    net.nodes[A].propose_config(add_voter=L)
    net.deliver()
    net.tick(1)
    assert L in net.nodes[B].voters and L not in net.nodes[C].voters
    assert net.nodes[A].transfer_leadership(L)
    net.deliver()
    net.tick(1)
    assert net.nodes[L].is_leader
    net.heal()
    net.propose(L, b"under l")
    net.tick(2)
    assert L in net.nodes[C].voters  # repaired by a leader it had only known as a learner
    assert commands(net, C)[-1] == b"under l"
    assert net.nodes[C].refused["leader_message_from_non_voter"] == 0


def test_without_a_configuration_a_node_takes_only_eligible_leaders() -> None:
    net = Network([A], seed=1)
    net.eligible = frozenset({A})
    net.nodes[A].eligible = net.eligible
    net.elect(A)
    newcomer = net.add_node(B, voters=frozenset())
    for message in takeover(X, B):
        newcomer.step(message)  # type: ignore[arg-type]
    assert newcomer.term == 0 and not newcomer.voters
    assert newcomer.refused["not_in_configuration"] == 4
    net.nodes[A].propose_config(add_learner=B)
    net.deliver()
    net.tick(2)
    assert newcomer.leader == A and newcomer.learners == {B}


def test_refound_makes_the_survivor_the_only_voter_and_the_others_follow() -> None:
    net = Network([A, B, C], seed=11)
    net.elect(A)
    net.propose(A, b"kept")
    net.tick(1)
    net.crash(B)
    net.crash(C)
    net.tick(3 * net.config.election_ticks, nodes=[A])  # CheckQuorum: A steps down
    survivor = net.nodes[A]
    assert not survivor.is_leader and net.leaders() == []
    index = survivor.refound()
    net.flush()
    assert survivor.is_leader and survivor.voters == {A}
    assert survivor.entries(index, index)[0].kind == EntryKind.CONFIG
    net.propose(A, b"alone")
    assert commands(net, A) == [b"kept", b"alone"]
    # One voter comes back after all. The voter policy adds it as a
    # learner, and it follows the refounded leader (a voter in its old
    # configuration too) onto the new configuration.
    net.restart(B)
    assert net.nodes[A].propose_config(add_learner=B) is not None
    net.deliver()
    net.tick(2)
    assert net.nodes[B].voters == {A} and net.nodes[B].learners == {B}
    assert commands(net, B) == [b"kept", b"alone"]


# --- the driver: a snapshot is checked whole before anything of it is kept ----------


async def test_a_snapshot_whose_ledger_cannot_be_restored_is_never_persisted(
    tmp_path: Path,
) -> None:
    """A joining node (no configuration, nobody eligible yet) takes the first
    leader; even then a snapshot it cannot restore is refused before the core
    could hand it out to be persisted, where it would stop the node at every
    start. The same leader's good snapshot is taken."""
    leader, me = bytes([1]) * 32, bytes([2]) * 32
    good = PlacementLedger()
    good.apply(1, encode_command(Found(leader, "open", 1.0)))

    def install(data: bytes) -> bytes:
        snapshot = Snapshot(5, 2, frozenset({leader}), frozenset({me}), data)
        return encode_raft(InstallSnapshot(to=me, term=2, leader=leader, snapshot=snapshot))

    with RaftStorage.open(tmp_path / "raft.sqlite3") as store:
        driver = RaftDriver(
            node_id=me,
            storage=store,
            config=ConsensusConfig.local(),
            bootstrap=False,
            send=lambda to, payload: None,
            members=lambda: (),
            rng=random.Random(0),
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver.run)
            driver.deliver(leader, install(os.urandom(64)))
            await trio.sleep(0.2)
            assert driver.drops["bad_snapshot_ledger"] == 1
            assert store.load().snapshot is None and driver.raft.term == 0
            driver.deliver(leader, install(good.snapshot()))
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
        assert store.load().snapshot is not None
        assert driver.ledger.founding == Found(leader, "open", 1.0)
        assert driver.raft.term == 2 and driver.raft.learners == {me}
