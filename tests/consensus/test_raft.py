"""Scripted Raft scenarios: the paper's hard cases, read top to bottom.

Each test drives a tiny in-memory `Network` of `RaftNode`s by hand: it
persists every Ready to a per-node `Disk` *before* queueing its messages (the
persist-before-send rule), delivers messages only when told, and can block
links, crash nodes and restart them from what is on their disk.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from consensus.log import Entry, EntryKind, HardState, Snapshot
from consensus.raft import (
    AppendEntries,
    Message,
    RaftConfig,
    RaftNode,
    RequestVote,
    Role,
    VoteResponse,
)

A, B, C, D, E = b"a", b"b", b"c", b"d", b"e"
MAX_DELIVERIES = 20_000
"""A scenario that needs more deliveries than this to settle is looping."""


@dataclass
class Disk:
    """What survives a crash: hard state, log, snapshot."""

    hard_state: HardState = field(default_factory=HardState)
    entries: list[Entry] = field(default_factory=list)
    snapshot: Snapshot | None = None


def encode_state(applied: list[tuple[int, bytes]]) -> bytes:
    return json.dumps([[i, d.hex()] for i, d in applied]).encode()


def decode_state(data: bytes) -> list[tuple[int, bytes]]:
    return [(i, bytes.fromhex(d)) for i, d in json.loads(data)]


class Network:
    """Nodes, their disks, their state machines and the messages in flight."""

    def __init__(
        self,
        ids: Iterable[bytes],
        *,
        config: RaftConfig | None = None,
        learners: frozenset[bytes] = frozenset(),
        seed: int = 0,
    ) -> None:
        self.config = config or RaftConfig()
        self.seed = seed
        ids = tuple(ids)
        self.bootstrap_voters = frozenset(ids) - learners
        self.bootstrap_learners = learners
        self.nodes: dict[bytes, RaftNode] = {}
        self.disks: dict[bytes, Disk] = {}
        self.applied: dict[bytes, list[tuple[int, bytes]]] = {}
        self.applied_index: dict[bytes, int] = {}
        self.boot: dict[bytes, tuple[frozenset[bytes], frozenset[bytes]]] = {}
        self.queue: list[Message] = []
        self.blocked: set[tuple[bytes, bytes]] = set()
        self.down: set[bytes] = set()
        self.restarts = 0
        self.on_commit: Callable[[bytes, Entry], None] | None = None
        self.eligible: frozenset[bytes] = frozenset()
        """What every node's driver would take from the ledger (RaftNode.eligible)."""
        for nid in ids:
            self.add_node(nid, voters=self.bootstrap_voters, learners=learners)

    # --- membership of the test network --------------------------------------------

    def add_node(
        self, nid: bytes, *, voters: frozenset[bytes], learners: frozenset[bytes] = frozenset()
    ) -> RaftNode:
        self.boot[nid] = (voters, learners)
        self.disks[nid] = Disk()
        self.applied[nid] = []
        self.applied_index[nid] = 0
        self.nodes[nid] = RaftNode(
            nid, self.config, self._rng(nid), voters=voters, learners=learners
        )
        self.nodes[nid].eligible = self.eligible
        return self.nodes[nid]

    def _rng(self, nid: bytes) -> random.Random:
        return random.Random(f"{self.seed}:{nid.hex()}:{self.restarts}")

    def crash(self, nid: bytes) -> None:
        """Lose everything not on disk (the node's memory and state machine)."""
        self.down.add(nid)

    def restart(self, nid: bytes) -> RaftNode:
        self.restarts += 1
        disk = self.disks[nid]
        voters, learners = self.boot[nid]
        snap = disk.snapshot
        self.applied[nid] = decode_state(snap.data) if snap else []
        self.applied_index[nid] = snap.index if snap else 0
        self.nodes[nid] = RaftNode(
            nid,
            self.config,
            self._rng(nid),
            hard_state=disk.hard_state,
            entries=list(disk.entries),
            snapshot=snap,
            voters=voters,
            learners=learners,
            applied=self.applied_index[nid],
        )
        self.nodes[nid].eligible = self.eligible
        self.down.discard(nid)
        return self.nodes[nid]

    def isolate(self, nid: bytes) -> None:
        for other in self.nodes:
            if other != nid:
                self.blocked |= {(nid, other), (other, nid)}

    def heal(self) -> None:
        self.blocked.clear()

    # --- the driver loop ------------------------------------------------------------

    def live(self) -> list[bytes]:
        return [n for n in self.nodes if n not in self.down]

    def process(self, nid: bytes) -> None:
        """One turn of the driver: persist, then send, then apply, then advance."""
        node = self.nodes[nid]
        if nid in self.down or not node.has_ready():
            return
        rd = node.ready()
        disk = self.disks[nid]
        if rd.snapshot is not None:
            disk.snapshot = rd.snapshot
            disk.entries = []
        if rd.entries:
            first = rd.entries[0].index
            disk.entries = [e for e in disk.entries if e.index < first] + list(rd.entries)
        if rd.hard_state is not None:
            disk.hard_state = rd.hard_state
        self.queue.extend(rd.messages)
        if rd.snapshot is not None:
            self.applied[nid] = decode_state(rd.snapshot.data)
            self.applied_index[nid] = rd.snapshot.index
        for entry in rd.committed:
            assert entry.index == self.applied_index[nid] + 1, "applied out of order"
            self.applied_index[nid] = entry.index
            if entry.kind == EntryKind.COMMAND:
                self.applied[nid].append((entry.index, entry.data))
            if self.on_commit is not None:
                self.on_commit(nid, entry)
        node.advance(rd)

    def flush(self) -> None:
        for nid in self.live():
            self.process(nid)

    def deliverable(self, m: Message) -> bool:
        return m.to not in self.down and (m.sender, m.to) not in self.blocked

    def deliver_one(self, m: Message) -> None:
        if self.deliverable(m):
            self.nodes[m.to].step(m)
            self.process(m.to)

    def deliver(self, drop: Callable[[Message], bool] = lambda m: False) -> None:
        """Deliver until nothing is in flight; blocked or `drop`ped messages are lost."""
        for _ in range(MAX_DELIVERIES):
            self.flush()
            if not self.queue:
                return
            m = self.queue.pop(0)
            if not drop(m):
                self.deliver_one(m)
        raise AssertionError("network did not settle")

    def tick(self, n: int = 1, nodes: Iterable[bytes] | None = None) -> None:
        """Tick (some) live nodes n times, settling the network after each tick."""
        for _ in range(n):
            for nid in list(nodes) if nodes is not None else self.live():
                if nid not in self.down:
                    self.nodes[nid].tick()
            self.deliver()

    # --- helpers ----------------------------------------------------------------------

    def elect(self, nid: bytes, drop: Callable[[Message], bool] = lambda m: False) -> RaftNode:
        """Make `nid` leader: campaign (repeatedly if a vote splits) and settle."""
        node = self.nodes[nid]
        for _ in range(5):
            node.campaign()
            self.deliver(drop)
            if node.is_leader:
                return node
        raise AssertionError(f"{nid!r} could not win an election")

    def tick_until_leader(self, nodes: Iterable[bytes], limit: int = 100) -> bytes:
        """Tick only `nodes` until one of them leads; that one."""
        nodes = list(nodes)
        for _ in range(limit):
            self.tick(1, nodes=nodes)
            leaders = [n for n in nodes if self.nodes[n].is_leader]
            if leaders:
                return leaders[0]
        raise AssertionError("no leader emerged")

    def leaders(self) -> list[bytes]:
        return [n for n in self.live() if self.nodes[n].is_leader]

    def propose(self, nid: bytes, data: bytes) -> int:
        index = self.nodes[nid].propose(data)
        assert index is not None, f"{nid!r} is not accepting proposals"
        self.flush()
        return index

    def log(self, nid: bytes) -> list[tuple[int, int]]:
        node = self.nodes[nid]
        return [(e.index, e.term) for e in node.entries(node.first_index, node.last_index)]

    def compact(self, nid: bytes) -> Snapshot:
        """The application snapshots at what it has applied; disk follows."""
        index = self.applied_index[nid]
        snap = self.nodes[nid].compact(index, encode_state(self.applied[nid]))
        disk = self.disks[nid]
        disk.snapshot = snap
        disk.entries = [e for e in disk.entries if e.index > index]
        return snap


