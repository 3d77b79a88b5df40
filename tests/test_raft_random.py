"""Randomized fault schedules over 3- and 5-voter clusters, safety checked at every step.

Each seed draws a schedule: ticks, message delivery out of order, drops,
duplicates, partitions that heal, crashes and restarts from the persisted
state, compaction, and proposals throughout. After every step it checks the
Raft safety properties (paper figure 3): election safety, log matching,
leader completeness, state-machine safety (applied sequences are prefixes of
one another) and that no entry reported committed is ever lost. A failing
seed prints itself; replay one with RAFT_SEED=<n>, scale with RAFT_SEEDS=<n>.
"""

from __future__ import annotations

import os
import random

import pytest

from consensus.log import Entry, EntryKind
from consensus.raft import RaftConfig
from tests.test_raft_scenarios import Network

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


def run_schedule(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice((3, 5))
    ids = [bytes([ord("a") + i]) for i in range(size)]
    config = RaftConfig(
        election_ticks=rng.choice((5, 10)),
        pre_vote=rng.random() < 0.7,
        check_quorum=rng.random() < 0.7,
        max_entries_per_append=rng.choice((1, 4, 64)),
    )
    net = Network(ids, config=config, seed=seed)
    checker = Checker(net)
    loss = rng.uniform(0, MAX_LOSS)
    duplicate = rng.uniform(0, 0.1)
    proposals = 0
    for step in range(STEPS):
        net.flush()
        action = rng.random()
        if action < 0.35:
            for nid in net.live():
                net.nodes[nid].tick()
        elif action < 0.75 and net.queue:
            # A random batch in random order: reordering, loss, duplication.
            for _ in range(rng.randint(1, len(net.queue))):
                if not net.queue:
                    break
                m = net.queue.pop(rng.randrange(len(net.queue)))
                if rng.random() >= loss:
                    if rng.random() < duplicate:
                        net.queue.append(m)
                    net.deliver_one(m)
        elif action < 0.85:
            leaders = net.leaders()
            if leaders:
                proposals += 1
                net.nodes[rng.choice(leaders)].propose(f"{seed}:{proposals}".encode())
        elif action < 0.88:
            live = net.live()
            if len(net.down) < (size - 1) // 2 + 1 and live:
                net.crash(rng.choice(live))
        elif action < 0.92 and net.down:
            net.restart(rng.choice(sorted(net.down)))
        elif action < 0.95:
            cut = set(rng.sample(ids, rng.randrange(1, size)))
            net.blocked = {(a, b) for a in ids for b in ids if (a in cut) != (b in cut)}
        elif action < 0.98:
            net.heal()
        else:
            live = [n for n in net.live() if net.applied_index[n] > net.nodes[n].first_index]
            if live:
                net.compact(rng.choice(live))
        net.flush()
        checker.check(full=step % LOG_CHECK_EVERY == 0)

    # Heal everything: the cluster must recover and keep every committed entry.
    net.heal()
    for nid in sorted(net.down):
        net.restart(nid)
    for _ in range(40 * config.election_ticks):
        net.tick(1)
        checker.check(full=False)
        if len(net.leaders()) == 1:
            break
    (leader,) = net.leaders()
    final = net.nodes[leader].propose(b"final")
    assert final is not None
    net.tick(3)
    checker.check(full=True)
    for nid in ids:
        indexes = [i for i, _ in net.applied[nid]]
        want = [i for i, e in sorted(checker.committed.items()) if e.kind == EntryKind.COMMAND]
        assert indexes == want, f"{nid!r} applied {indexes}, committed {want}"
        assert net.applied[nid][-1][1] == b"final"


def _seeds() -> list[int]:
    if "RAFT_SEED" in os.environ:
        return [int(os.environ["RAFT_SEED"])]
    return list(range(SEEDS))


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
            "replay with RAFT_SEED=<n> pytest tests/test_raft_random.py\n" + "\n".join(failures)
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
