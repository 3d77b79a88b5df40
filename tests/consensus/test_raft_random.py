"""Randomized fault schedules over 3- and 5-voter clusters, safety checked at every step.

Each seed draws a schedule: ticks, message delivery out of order, drops,
duplicates, partitions that heal, crashes and restarts from the persisted
state, pauses (a node that stops running but keeps its memory, like a
stopped process or a long GC, then resumes with stale beliefs), single-server
configuration changes (learners added and promoted, voters and learners
removed, the leader included), compaction, proposals throughout, and a
stranger (a key that never joined) forging every kind of message at any
term; no node may ever take its term, follow it or count it. After every step it checks the
Raft safety properties (paper figure 3): election safety, log matching,
leader completeness, state-machine safety (applied sequences are prefixes of
one another) and that no entry reported committed is ever lost. A failing
seed prints itself; replay one with RAFT_SEED=<n>, scale with RAFT_SEEDS=<n>.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import pytest

from consensus.log import Entry, EntryKind, Snapshot
from consensus.raft import (
    AppendEntries,
    AppendResponse,
    InstallSnapshot,
    Message,
    RaftConfig,
    RequestVote,
    TimeoutNow,
    VoteResponse,
    encode_config,
)
from tests.consensus.test_raft import Network

SEEDS = int(os.environ.get("RAFT_SEEDS", "2000"))  # the issue asks for >= 2,000 schedules
"""200 seeds keep this test at a few seconds; the lead scales it in CI."""
STEPS = 400
"""Enough steps for several elections, crashes and partitions per seed."""
MAX_LOSS = 0.3
"""The issue's fault model: 0-30% message loss."""
LOG_CHECK_EVERY = 10
"""Log matching is quadratic in nodes and log length; check it every few steps."""


class Checker:
    """Safety invariants over a running Network."""

    def __init__(self, net: Network) -> None:
        self.net = net
        self.leader_of_term: dict[int, bytes] = {}
        self.committed: dict[int, Entry] = {}
        self.checked_leaders: set[tuple[int, bytes]] = set()
        net.on_commit = self.record_commit

    def record_commit(self, nid: bytes, entry: Entry) -> None:
        seen = self.committed.setdefault(entry.index, entry)
        assert seen == entry, f"{nid!r} applied {entry} but {seen} was committed there"

    def check(self, full: bool) -> None:
        net = self.net
        for nid in net.live():
            node = net.nodes[nid]
            if node.is_leader:
                other = self.leader_of_term.setdefault(node.term, nid)
                assert other == nid, f"two leaders in term {node.term}: {other!r}, {nid!r}"
                if (node.term, nid) not in self.checked_leaders:
                    self.checked_leaders.add((node.term, nid))
                    self.check_leader_completeness(nid)
            # applied state is a prefix of the committed truth
            for index, data in net.applied[nid]:
                truth = self.committed.get(index)
                if truth is not None:
                    assert truth.data == data, f"{nid!r} applied {data!r} at {index}"
        if full:
            self.check_log_matching()

    def check_leader_completeness(self, nid: bytes) -> None:
        node = self.net.nodes[nid]
        for index, entry in self.committed.items():
            if index < node.first_index:
                continue  # in the snapshot, which holds only committed state
            held = node.entries(index, index)
            assert held == (entry,), f"leader {nid!r} (term {node.term}) lacks committed {entry}"

    def check_log_matching(self) -> None:
        net = self.net
        logs = {}
        for nid in net.live():
            node = net.nodes[nid]
            logs[nid] = {e.index: e for e in node.entries(node.first_index, node.last_index)}
        ids = sorted(logs)
        for i, a in enumerate(ids):
            for b in ids[i + 1 :]:
                la, lb = logs[a], logs[b]
                common = sorted(set(la) & set(lb), reverse=True)
                for k, index in enumerate(common):
                    if la[index].term == lb[index].term:
                        for j in common[k:]:
                            assert la[j] == lb[j], f"logs of {a!r}, {b!r} differ at {j}"
                        break


SPARES = 2
"""Nodes that start outside the configuration, for changes to add."""
STRANGER = b"x"
"""A key that never joined: it forges every kind of message, at any term."""
FORGED_TERM = 10**15
"""Far above any term a schedule reaches: a node that took one would show it."""