def commands(net: Network, nid: bytes) -> list[bytes]:
    return [data for _, data in net.applied[nid]]


# --- elections --------------------------------------------------------------------


def test_bootstrap_single_voter_elects_itself_on_timeout_and_commits() -> None:
    net = Network([A])
    net.tick(2 * net.config.election_ticks)
    assert net.nodes[A].is_leader
    net.propose(A, b"x")
    assert commands(net, A) == [b"x"]


def test_three_nodes_elect_one_leader_by_ticks_and_replicate() -> None:
    net = Network([A, B, C], seed=3)
    net.tick(2 * net.config.election_ticks)
    (leader,) = net.leaders()
    net.propose(leader, b"x")
    net.deliver()
    net.tick(1)  # the next heartbeat carries the commit index to followers
    assert all(commands(net, n) == [b"x"] for n in (A, B, C))


def test_vote_is_in_the_same_ready_as_the_hard_state_that_records_it() -> None:
    """Persist-before-send: a granted vote must be durable before it leaves."""
    net = Network([A, B, C])
    net.nodes[A].campaign()
    net.flush()
    (request,) = [m for m in net.queue if m.to == B]
    net.queue.clear()
    node = net.nodes[B]
    node.step(request)
    rd = node.ready()
    (response,) = rd.messages
    assert isinstance(request, RequestVote) and isinstance(response, VoteResponse)
    if response.granted and not response.pre_vote:
        assert rd.hard_state is not None and rd.hard_state.vote == A


