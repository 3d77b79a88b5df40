"""A cluster of real `RaftNode`s on the simulated network, in virtual time.

The sans-IO Raft core (`consensus.raft`) is proven step by step by the
scripted and randomized tests; this harness answers the questions those
cannot: how long does failover take when ticks are real intervals and
messages have real latency, and does the driver contract (persist, then
send, then apply, then advance) hold when crashes land between any two
events. It is the simulator's counterpart of the trio driver: the same loop
over `tick`/`step`/`propose`/`ready`/`advance`, with the disk replaced by an
in-memory durable copy per node and the clock by `simulations.loop`.

Determinism: every source of randomness is a `component_rng` stream of the
run seed (the network, each node's core per life, each node's tick phase),
so a seed replays exactly; `trace_digest` makes "run it twice and compare"
one string comparison.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from consensus.log import Entry, HardState, LogPosition, Snapshot
from consensus.raft import Message, RaftConfig, RaftNode, Ready, Role
from simulations.loop import EventLoop, Timer
from simulations.network import Network, NetworkConfig, Partition
from simulations.seeds import component_rng

__all__ = ["Commit", "Proposal", "RaftCluster", "SafetyViolation"]


class SafetyViolation(AssertionError):
    """A Raft safety property failed; the message names the property and the nodes."""


@dataclass(frozen=True, slots=True)
class Proposal:
    """A command accepted by a leader: committed once `index` holds `term`'s entry."""

    node: int
    term: int
    index: int
    at: float


@dataclass(frozen=True, slots=True)
class Commit:
    """The first time anyone applied the entry at `index` (the cluster-wide commit)."""

    index: int
    term: int
    at: float
    node: int


@dataclass
class _Durable:
    """What a node's disk holds: survives `crash`, is all that `restart` sees."""

    hard_state: HardState = field(default_factory=HardState)
    snapshot: Snapshot | None = None
    entries: list[Entry] = field(default_factory=list)
    applied: int = 0
    """How far the node's state machine got. Kept with the disk because the
    simulated state machine is the applied log itself (`_SimRaft.applied`)."""
    repair: LogPosition | None = None
    """What the real store's marker records after a damaged log
    (`RaftCluster.damage_log`): the node restarts in repair until a
    persisted log reaches this position."""

    def position(self) -> LogPosition:
        if self.entries:
            return LogPosition(term=self.entries[-1].term, index=self.entries[-1].index)
        if self.snapshot is not None:
            return LogPosition(term=self.snapshot.term, index=self.snapshot.index)
        return LogPosition(term=0, index=0)

    def persist(self, rd: Ready) -> None:
        """Steps 1-3 of the driver contract, in the core's documented order."""
        if rd.snapshot is not None:
            self.snapshot = rd.snapshot
            self.entries = []
        if rd.entries:
            base = self.snapshot.index if self.snapshot is not None else 0
            del self.entries[rd.entries[0].index - base - 1 :]
            self.entries.extend(rd.entries)
        if rd.hard_state is not None:
            self.hard_state = rd.hard_state
        if self.repair is not None and self.position() >= self.repair:
            self.repair = None


@dataclass
class _SimRaft:
    """One simulated process: its core (None while crashed) and its disk."""

    index: int
    node_id: bytes
    durable: _Durable = field(default_factory=_Durable)
    raft: RaftNode | None = None
    life: int = 0
    """Bumped on every start, so callbacks from a previous life are ignored."""
    tick: Timer | None = None
    applied: list[Entry] = field(default_factory=list)
    """The state machine: every committed entry in apply order (all lives)."""
    role: Role = Role.FOLLOWER
    term: int = 0