def forge(rng: random.Random, to: bytes) -> Message:
    """One message from STRANGER, each kind a way to take over or disrupt."""
    term = rng.choice((1, 2, FORGED_TERM))
    takeover = Entry(term, 1, EntryKind.CONFIG, encode_config(frozenset({STRANGER}), frozenset()))
    choices: list[Message] = [
        RequestVote(to=to, term=term, candidate=STRANGER, last_index=10**9, last_term=term),
        RequestVote(to=to, term=term, candidate=STRANGER, last_index=10**9, last_term=term,
                    pre_vote=True, transfer=True),
        AppendEntries(to=to, term=term, leader=STRANGER, prev_index=0, prev_term=0,
                      entries=(takeover,), commit=1),
        InstallSnapshot(to=to, term=term, leader=STRANGER,
                        snapshot=Snapshot(10**6, term, frozenset({STRANGER}), frozenset(), b"")),
        TimeoutNow(to=to, term=term, leader=STRANGER),
        VoteResponse(to=to, term=term, voter=STRANGER, granted=True),
        AppendResponse(to=to, term=term, follower=STRANGER, success=True, match_index=10**9),
    ]  # fmt: skip
    return rng.choice(choices)


def change_configuration(net: Network, rng: random.Random, leader: bytes) -> None:
    """Let `leader` propose one random single-server change (it refuses
    while an earlier change is uncommitted)."""
    node = net.nodes[leader]
    members = node.voters | node.learners
    outsiders = sorted(set(net.nodes) - members)
    kind = rng.choice(("add_learner", "promote", "remove"))
    if kind == "add_learner" and outsiders:
        node.propose_config(add_learner=rng.choice(outsiders))
    elif kind == "promote" and node.learners:
        node.propose_config(add_voter=rng.choice(sorted(node.learners)))
    elif kind == "remove" and len(members) > 1:
        target = rng.choice(sorted(members))
        if node.voters - {target}:
            node.propose_config(remove=target)