def test_restart_keeps_term_and_vote() -> None:
    net = Network([A, B, C], config=RaftConfig(pre_vote=False))
    net.elect(A)
    term = net.nodes[A].term
    net.crash(B)
    b = net.restart(B)
    assert (b.term, b.vote) == (term, A)
    # C cannot get B's vote in the same term: B already voted for A.
    b.step(RequestVote(to=B, term=term, candidate=C, last_index=99, last_term=term, pre_vote=False))
    (response,) = b.ready().messages
    assert isinstance(response, VoteResponse) and not response.granted


# --- the paper's hard cases ----------------------------------------------------------


def test_stale_leader_cannot_commit_and_its_entry_is_discarded() -> None:
    net = Network([A, B, C, D, E], config=RaftConfig(check_quorum=False))
    net.elect(A)
    net.isolate(A)
    stale = net.propose(A, b"lost")
    net.tick(3)
    assert net.nodes[A].is_leader and net.nodes[A].commit_index < stale

    new = net.tick_until_leader([B, C, D, E])  # the majority side moves on
    net.propose(new, b"kept")
    net.deliver()
    assert net.nodes[A].commit_index < stale  # still cannot commit

    net.heal()
    net.tick(2)  # the new leader's heartbeat reaches A: A steps down, is repaired
    assert not net.nodes[A].is_leader and net.nodes[A].leader == new
    assert all(commands(net, n) == [b"kept"] for n in net.nodes)
    assert net.log(A) == net.log(new)


def test_log_repair_truncates_a_conflicting_suffix() -> None:
    net = Network([A, B, C])
    net.elect(A)
    net.propose(A, b"base")
    net.tick(1)
    net.isolate(A)
    for i in range(5):  # uncommitted suffix on the old leader only
        net.propose(A, f"old{i}".encode())
    net.tick(net.config.election_ticks * 2, nodes=[B, C])
    (new_leader,) = [n for n in (B, C) if net.nodes[n].is_leader]
    for i in range(3):
        net.propose(new_leader, f"new{i}".encode())
    net.heal()
    net.tick(3)
    assert net.log(A) == net.log(new_leader)
    expected = [b"base", b"new0", b"new1", b"new2"]
    assert all(commands(net, n) == expected for n in net.nodes)