class RaftCluster:
    """`voters` Raft nodes, all voters from the start, on a simulated LAN.

    `learners` more nodes start as learners of that configuration, and
    `joiners` more start with none at all, as a node joining a running swarm
    does (it learns its configuration from the leader once one adds it:
    `propose_config`). `node_ids` names the nodes in that order (default
    `n0`, `n1`, ...; the ledger wants 32-byte ids). `on_message(dst,
    message)` sees each message as it is delivered, before the core does
    (`network.sent_messages` and `received_messages` count them per node).

    Each node ticks every `tick_s` of virtual time (its phase drawn per
    node, as independent processes would be), so with the defaults the
    election timeout is 10-20 ticks = 150-300 ms, the thesis's setup.
    Every Ready is persisted to the node's in-memory disk before its
    messages go out; `fsync_s` > 0 delays that whole step (the disk write
    and everything after it) to model a slow fsync.
    """

    def __init__(
        self,
        voters: int,
        seed: int,
        *,
        learners: int = 0,
        joiners: int = 0,
        node_ids: Sequence[bytes] | None = None,
        tick_s: float = 0.015,
        election_ticks: int = 10,
        network: NetworkConfig | None = None,
        raft_config: RaftConfig | None = None,
        fsync_s: float = 0.0,
        keep_trace: bool = False,
    ) -> None:
        if voters < 1:
            raise ValueError("a cluster needs at least one voter")
        if learners < 0 or joiners < 0:
            raise ValueError("learners and joiners must be non-negative")
        total = voters + learners + joiners
        ids = [f"n{i}".encode() for i in range(total)] if node_ids is None else list(node_ids)
        if len(ids) != total or len(set(ids)) != total:
            raise ValueError(f"need {total} distinct node ids, got {len(ids)}")
        if tick_s <= 0 or fsync_s < 0:
            raise ValueError("tick_s must be positive and fsync_s non-negative")
        self.seed = seed
        self.tick_s = tick_s
        self.fsync_s = fsync_s
        self.config = raft_config or RaftConfig(election_ticks=election_ticks)
        self.loop = EventLoop()
        self.network = Network(
            self.loop,
            network or NetworkConfig.lan(),
            component_rng(seed, "network"),
            self._deliver,
            n=total,
        )
        self.nodes = [_SimRaft(i, node_id) for i, node_id in enumerate(ids)]
        self._index_of = {s.node_id: s.index for s in self.nodes}
        self._voter_ids = frozenset(ids[:voters])
        self._learner_ids = frozenset(ids[voters : voters + learners])
        self._bootstrapped = voters + learners
        """Nodes below this index start with the configuration; the rest join."""
        self.on_message: Callable[[int, Message], None] | None = None
        self.leader_of_term: dict[int, int] = {}
        """Every (term -> leader) ever observed: the election-safety record."""
        self.elected_at: dict[int, float] = {}
        self.committed: dict[int, Commit] = {}
        """Cluster-wide commit record, index -> first application anywhere."""
        self._committed_entries: dict[int, Entry] = {}
        self.first_commit_in_term: dict[int, float] = {}
        """term -> when its leader first applied an entry of that term: the
        moment the leader was "able to commit" (failover's end point)."""
        self.violations: list[str] = []
        self.proposals: list[Proposal] = []
        self.on_commit: Callable[[int, Entry], None] | None = None
        self.on_role: Callable[[int], None] | None = None
        """Called with a node's index after its role or term changed, or it
        crashed or restarted: an observer of who leads sees every transition
        as it happens instead of sampling."""
        self._trace = hashlib.sha256()
        self.trace_lines: list[str] | None = [] if keep_trace else None
        for s in self.nodes:
            self._start(s)

    # --- clock ----------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.loop.now

    def run_until(self, until: float) -> None:
        self.loop.run_until(until)

    def run_for(self, duration: float) -> None:
        self.loop.run_until(self.loop.now + duration)

    def run_while(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Run while `predicate()` holds, at most `timeout` virtual seconds;
        returns its last value (False: it stopped holding in time)."""
        return self.loop.run_while(predicate, self.loop.now + timeout)

    # --- observers --------------------------------------------------------------

    def node(self, i: int) -> RaftNode | None:
        """Node `i`'s live core, or None while it is crashed."""
        return self.nodes[i].raft

    def is_up(self, i: int) -> bool:
        return self.nodes[i].raft is not None

    def leader(self) -> int | None:
        """The unique leader of the highest term any live node is in, or None.

        A deposed leader still in an older term (say, on the minority side
        of a partition) is not "the" leader, and while an election in a
        newer term is undecided there is none.
        """
        live = [s.raft for s in self.nodes if s.raft is not None]
        if not live:
            return None
        top = max(r.term for r in live)
        leaders = [self._index_of[r.node_id] for r in live if r.term == top and r.is_leader]
        return leaders[0] if len(leaders) == 1 else None

    def term(self, i: int) -> int:
        s = self.nodes[i]
        return s.raft.term if s.raft is not None else s.durable.hard_state.term

    def commit_index(self, i: int) -> int:
        """Node `i`'s commit index (its durable one while crashed)."""
        s = self.nodes[i]
        return s.raft.commit_index if s.raft is not None else s.durable.hard_state.commit

    def applied(self, i: int) -> list[Entry]:
        """Entries node `i`'s state machine applied, in order."""
        return list(self.nodes[i].applied)

    def is_committed(self, proposal: Proposal) -> bool:
        """True once the proposal's own entry (not a replacement) is committed."""
        commit = self.committed.get(proposal.index)
        return commit is not None and commit.term == proposal.term

    def trace_digest(self) -> str:
        """sha256 (hex) over the trace so far: same seed, same digest."""
        return self._trace.hexdigest()

    # --- actions ----------------------------------------------------------------

    def _leading(self, on: int | None) -> int | None:
        """The current leader, or node `on` if it believes it leads; None otherwise."""
        i = self.leader() if on is None else on
        if i is None:
            return None
        raft = self.nodes[i].raft
        return i if raft is not None and raft.is_leader else None

    def propose(self, data: bytes, on: int | None = None) -> Proposal | None:
        """Propose `data` on the current leader, or on node `on` if it
        believes it leads (a deposed leader that has not noticed yet
        accepts proposals that will never commit); None if there is no such
        leader (or it refuses, e.g. during a leadership transfer)."""
        i = self._leading(on)
        if i is None:
            return None
        s = self.nodes[i]
        assert s.raft is not None
        index = s.raft.propose(data)
        if index is None:
            return None
        proposal = Proposal(i, s.raft.term, index, self.loop.now)
        self.proposals.append(proposal)
        self._record(f"propose {i} {proposal.term} {index}")
        self._after_input(s)
        return proposal

    def propose_config(
        self,
        on: int | None = None,
        *,
        add_voter: bytes | None = None,
        add_learner: bytes | None = None,
        remove: bytes | None = None,
    ) -> Proposal | None:
        """Propose one configuration change (`RaftNode.propose_config`) on the
        current leader, or on node `on`; None if there is no such leader or
        it refuses (an earlier change is still uncommitted)."""
        i = self._leading(on)
        if i is None:
            return None
        s = self.nodes[i]
        assert s.raft is not None
        index = s.raft.propose_config(add_voter=add_voter, add_learner=add_learner, remove=remove)
        if index is None:
            return None
        proposal = Proposal(i, s.raft.term, index, self.loop.now)
        self._record(f"propose_config {i} {proposal.term} {index}")
        self._after_input(s)
        return proposal

    def crash(self, i: int) -> None:
        """Kill node `i` now: its memory is gone, its disk stays."""
        s = self.nodes[i]
        if s.raft is None:
            return
        s.raft = None
        s.life += 1
        if s.tick is not None:
            s.tick.cancel()
            s.tick = None
        self.network.crash(i)
        self._record(f"crash {i}")
        if self.on_role is not None:
            self.on_role(i)

    def restart(self, i: int) -> None:
        """Start node `i` again from exactly what it had persisted."""
        s = self.nodes[i]
        if s.raft is not None:
            return
        self.network.revive(i)
        self._start(s)
        self._record(f"restart {i}")
        if self.on_role is not None:
            self.on_role(i)

    def damage_log(self, i: int, lose: int) -> None:
        """While node `i` is down, its disk loses its last `lose` log entries
        (and the commit index with them), as a WAL cut short by a crash or a
        disk fault does. Term and vote survive, as the real store restores
        them from its marker; the marker also makes the next start a repair
        (`RaftNode(repair_until=...)`) through the entry that was last."""
        s = self.nodes[i]
        if s.raft is not None:
            raise ValueError("damage_log needs a crashed node")
        d = s.durable
        lose = min(lose, len(d.entries))
        if lose <= 0:
            return
        owed = d.position()
        del d.entries[-lose:]
        last = d.position().index
        d.hard_state = replace(d.hard_state, commit=min(d.hard_state.commit, last))
        # The real node rebuilds its state machine from snapshot and log.
        d.applied = min(d.applied, d.hard_state.commit)
        s.applied = [e for e in s.applied if e.index <= d.applied]
        d.repair = owed if d.repair is None else max(d.repair, owed)
        self._record(f"damage {i} {lose}")

    def partition(self, groups: Iterable[Iterable[int]], duration: float = math.inf) -> Partition:
        """Split the nodes into `groups` from now for `duration` (see `Network`)."""
        return self.network.schedule_partition(groups, self.loop.now, self.loop.now + duration)

    def heal(self) -> None:
        self.network.heal_all()

    # --- safety -------------------------------------------------------------------

    def check_safety(self) -> None:
        """Raise `SafetyViolation` if any Raft safety property has failed so far.

        Checked continuously while running: at most one leader per term, and
        every application of an index agrees with the first one. Checked
        here over the current state: logs (memory for live nodes, disk for
        crashed ones) agree on every index both have committed, and every
        current leader holds every entry committed before it was elected
        (leader completeness: entries committed in earlier terms). A stale
        leader that has not yet noticed a newer term rightly lacks what that
        term's leader committed since.
        """
        problems = list(self.violations)
        logs: list[tuple[int, int, dict[int, Entry]]] = []
        for s in self.nodes:
            if s.raft is not None:
                commit = s.raft.commit_index
                held = s.raft.entries(s.raft.first_index, commit)
            else:
                commit = s.durable.hard_state.commit
                held = tuple(e for e in s.durable.entries if e.index <= commit)
            logs.append((s.index, commit, {e.index: e for e in held}))
        for a, (i, _, log_i) in enumerate(logs):
            for j, _, log_j in logs[a + 1 :]:
                for index in log_i.keys() & log_j.keys():
                    if log_i[index] != log_j[index]:
                        problems.append(
                            f"committed logs differ at {index}: node {i} "
                            f"{log_i[index]} vs node {j} {log_j[index]}"
                        )
                        break
            for index, entry in log_i.items():
                truth = self._committed_entries.get(index)
                if truth is not None and truth != entry:
                    problems.append(f"node {i} committed {entry} at {index}, cluster had {truth}")
        for s in self.nodes:
            r = s.raft
            if r is None or not r.is_leader:
                continue
            elected = self.elected_at[r.term]
            for index, truth in self._committed_entries.items():
                if self.committed[index].at >= elected:
                    continue  # perhaps committed in a later term than r's
                if index >= r.first_index and r.entries(index, index) != (truth,):
                    problems.append(f"leader {s.index} (term {r.term}) lacks committed {truth}")
                    break
        if problems:
            raise SafetyViolation(f"seed {self.seed}: " + "; ".join(problems[:5]))

    # --- the driver -----------------------------------------------------------------

    def _start(self, s: _SimRaft) -> None:
        s.life += 1
        d = s.durable
        joiner = s.index >= self._bootstrapped
        s.raft = RaftNode(
            s.node_id,
            self.config,
            component_rng(self.seed, "raft", s.index, s.life),
            hard_state=d.hard_state,
            entries=tuple(d.entries),
            snapshot=d.snapshot,
            voters=frozenset() if joiner else self._voter_ids,
            learners=frozenset() if joiner else self._learner_ids,
            applied=d.applied,
            repair_until=d.repair,
        )
        s.role, s.term = s.raft.role, s.raft.term
        # Independent processes tick out of phase with each other; drawing
        # the phase per life keeps a restart from lining up with the others.
        phase = component_rng(self.seed, "phase", s.index, s.life).random() * self.tick_s
        s.tick = self.loop.call_later(phase, self._tick, s)

    def _tick(self, s: _SimRaft) -> None:
        s.tick = self.loop.call_later(self.tick_s, self._tick, s)
        assert s.raft is not None
        s.raft.tick()
        self._after_input(s)

    def _deliver(self, dst: int, message: Message) -> None:
        s = self.nodes[dst]
        if s.raft is None:
            return
        if self.on_message is not None:
            self.on_message(dst, message)
        s.raft.step(message)
        self._after_input(s)

    def _after_input(self, s: _SimRaft) -> None:
        r = s.raft
        assert r is not None
        if r.role != s.role or r.term != s.term:
            s.role, s.term = r.role, r.term
            self._record(f"role {s.index} {r.role} {r.term}")
            if r.is_leader:
                other = self.leader_of_term.setdefault(r.term, s.index)
                if other != s.index:
                    self.violations.append(f"two leaders in term {r.term}: {other} and {s.index}")
                self.elected_at.setdefault(r.term, self.loop.now)
            if self.on_role is not None:
                self.on_role(s.index)
        while r.has_ready():
            rd = r.ready()
            if self.fsync_s > 0:
                self.loop.call_later(self.fsync_s, self._synced, (s, s.life, rd))
                return
            self._carry_out(s, rd)

    def _synced(self, item: tuple[_SimRaft, int, Ready]) -> None:
        s, life, rd = item
        if s.life != life or s.raft is None:
            return  # crashed mid-fsync: nothing was durable, nothing was sent
        self._carry_out(s, rd)
        self._after_input(s)

    def _carry_out(self, s: _SimRaft, rd: Ready) -> None:
        """The driver contract: persist, then send, then apply, then advance."""
        r = s.raft
        assert r is not None
        s.durable.persist(rd)
        send = self.network.send
        index_of = self._index_of
        for m in rd.messages:
            dst = index_of.get(m.to)
            if dst is None:
                self.network.drops["unknown_addr"] += 1
            else:
                send(s.index, dst, m)
        if rd.snapshot is not None:
            s.applied = [e for e in s.applied if e.index <= rd.snapshot.index]
        for entry in rd.committed:
            self._apply(s, r, entry)
        if rd.committed:
            s.durable.applied = rd.committed[-1].index
        elif rd.snapshot is not None:
            s.durable.applied = rd.snapshot.index
        r.advance(rd)

    def _apply(self, s: _SimRaft, r: RaftNode, entry: Entry) -> None:
        s.applied.append(entry)
        now = self.loop.now
        truth = self._committed_entries.setdefault(entry.index, entry)
        if truth != entry:
            self.violations.append(f"node {s.index} applied {entry} where {truth} was applied")
        else:
            self.committed.setdefault(entry.index, Commit(entry.index, entry.term, now, s.index))
        if r.is_leader and entry.term == r.term:
            self.first_commit_in_term.setdefault(r.term, now)
        self._record(f"apply {s.index} {entry.index} {entry.term} {entry.data.hex()}")
        if self.on_commit is not None:
            self.on_commit(s.index, entry)

    def _record(self, line: str) -> None:
        text = f"{self.loop.now:.6f} {line}"
        self._trace.update(text.encode() + b"\n")
        if self.trace_lines is not None:
            self.trace_lines.append(text)
