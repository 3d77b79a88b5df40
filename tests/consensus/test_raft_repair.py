"""A node whose log lost acknowledged entries is repaired, and votes only then.

The scripted `Network` of tests/consensus/test_raft.py, with one more fault:
a node restarts from a disk whose log lost its tail (sqlite's WAL cut short
by kill -9 or a disk fault; tests/consensus/test_storage_wal_damage.py shows the storage
noticing it). Storage then starts the core with `repair_until`; these tests
show what that buys (consensus.raft, module doc, "Repair"), and what happens
without it: a committed entry is lost.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from consensus.log import LogPosition
from consensus.raft import (
    Message,
    RaftConfig,
    RaftNode,
    RequestVote,
    Role,
    TimeoutNow,
    VoteResponse,
)
from simulations.network import NetworkConfig
from simulations.raft_cluster import RaftCluster
from tests.consensus.test_raft import A, B, C, D, E, Network, commands


def restart_damaged(net: Network, nid: bytes, keep: int, *, repair: bool = True) -> RaftNode:
    """Restart `nid` from a disk whose log lost every entry after `keep`.

    The hard state's commit index goes back with the log (they are in the
    same sqlite transactions); term and vote survive (storage restores them
    from its marker). With `repair`, the core starts as the driver starts it
    from such a store: `repair_until` is where the log ended before.
    """
    disk = net.disks[nid]
    last = disk.entries[-1]
    owed = LogPosition(term=last.term, index=last.index)
    disk.entries = [e for e in disk.entries if e.index <= keep]
    disk.hard_state = replace(disk.hard_state, commit=min(disk.hard_state.commit, keep))
    node = net.restart(nid)
    if not repair:
        return node
    voters, learners = net.boot[nid]
    node = RaftNode(
        nid,
        net.config,
        random.Random(f"repair:{nid.hex()}:{net.restarts}"),
        hard_state=disk.hard_state,
        entries=list(disk.entries),
        snapshot=disk.snapshot,
        voters=voters,
        learners=learners,
        applied=net.applied_index[nid],
        repair_until=owed,
    )
    net.nodes[nid] = node
    return node


def run(net: Network, ticks: int, nodes: list[bytes], seen: list[Message]) -> None:
    """Tick `nodes` and settle, recording every message delivered or dropped."""

    def record(m: Message) -> bool:
        seen.append(m)
        return False

    for _ in range(ticks):
        for nid in nodes:
            if nid not in net.down:
                net.nodes[nid].tick()
        net.deliver(drop=record)


def committed_without_c(net: Network) -> int:
    """A commits "x" with B's acknowledgement alone (C hears nothing); x's index."""
    net.elect(A)
    net.propose(A, b"base")
    net.tick(1)
    net.blocked |= {(A, C), (C, A)}
    x = net.propose(A, b"x")
    net.deliver()
    net.tick(1)
    assert net.nodes[A].commit_index >= x and b"x" in commands(net, A)
    assert net.nodes[B].last_index >= x and net.nodes[C].last_index < x
    return x


@pytest.mark.parametrize("pre_vote", [True, False], ids=["pre_vote", "no_pre_vote"])
def test_damaged_follower_neither_votes_nor_campaigns_until_a_leader_repairs_it(
    pre_vote: bool,
) -> None:
    net = Network([A, B, C], config=RaftConfig(pre_vote=pre_vote), seed=1)
    x = committed_without_c(net)
    term = net.nodes[A].term
    # A and B crash; B's WAL loses x. Only A's disk still holds it.
    net.crash(A)
    net.crash(B)
    b = restart_damaged(net, B, keep=x - 1)
    assert b.repairing_until == LogPosition(term=term, index=x)
    net.heal()

    # C, whose log lacks x, campaigns again and again. B refuses every time
    # and never campaigns itself: no leader without x can be elected.
    seen: list[Message] = []
    run(net, 8 * net.config.election_ticks, [B, C], seen)
    from_b = [m for m in seen if m.sender == B]
    answers = [m for m in from_b if isinstance(m, VoteResponse)]
    assert answers and not any(m.granted for m in answers)
    assert not any(isinstance(m, RequestVote) for m in from_b)
    # B's only vote is the one it cast before the crash (term `term`).
    assert net.nodes[B].role == Role.FOLLOWER
    assert net.nodes[B].vote is None or net.nodes[B].term == term
    assert net.leaders() == []

    # A comes back: only it can win (C's vote), and it repairs B.
    net.restart(A)
    assert net.tick_until_leader([A, B, C]) == A
    net.tick(2)
    assert net.nodes[B].repairing_until is None
    assert net.log(B) == net.log(A)
    assert all(b"x" in commands(net, n) for n in (A, B, C))

    # Repaired, B is a voter like any other: without A, B and C elect a
    # leader, which holds x.
    net.crash(A)
    new = net.tick_until_leader([B, C])
    assert net.nodes[new].entries(x, x)[0].data == b"x"


def test_without_repair_the_same_damage_loses_a_committed_entry() -> None:
    """Why repair exists: B, trusting its shortened log, elects a leader without x."""
    net = Network([A, B, C], seed=1)
    x = committed_without_c(net)
    x_entry = net.nodes[A].entries(x, x)
    net.crash(A)
    net.crash(B)
    restart_damaged(net, B, keep=x - 1, repair=False)
    net.heal()
    new = net.tick_until_leader([B, C])
    # Leader Completeness is broken: x was committed (A applied it) and is gone.
    assert net.nodes[new].entries(x, x) != x_entry


def test_the_leader_that_counted_its_acknowledgements_repairs_it() -> None:
    """The common case (kill -9 of a follower): the leader stays, and must not
    trust what the follower acknowledged before it lost it."""
    net = Network([A, B, C], seed=2)
    net.elect(A)
    for i in range(6):
        net.propose(A, f"c{i}".encode())
    net.deliver()
    net.tick(1)
    last = net.nodes[A].last_index
    net.crash(B)
    b = restart_damaged(net, B, keep=2)
    assert b.repairing_until is not None and b.last_index == 2
    net.tick(3)
    assert net.nodes[A].is_leader
    assert net.nodes[B].repairing_until is None
    assert net.log(B) == net.log(A) and net.nodes[B].last_index == last
    assert commands(net, B) == commands(net, A)


def test_a_newer_leader_with_a_shorter_log_repairs_it() -> None:
    """B lost entries that never committed; the new leader's log ends before
    them but in a newer term, so matching it is enough (LogPosition order)."""
    net = Network([A, B, C, D, E], seed=3)
    net.elect(A)
    net.propose(A, b"base")
    net.tick(1)
    net.blocked |= {(x, y) for x in (A, B) for y in (C, D, E)}
    net.blocked |= {(y, x) for x in (A, B) for y in (C, D, E)}
    for i in range(5):
        net.propose(A, f"lost{i}".encode())
    net.deliver()
    b_last = net.nodes[B].last_index
    net.crash(A)
    net.crash(B)
    b = restart_damaged(net, B, keep=2)
    assert b.repairing_until is not None and b.repairing_until.index == b_last
    new = net.tick_until_leader([C, D, E])
    assert net.nodes[new].last_index < b_last
    net.heal()
    net.tick(2)
    assert net.nodes[B].repairing_until is None
    assert net.log(B) == net.log(new)


def test_a_snapshot_from_the_leader_repairs_it() -> None:
    net = Network([A, B, C], seed=4)
    net.elect(A)
    for i in range(4):
        net.propose(A, f"c{i}".encode())
    net.deliver()
    net.tick(1)
    net.crash(B)
    for i in range(4):  # the cluster moves on while B is down, then compacts
        net.propose(A, f"d{i}".encode())
    net.deliver()
    net.tick(1)
    snap = net.compact(A)
    b = restart_damaged(net, B, keep=1)
    assert b.repairing_until is not None and b.repairing_until.index < snap.index
    net.tick(3)
    assert net.nodes[B].repairing_until is None
    assert net.nodes[B].first_index == snap.index + 1
    assert commands(net, B) == commands(net, A)


def test_a_node_being_repaired_ignores_every_way_to_start_an_election() -> None:
    net = Network([A, B, C], seed=5)
    net.elect(A)
    net.propose(A, b"x")
    net.tick(1)
    net.crash(A)
    net.crash(B)
    b = restart_damaged(net, B, keep=1)
    term = b.term
    b.campaign()
    for _ in range(10 * net.config.election_ticks):
        b.tick()
    b.step(TimeoutNow(to=B, term=term, leader=A))  # a leadership transfer to it
    assert b.role == Role.FOLLOWER and b.term == term
    messages = b.ready().messages if b.has_ready() else ()
    assert not any(isinstance(m, RequestVote) for m in messages)


@pytest.mark.parametrize("seed", range(8))
def test_simulated_cluster_stays_safe_with_damaged_logs(seed: int) -> None:
    """Crashes that also cut logs short, with loss and partitions; safety is
    checked throughout, and every damaged node is repaired in the end.

    One node in repair at a time: a node in repair does not vote, so with
    more of them than the cluster can lose, no one can be elected until an
    operator acts (that is the point; the intact majority is what is tested)."""
    cluster = RaftCluster(5, seed, network=NetworkConfig.lan(loss=0.1))
    rng = random.Random(seed)
    proposed = 0
    damaged = 0
    for _ in range(40):
        action = rng.random()
        if action < 0.1:
            cluster.partition([rng.sample(range(5), 2)], duration=rng.uniform(0.1, 0.5))
        elif action < 0.3:
            i = rng.randrange(5)
            cluster.crash(i)
            if all((n := cluster.node(j)) is None or n.repairing_until is None for j in range(5)):
                cluster.damage_log(i, rng.randint(1, 8))
                damaged += 1
            cluster.restart(i)
        for _ in range(3):
            if cluster.propose(b"s%d-%d" % (seed, proposed)) is not None:
                proposed += 1
        cluster.run_for(0.1)
        cluster.check_safety()
    cluster.heal()
    for _ in range(3):
        cluster.propose(b"end")
        cluster.run_for(0.5)
    cluster.check_safety()
    assert damaged >= 2
    for i in range(5):
        node = cluster.node(i)
        assert node is not None and node.repairing_until is None, i