def run_schedule(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice((3, 5))
    ids = [bytes([ord("a") + i]) for i in range(size)]
    spares = [bytes([ord("v") + i]) for i in range(SPARES)]
    config = RaftConfig(
        election_ticks=rng.choice((5, 10)),
        pre_vote=rng.random() < 0.7,
        check_quorum=rng.random() < 0.7,
        max_entries_per_append=rng.choice((1, 4, 64)),
    )
    net = Network(ids, config=config, seed=seed)
    # Every node the schedule may promote is eligible, as the ledger would
    # say; the stranger is not, and speaks throughout (`forge`).
    net.eligible = frozenset(ids + spares)
    for nid in ids:
        net.nodes[nid].eligible = net.eligible
    for nid in spares:
        net.add_node(nid, voters=frozenset())
    everyone = ids + spares
    paused: set[bytes] = set()
    checker = Checker(net)
    loss = rng.uniform(0, MAX_LOSS)
    duplicate = rng.uniform(0, 0.1)
    proposals = 0
    for step in range(STEPS):
        net.flush()
        action = rng.random()
        running = [n for n in net.live() if n not in paused]
        if action < 0.35:
            for nid in running:
                net.nodes[nid].tick()
        elif action < 0.73 and net.queue:
            # A random batch in random order: reordering, loss, duplication.
            # Messages to a paused node wait in the queue until it resumes.
            for _ in range(rng.randint(1, len(net.queue))):
                # (range: the same draw as the list it stands for, built
                # only when some node is paused)
                ready: Sequence[int] = range(len(net.queue))
                if paused:
                    ready = [i for i, m in enumerate(net.queue) if m.to not in paused]
                if not ready:
                    break
                m = net.queue.pop(rng.choice(ready))
                if rng.random() >= loss:
                    if rng.random() < duplicate:
                        net.queue.append(m)
                    net.deliver_one(m)
        elif action < 0.83:
            leaders = [n for n in net.leaders() if n not in paused]
            if leaders:
                proposals += 1
                net.nodes[rng.choice(leaders)].propose(f"{seed}:{proposals}".encode())
        elif action < 0.85:
            leaders = [n for n in net.leaders() if n not in paused]
            if leaders:
                change_configuration(net, rng, rng.choice(leaders))
        elif action < 0.87:
            live = net.live()
            if len(net.down) < (size - 1) // 2 + 1 and live:
                victim = rng.choice(live)
                net.crash(victim)
                paused.discard(victim)
        elif action < 0.90 and net.down:
            net.restart(rng.choice(sorted(net.down)))
        elif action < 0.92:
            if running and rng.random() < 0.5:
                paused.add(rng.choice(running))
            elif paused:
                paused.discard(rng.choice(sorted(paused)))
        elif action < 0.935:
            target = rng.choice(everyone)
            if target not in net.down:
                net.nodes[target].step(forge(rng, target))
                net.process(target)
                net.queue = [m for m in net.queue if m.to != STRANGER]  # its answers
        elif action < 0.95:
            cut = set(rng.sample(everyone, rng.randrange(1, len(everyone))))
            net.blocked = {(a, b) for a in everyone for b in everyone if (a in cut) != (b in cut)}
        elif action < 0.98:
            net.heal()
        else:
            live = [n for n in net.live() if net.applied_index[n] > net.nodes[n].first_index]
            if live:
                net.compact(rng.choice(live))
        net.flush()
        checker.check(full=step % LOG_CHECK_EVERY == 0)
        for node in net.nodes.values():
            assert node.term < FORGED_TERM, f"{node.node_id!r} took a stranger's term"
            assert STRANGER not in node.voters | node.learners
            assert node.leader != STRANGER

    # Heal everything: the cluster must recover and keep every committed entry.
    paused.clear()
    net.heal()
    for nid in sorted(net.down):
        net.restart(nid)
    # Then a last command must reach every member of the final
    # configuration. A leader that an earlier change removes steps down when
    # that change commits, and entries it took after the change may be lost
    # (never acknowledged): propose again under each new leader. Bounded.
    proposed_in: tuple[bytes, int] | None = None
    members: frozenset[bytes] = frozenset()
    for _ in range(60 * config.election_ticks):
        net.tick(1)
        checker.check(full=False)
        leaders = net.leaders()
        if len(leaders) != 1:
            continue
        node = net.nodes[leaders[0]]
        if proposed_in != (leaders[0], node.term) and node.propose(b"final") is not None:
            proposed_in = (leaders[0], node.term)
        members = node.voters | node.learners
        if all(net.applied[n] and net.applied[n][-1][1] == b"final" for n in members):
            break
    assert members, "no leader after healing"
    checker.check(full=True)
    # Every node in the final configuration holds every committed command;
    # nodes removed on the way stop receiving entries, by design.
    for nid in sorted(members):
        indexes = [i for i, _ in net.applied[nid]]
        want = [i for i, e in sorted(checker.committed.items()) if e.kind == EntryKind.COMMAND]
        assert indexes == want, f"{nid!r} applied {indexes}, committed {want}"
        assert net.applied[nid][-1][1] == b"final"


def _seeds() -> list[int]:
    if "RAFT_SEED" in os.environ:
        return [int(os.environ["RAFT_SEED"])]
    return list(range(SEEDS))


@pytest.mark.slow  # minutes of CPU: `make test` runs it, `make check` leaves it
def test_random_fault_schedules_keep_raft_safe() -> None:
    failures = []
    for seed in _seeds():
        try:
            run_schedule(seed)
        except AssertionError as exc:
            failures.append(f"seed {seed}: {exc}")
            if len(failures) >= 5:
                break
    if failures:
        pytest.fail(
            "replay with RAFT_SEED=<n> pytest tests/consensus/test_raft_random.py\n"
            + "\n".join(failures)
        )


def test_same_seed_replays_identically() -> None:
    """Determinism: the same seed gives the same logs (run each seed twice)."""

    def logs(seed: int) -> list[list[Entry]]:
        net = Network([b"a", b"b", b"c"], seed=seed)
        rng = random.Random(seed)
        for _ in range(200):
            net.flush()
            if rng.random() < 0.5:
                for nid in net.live():
                    net.nodes[nid].tick()
            elif net.queue:
                net.deliver_one(net.queue.pop(rng.randrange(len(net.queue))))
            for nid in net.leaders():
                net.nodes[nid].propose(b"x")
        return [list(net.nodes[n].entries(1, net.nodes[n].last_index)) for n in net.nodes]

    assert logs(7) == logs(7)