def _figure8_prefix() -> tuple[Network, int, int]:
    """Paper figure 8 (a)-(c): S1 leads, X reaches S2 only; S5 leads a term
    alone; S1 leads again and replicates X (old term) to S3 — a majority —
    but nothing of its own term yet."""
    net = Network(
        [A, B, C, D, E],
        config=RaftConfig(pre_vote=False, check_quorum=False, max_entries_per_append=1),
    )
    net.elect(A)  # (a) NOOP at index 1 committed everywhere
    net.tick(1)
    net.blocked |= {(A, n) for n in (C, D, E)}
    x = net.propose(A, b"X")  # index 2, reaches B only
    net.deliver()
    net.crash(A)
    net.heal()
    net.blocked |= {(E, B), (B, E)}
    net.nodes[E].campaign()  # (b) S5 wins with C, D (their logs are as long as its)
    net.deliver(drop=lambda m: isinstance(m, AppendEntries))  # ...but replicates nothing
    assert net.nodes[E].is_leader
    net.isolate(E)
    net.propose(E, b"Y")  # NOOP at 2 and Y at 3, in E's term, nowhere else
    net.crash(E)
    net.heal()
    net.restart(A)

    # (c) A wins with B and C; a NOOP of the new term goes to index 3. Only
    # X (index 2) may reach C: drop anything carrying index 3.
    def carries_index_3(m: Message) -> bool:
        return isinstance(m, AppendEntries) and any(e.index >= 3 for e in m.entries)

    net.elect(A, drop=carries_index_3)
    net.nodes[A].tick()  # heartbeat: C rejects, A backs off and sends X alone
    net.deliver(drop=carries_index_3)
    return net, x, net.nodes[A].term


def test_figure8_old_term_entry_on_a_majority_is_not_committed() -> None:
    net, x, _ = _figure8_prefix()
    assert net.log(C)[x - 1][1] == net.log(A)[x - 1][1]  # X is on A, B, C
    assert net.nodes[A].commit_index < x  # ... yet not committed: wrong term
    # (d) A crashes; E comes back and may legitimately overwrite X.
    net.crash(A)
    net.restart(E)
    net.elect(E)
    net.tick(2)
    assert all(b"X" not in commands(net, n) for n in net.live())
    assert net.log(B) == net.log(E) and net.log(C) == net.log(E)


def test_figure8_old_term_entry_commits_through_a_current_term_entry() -> None:
    net, x, term = _figure8_prefix()
    net.tick(3)  # (e) now index 3 (A's term) reaches a majority as well
    a = net.nodes[A]
    assert a.commit_index >= x + 1 and a.entries(x + 1, x + 1)[0].term == term
    assert commands(net, A) == [b"X"]


# --- PreVote and CheckQuorum -----------------------------------------------------------


def test_prevote_keeps_a_rejoining_node_from_disrupting_the_leader() -> None:
    net = Network([A, B, C])
    net.elect(A)
    term = net.nodes[A].term
    net.isolate(C)
    net.tick(10 * net.config.election_ticks)  # C pre-campaigns, over and over
    assert net.nodes[C].term == term
    net.heal()
    net.tick(3)
    assert net.nodes[A].is_leader and net.nodes[A].term == term
    assert net.nodes[C].leader == A


def test_without_prevote_a_rejoining_node_does_disrupt() -> None:
    """The contrast case: why PreVote is on by default."""
    net = Network([A, B, C], config=RaftConfig(pre_vote=False))
    net.elect(A)
    term = net.nodes[A].term
    net.isolate(C)
    net.tick(5 * net.config.election_ticks)
    assert net.nodes[C].term > term
    net.heal()
    net.tick(3 * net.config.election_ticks)
    assert max(net.nodes[n].term for n in net.nodes) > term + 1 or not net.nodes[A].is_leader


def test_check_quorum_makes_an_isolated_leader_step_down() -> None:
    net = Network([A, B, C])
    net.elect(A)
    net.isolate(A)
    net.tick(2 * net.config.election_ticks, nodes=[A])
    assert net.nodes[A].role == Role.FOLLOWER and net.nodes[A].leader is None
    assert net.nodes[A].propose(b"x") is None


def test_leader_lease_ignores_vote_requests_from_a_higher_term() -> None:
    net = Network([A, B, C])
    net.elect(A)
    b = net.nodes[B]
    term = b.term
    b.step(RequestVote(to=B, term=term + 5, candidate=C, last_index=50, last_term=term + 4))
    assert b.term == term and b.leader == A and not b.has_ready()


# --- leadership transfer, learners, membership, snapshots ---------------------------------


def test_leadership_transfer_to_a_lagging_follower() -> None:
    net = Network([A, B, C])
    net.elect(A)
    term = net.nodes[A].term
    net.blocked |= {(A, B)}
    net.propose(A, b"x")
    net.deliver()
    net.heal()
    assert net.nodes[A].transfer_leadership(B)
    assert net.nodes[A].propose(b"refused") is None
    net.deliver()
    assert net.nodes[B].is_leader and net.nodes[B].term == term + 1
    assert net.nodes[A].role == Role.FOLLOWER and net.nodes[A].leader == B
    net.tick(1)
    assert all(commands(net, n) == [b"x"] for n in net.nodes)


def test_learner_gets_entries_but_never_votes_or_counts() -> None:
    net = Network([A, B, C, D], learners=frozenset({D}))
    assert net.nodes[D].is_learner and D not in net.nodes[A].voters
    net.elect(A)
    net.propose(A, b"x")
    net.tick(1)
    assert commands(net, D) == [b"x"]
    # The learner never campaigns, however long it waits alone.
    net.isolate(D)
    net.tick(5 * net.config.election_ticks, nodes=[D])
    assert net.nodes[D].role == Role.FOLLOWER
    net.heal()
    # A plus the learner is not a quorum of {A, B, C}.
    net.crash(B)
    net.crash(C)
    index = net.propose(A, b"y")
    net.deliver()
    assert net.nodes[D].last_index >= index and net.nodes[A].commit_index < index


def test_add_learner_promote_to_voter_then_remove_a_voter() -> None:
    net = Network([A, B, C])
    net.elect(A)
    net.propose(A, b"before")
    net.tick(1)
    net.add_node(D, voters=frozenset())  # a joining node knows no configuration
    assert net.nodes[A].propose_config(add_learner=D) is not None
    assert net.nodes[A].propose_config(add_voter=D) is None  # one change at a time
    net.tick(2)
    assert net.nodes[D].is_learner and commands(net, D) == [b"before"]
    assert net.nodes[A].propose_config(add_voter=D) is not None
    net.tick(2)
    assert all(net.nodes[n].voters == {A, B, C, D} for n in net.nodes)
    net.crash(C)
    net.crash(D)  # {A, B} is not a quorum of {A, B, C, D}
    stuck = net.propose(A, b"stuck")
    net.tick(1)
    assert net.nodes[A].commit_index < stuck
    net.restart(C)
    net.restart(D)
    net.tick(2)
    assert net.nodes[A].propose_config(remove=C) is not None
    net.tick(2)
    assert net.nodes[A].voters == {A, B, D}
    net.crash(C)
    net.crash(D)  # {A, B} is a quorum of {A, B, D}: C no longer counts
    net.propose(A, b"after")
    net.tick(1)
    assert commands(net, B)[-1] == b"after"


def _cut_off_mid_promotion(reaches: frozenset[bytes]) -> Network:
    """A leads; B was promoted to voter; A then proposes promoting C, and that
    entry reaches only `reaches` before A is cut off from both."""
    net = Network([A])
    net.elect(A)
    for learner in (B, C):
        net.add_node(learner, voters=frozenset())
        assert net.nodes[A].propose_config(add_learner=learner) is not None
        net.tick(2)
    assert net.nodes[A].propose_config(add_voter=B) is not None
    net.tick(2)
    assert net.nodes[B].voters == {A, B}
    assert net.nodes[A].propose_config(add_voter=C) is not None
    promotion = net.nodes[A].last_index

    def lost(m: Message) -> bool:
        carries = isinstance(m, AppendEntries) and any(e.index == promotion for e in m.entries)
        return carries and m.to not in reaches

    net.nodes[A].tick()
    net.deliver(lost)
    net.isolate(A)
    return net


def test_a_promotion_that_reached_either_follower_lets_the_two_elect() -> None:
    # Whichever of B and C holds the newer configuration {A, B, C}, the two
    # of them are its majority: the one that holds it campaigns, and the
    # other votes for it even while it is still a learner in its own eyes
    # (a vote is asked of whoever the candidate's configuration names).
    for holder in (B, C):
        net = _cut_off_mid_promotion(frozenset({holder}))
        assert net.nodes[holder].voters == {A, B, C}
        leader = net.tick_until_leader([B, C], limit=20 * net.config.election_ticks)
        assert net.nodes[leader].voters == {A, B, C}


def test_a_promotion_that_reached_no_one_leaves_no_majority_on_the_cut_side() -> None:
    # B and C hold {A, B} with C a learner: B needs A's vote, C never
    # campaigns. No leader is right here, and the process tests wait until
    # every node holds the full configuration before they cut a leader off.
    net = _cut_off_mid_promotion(frozenset())
    assert net.nodes[B].voters == net.nodes[C].voters == {A, B}
    net.tick(20 * net.config.election_ticks, nodes=[B, C])
    assert not net.nodes[B].is_leader and not net.nodes[C].is_leader


def test_removed_leader_steps_down_once_the_change_commits() -> None:
    net = Network([A, B, C])
    net.elect(A)
    assert net.nodes[A].propose_config(remove=A) is not None
    net.tick(1)
    assert not net.nodes[A].is_leader
    net.tick(3 * net.config.election_ticks, nodes=[B, C])
    assert len(net.leaders()) == 1 and net.leaders()[0] in (B, C)


def test_a_node_that_an_uncommitted_change_removes_still_campaigns_when_needed() -> None:
    # Thesis §4.2.2, found by the randomized schedules. B leads {A, B} and
    # proposes removing itself, but the entry never reaches A.
    net = Network([A, B])
    net.elect(B)
    net.isolate(B)
    assert net.nodes[B].propose_config(remove=B) is not None
    net.tick(2 * net.config.election_ticks, nodes=[B])  # CheckQuorum: B steps down
    assert net.nodes[B].role == Role.FOLLOWER
    assert net.nodes[B].voters == {A} and net.nodes[A].voters == {A, B}
    net.heal()
    # A needs B's vote, but B's log is newer, so B refuses it; only B can end
    # this. B campaigns under {A} (its own vote does not count), A votes for
    # it, B commits its removal and steps down, and A then leads alone.
    net.tick(6 * net.config.election_ticks)
    assert net.leaders() == [A]
    assert net.nodes[A].voters == {A} and net.nodes[B].voters == {A}
    assert net.nodes[A].commit_index == net.nodes[A].last_index


def test_lagging_follower_catches_up_through_a_snapshot() -> None:
    net = Network([A, B, C])
    net.elect(A)
    net.crash(C)
    for i in range(20):
        net.propose(A, f"v{i}".encode())
    net.tick(1)
    snap = net.compact(A)
    assert net.nodes[A].first_index == snap.index + 1
    net.restart(C)
    net.tick(2)
    assert net.disks[C].snapshot == snap
    assert commands(net, C) == commands(net, A)
    net.propose(A, b"after")
    net.tick(1)
    assert commands(net, C)[-1] == b"after"
    # And C restarts from its own snapshot plus log.
    net.crash(C)
    net.restart(C)
    net.tick(1)
    assert commands(net, C) == commands(net, A)


def test_garbage_from_peers_is_dropped_not_raised() -> None:
    node = RaftNode(A, RaftConfig(), random.Random(0), voters=frozenset({A, B, C}))
    bad: list[object] = [
        object(),
        AppendEntries(to=B, term=1, leader=C, prev_index=0, prev_term=0, entries=(), commit=0),
        AppendEntries(
            to=A,
            term=1,
            leader=C,
            prev_index=0,
            prev_term=0,
            entries=(Entry(1, 5, EntryKind.COMMAND),),
            commit=9,
        ),
        AppendEntries(
            to=A,
            term=1,
            leader=C,
            prev_index=0,
            prev_term=0,
            entries=(Entry(1, 1, EntryKind.CONFIG, b"\xff"),),
            commit=0,
        ),
        RequestVote(to=A, term=-1, candidate=B, last_index=0, last_term=0),
    ]
    for message in bad:
        node.step(message)  # type: ignore[arg-type]
    assert node.term == 0 and node.last_index == 0
