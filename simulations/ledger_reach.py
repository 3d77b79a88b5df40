"""The ledger at swarm scale: a Raft configuration the voter policy builds,
the leader's Raft traffic, and the spread of the leader's ledger notice.

Only eligible nodes enter Raft (`consensus.voters`); every other member
follows the ledger by the `LedgerNotice` in the leader's gossiped record.
`PolicySwarm` runs the voter policy over a membership oracle of all
members, `old_rule_cluster` the every-member-a-learner rule it replaced,
`leader_traffic` counts the leader's Raft messages under a workload, and
`notice_spread` times a real notice's gossip. Node `i` has the id
`sim_node_id(seed, i)` in both clusters. Details: docs/design/simulator.md.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from consensus.commands import (
    ELIGIBILITY_COMMANDS,
    Assign,
    Eligible,
    Found,
    RecordDemand,
    encode_command,
)
from consensus.config import ConsensusConfig
from consensus.ledger import PlacementLedger, changed_node, snapshot_digest
from consensus.log import Entry, EntryKind
from consensus.raft import Message
from consensus.voters import ConfigChange, MemberInfo, next_change
from mesh.config import MembershipConfig
from mesh.identity import node_id_text
from mesh.records import (
    MAX_NOTICE_CHANGES,
    Addresses,
    Assignment,
    BackendInfo,
    CapabilityReport,
    LedgerNotice,
    NodeRecord,
    decode_record_body,
    encode_record_body,
)
from simulations.cluster import MembershipCluster
from simulations.network import NetworkConfig
from simulations.raft_cluster import Proposal, RaftCluster
from simulations.signing import sim_node_id

__all__ = [
    "LeaderTraffic",
    "NoticeSpread",
    "PolicySwarm",
    "await_leader",
    "leader_record",
    "leader_traffic",
    "member_ids",
    "notice_spread",
    "old_rule_cluster",
    "voters_only_cluster",
    "workload",
]

STABLE_SINCE: Final = -60.0
"""Every member has been alive since a minute before the run: stable for
the policy's purposes (`stabilization_s` is 10 s on `lan`)."""

WORKLOAD_INTERVAL_S: Final = 0.25
"""One ledger command per placement round (runtime.node.placement_driver:
0.25 s), alternating an assignment and a demand flush."""

GIVE_UP_S: Final = 60.0

MODEL: Final = "org/model-7b"

# --- the Raft side -------------------------------------------------------------------


def member_ids(seed: int, members: int) -> list[bytes]:
    """The ids of a swarm's members, node 0 (the founder) first."""
    return [sim_node_id(seed, i) for i in range(members)]


def workload(targets: Sequence[bytes], count: int) -> list[bytes]:
    """`count` ledger commands: assignments of `targets` in turn (epochs
    rising each round, so every one applies) alternating with demand flushes."""
    if not targets:
        raise ValueError("a workload needs nodes to assign")
    commands: list[bytes] = []
    for n in range(count):
        if n % 2 == 0:
            turn = n // 2
            node = targets[turn % len(targets)]
            epoch = 1 + turn // len(targets)
            command: Assign | RecordDemand = Assign(
                node, MODEL, (0, 16), "bf16", "managed", True, epoch, float(n)
            )
        else:
            command = RecordDemand(MODEL, 3 + n % 5, float(n))
        commands.append(encode_command(command))
    return commands


@dataclass
class PolicySwarm:
    """A swarm of `members`, the first `eligible` of them eligible to vote,
    whose Raft configuration the voter policy builds (module doc)."""

    members: int
    eligible: int
    seed: int
    profile: ConsensusConfig = field(default_factory=ConsensusConfig.lan)
    network: NetworkConfig | None = None
    decisions: list[tuple[float, ConfigChange]] = field(default_factory=list)
    ledgers: list[PlacementLedger] = field(init=False)
    ids: list[bytes] = field(init=False)
    raft: RaftCluster = field(init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.eligible <= self.members:
            raise ValueError("need 1 <= eligible <= members")
        self.ids = member_ids(self.seed, self.members)
        self.raft = RaftCluster(
            1,
            self.seed,
            joiners=self.eligible - 1,
            node_ids=self.ids[: self.eligible],
            tick_s=self.profile.tick_s,
            raft_config=self.profile.raft,
            network=self.network,
        )
        self.ledgers = [PlacementLedger() for _ in range(self.eligible)]
        self._changed = [
            deque[tuple[str, int]](maxlen=MAX_NOTICE_CHANGES) for _ in range(self.eligible)
        ]
        self._contact: list[dict[bytes, float]] = [{} for _ in range(self.eligible)]
        self._bootstrap_written = False
        alive = MemberInfo("alive", alive_since=STABLE_SINCE, state_since=STABLE_SINCE)
        self._view = dict.fromkeys(self.ids, alive)
        self.raft.on_commit = self._apply
        self.raft.on_message = self._heard
        self.raft.loop.call_later(self._check_every, self._check)

    @property
    def _check_every(self) -> float:
        return self.profile.voter_check_ticks * self.profile.tick_s

    # driver hooks, as runtime.node.raft_driver does them

    def _heard(self, dst: int, message: Message) -> None:
        core = self.raft.node(dst)
        if core is not None and core.refusal(message) is None:
            self._contact[dst][message.sender] = self.raft.now

    def _apply(self, node: int, entry: Entry) -> None:
        ledger = self.ledgers[node]
        if entry.kind != EntryKind.COMMAND:
            return
        result = ledger.apply(entry.index, entry.data)
        changed = changed_node(result)
        if changed is not None:
            self._changed[node].append((node_id_text(changed), entry.index))
        core = self.raft.node(node)
        if (
            core is not None
            and result.accepted
            and isinstance(result.command, ELIGIBILITY_COMMANDS)
        ):
            core.eligible = ledger.eligible_voters()

    def _check(self) -> None:
        self.raft.loop.call_later(self._check_every, self._check)
        leader = self.raft.leader()
        if leader is None:
            return
        core = self.raft.node(leader)
        assert core is not None
        if not self._bootstrap_written:
            # The founder's one-voter configuration goes into the log first.
            self._bootstrap_written = (
                self.raft.propose_config(leader, add_voter=core.node_id) is not None
            )
            return
        now = self.raft.now
        members = dict(self._view)
        del members[core.node_id]
        for node, at in self._contact[leader].items():
            members[node] = MemberInfo(
                "alive", alive_since=STABLE_SINCE, last_contact=at, state_since=STABLE_SINCE
            )
        change = next_change(
            voters=core.voters,
            learners=core.learners,
            leader=core.node_id,
            members=members,
            eligible=self.ledgers[leader].eligible_voters(),
            now=now,
            policy=self.profile.voters,
        )
        if change is None:
            return
        proposed = self.raft.propose_config(
            leader,
            add_voter=change.node if change.kind == "promote" else None,
            add_learner=change.node if change.kind == "add_learner" else None,
            remove=change.node if change.kind == "remove" else None,
        )
        if proposed is not None:
            self.decisions.append((now, change))

    # operator actions and waiting

    def leader_index(self) -> int:
        """Run until some node leads and has committed in its own term."""
        return await_leader(self.raft)

    def commit(self, data: bytes) -> Proposal:
        """Propose `data` on the leader and run until it commits."""
        self.leader_index()
        proposal = self.raft.propose(data)
        if proposal is None or self.raft.run_while(
            lambda: not self.raft.is_committed(proposal), GIVE_UP_S
        ):
            raise RuntimeError(f"seed {self.seed}: an entry did not commit")
        return proposal

    def found(self) -> None:
        """The founder founds an open swarm and an operator makes the other
        eligible nodes eligible, one committed command each."""
        self.commit(encode_command(Found(self.ids[0], "open", self.raft.now)))
        for node in self.ids[1 : self.eligible]:
            self.commit(encode_command(Eligible(node, self.raft.now)))

    def assign(self, node: bytes, epoch: int = 1) -> Proposal:
        """Commit an assignment of `node` (a member outside Raft) at the leader."""
        command = Assign(node, MODEL, (16, 32), "bf16", "managed", True, epoch, self.raft.now)
        return self.commit(encode_command(command))

    def configuration(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """(voters, learners) at the current leader."""
        core = self.raft.node(self.leader_index())
        assert core is not None
        return core.voters, core.learners

    def settle(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """Run until the policy has nothing left to change: its voter target
        is met (`max_voters` once that many eligible nodes exist, else
        `small_swarm_voters`), the learner cap (or every other eligible
        node) learns, and that configuration is committed."""
        policy = self.profile.voters
        if self.eligible >= policy.max_voters:
            want_voters = policy.max_voters
        else:
            want_voters = min(policy.small_swarm_voters, self.eligible)
        want_learners = min(policy.max_learners, self.eligible - want_voters)

        def unsettled() -> bool:
            i = self.raft.leader()
            core = None if i is None else self.raft.node(i)
            if core is None:
                return True
            return (
                len(core.voters) != want_voters
                or len(core.learners) != want_learners
                or any(
                    e.kind == EntryKind.CONFIG
                    for e in core.entries(core.commit_index + 1, core.last_index)
                )
            )

        if self.raft.run_while(unsettled, GIVE_UP_S):
            raise RuntimeError(f"seed {self.seed}: the configuration did not settle")
        return self.configuration()

    def notice(self) -> LedgerNotice:
        """The leader's notice, as `RaftDriver.notice` makes it."""
        leader = self.leader_index()
        ledger = self.ledgers[leader]
        digest = snapshot_digest(ledger.snapshot())
        changed = tuple(self._changed[leader])
        return LedgerNotice(self.raft.term(leader), ledger.applied_index, digest, changed)


def await_leader(cluster: RaftCluster, give_up_s: float = GIVE_UP_S) -> int:
    """Run until some node leads and has committed in its own term; its index.
    Checked once per tick: `leader()` looks at every node, which at 10,000
    learners costs more than the events between two ticks."""

    def unsettled() -> bool:
        i = cluster.leader()
        return i is None or cluster.term(i) not in cluster.first_commit_in_term

    if cluster.loop.run_while(unsettled, cluster.now + give_up_s, check_every=cluster.tick_s):
        raise RuntimeError(f"seed {cluster.seed}: no leader could commit in {give_up_s} s")
    leader = cluster.leader()
    assert leader is not None
    return leader


def old_rule_cluster(
    members: int,
    seed: int,
    *,
    voters: int = 5,
    profile: ConsensusConfig | None = None,
    network: NetworkConfig | None = None,
) -> RaftCluster:
    """The rule before the voter policy bounded learners: `voters` voters
    and every other member a learner (bootstrapped that way, module doc)."""
    profile = profile or ConsensusConfig.lan()
    return RaftCluster(
        voters,
        seed,
        learners=members - voters,
        node_ids=member_ids(seed, members),
        tick_s=profile.tick_s,
        raft_config=profile.raft,
        network=network,
    )


def voters_only_cluster(
    seed: int, *, voters: int = 5, profile: ConsensusConfig | None = None
) -> RaftCluster:
    """The baseline: a `voters`-voter cluster alone."""
    profile = profile or ConsensusConfig.lan()
    return RaftCluster(
        voters,
        seed,
        node_ids=member_ids(seed, voters),
        tick_s=profile.tick_s,
        raft_config=profile.raft,
    )


@dataclass(frozen=True)
class LeaderTraffic:
    """The Raft messages of whichever node led, while it led."""

    window_s: float
    sent: int
    received: int
    proposed: int
    committed: int
    leader_s: float
    """Seconds of the window during which some node led."""
    leaders: int
    """Distinct leaders seen during the window (1: a stable leader)."""
    peers_messaged: int
    """Distinct nodes the leader sent anything to during the window."""
    queue_drops: int
    """Messages the network dropped at a full inbound queue in the window."""

    @property
    def per_s(self) -> float:
        """Messages sent and received per second of leading."""
        return (self.sent + self.received) / self.leader_s if self.leader_s else 0.0

    @property
    def sent_per_s(self) -> float:
        return self.sent / self.leader_s if self.leader_s else 0.0

    @property
    def received_per_s(self) -> float:
        return self.received / self.leader_s if self.leader_s else 0.0


def leader_traffic(
    cluster: RaftCluster,
    commands: Sequence[bytes],
    *,
    interval_s: float = WORKLOAD_INTERVAL_S,
    on_progress: Callable[[float], None] | None = None,
) -> LeaderTraffic:
    """Offer `commands`, one every `interval_s`, to the current leader and
    count the Raft messages the leading node sends and receives meanwhile.

    The window is `len(commands) * interval_s` long, rounded to whole
    heartbeats, and starts half a heartbeat after the current leader's next
    tick (run the cluster to a stable leader first), so runs with different
    tick phases count the same heartbeats. Attribution is per heartbeat: at
    each, what every node that believes it leads has sent and received
    since the previous one counts for the leader (a deposed leader that has
    not noticed yet still pays for what it sends). Commands offered while
    no node leads are dropped, as a driver's would be.
    """
    loop, tick = cluster.loop, cluster.tick_s
    leading = cluster.leader()
    timer = None if leading is None else cluster.nodes[leading].tick
    if timer is not None:
        cluster.run_until(timer[0] + tick / 2)
    start = loop.now
    beats = max(1, round(len(commands) * interval_s / tick))
    window = _TrafficWindow(cluster, commands, interval_s, leading)
    cluster.on_message = window.watch
    for k in range(1, beats + 1):
        loop.call_at(start + k * tick, window.sample)
    loop.call_at(start, window.offer)
    chunk = max(1, beats // 20)
    try:
        for k in range(chunk, beats + chunk, chunk):
            cluster.run_until(start + min(k, beats) * tick)
            if on_progress is not None:
                on_progress(loop.now - start)
    finally:
        cluster.on_message = window.previous
    if window.samples < beats:  # float rounding left the last one just past stop
        cluster.run_until(start + beats * tick + tick / 4)
    return window.result(beats)


class _TrafficWindow:
    """What `leader_traffic` counts while its window runs: the leaders'
    messages per heartbeat, the commands it offers, the peers messaged."""

    def __init__(
        self,
        cluster: RaftCluster,
        commands: Sequence[bytes],
        interval_s: float,
        leading: int | None,
    ) -> None:
        self._cluster, self._net, self._interval_s = cluster, cluster.network, interval_s
        self._last_sent = list(self._net.sent_messages)
        self._last_received = list(self._net.received_messages)
        self._drops_before = self._net.drops["queue_full"]
        self.sent = self.received = self.led = self.samples = 0
        self.leaders: set[int] = set()
        self._leader_ids: set[bytes] = set()
        self.peers: set[bytes] = set()
        self.proposals: list[Proposal] = []
        self._queue = deque(commands)
        self.previous = cluster.on_message
        """The observer the window wraps, put back when it ends."""
        if leading is not None:
            self._leader_ids.add(cluster.nodes[leading].node_id)

    def sample(self) -> None:
        """A heartbeat: what each node that believes it leads sent and
        received since the last one counts for the leader."""
        net = self._net
        self.samples += 1
        led = False
        for i in range(len(self._cluster.nodes)):
            core = self._cluster.node(i)
            if core is not None and core.is_leader:
                led = True
                self.leaders.add(i)
                self._leader_ids.add(core.node_id)
                self.sent += net.sent_messages[i] - self._last_sent[i]
                self.received += net.received_messages[i] - self._last_received[i]
        self.led += led
        self._last_sent[:] = net.sent_messages
        self._last_received[:] = net.received_messages

    def offer(self) -> None:
        """Propose the next command to whoever leads, then again after the interval."""
        if not self._queue:
            return
        proposal = self._cluster.propose(self._queue.popleft())
        if proposal is not None:
            self.proposals.append(proposal)
        self._cluster.loop.call_later(self._interval_s, self.offer)

    def watch(self, dst: int, message: Message) -> None:
        """Every delivered message: note who a leader sent to."""
        if self.previous is not None:
            self.previous(dst, message)
        if message.sender in self._leader_ids:
            self.peers.add(message.to)

    def result(self, beats: int) -> LeaderTraffic:
        tick = self._cluster.tick_s
        return LeaderTraffic(
            window_s=beats * tick,
            sent=self.sent,
            received=self.received,
            proposed=len(self.proposals),
            committed=sum(1 for p in self.proposals if self._cluster.is_committed(p)),
            leader_s=self.led * tick,
            leaders=len(self.leaders),
            peers_messaged=len(self.peers),
            queue_drops=self._net.drops["queue_full"] - self._drops_before,
        )


# --- the gossip side --------------------------------------------------------------------


def leader_record(notice: LedgerNotice | None, started_at: float = 0.0) -> NodeRecord:
    """A realistic leader's record: addresses, a GPU backend, an admitted
    shard, two models, demand, and the ledger notice."""
    return NodeRecord(
        addresses=Addresses(
            control="tcp://192.168.17.23:7400",
            data="tcp://192.168.17.23:7401",
            api="http://192.168.17.23:8000",
        ),
        started_at=started_at,
        backend=BackendInfo("torch", "cuda:0", 24 * 1024**3),
        assignment=Assignment(MODEL, (0, 16), "bf16", "managed", True, 3),
        capability=CapabilityReport(
            result="admitted",
            model=MODEL,
            manifest_digest="5e" * 32,
            layers=(0, 16),
            recipe="bf16",
            backend="torch",
            prefill_tokens_per_s=2150.5,
            decode_tokens_per_s=41.25,
            validated_at=1_700_000_000.0,
            expires_at=1_700_086_400.0,
            num_layers=32,
        ),
        models=(MODEL, "org/model-1b"),
        spare=False,
        demand={MODEL: 120, "org/model-1b": 7},
        ledger=notice,
    )


@dataclass(frozen=True)
class NoticeSpread:
    nodes: int
    body_bytes: int
    """The encoded record that carries the notice."""
    times: tuple[float, ...]
    """Sorted seconds from publishing until each node held it (None: never, left out)."""
    target_s: float | None
    """The same for `target`, the node the assignment is for."""
    verified: int
    """Nodes whose copy of the leader's record decodes to exactly `notice`."""

    def quantile(self, q: float) -> float:
        """Seconds until a fraction `q` of all `nodes` held it (inf: never)."""
        needed = math.ceil(q * self.nodes)
        return self.times[needed - 1] if len(self.times) >= needed else math.inf

    @property
    def reached(self) -> float:
        return len(self.times) / self.nodes


SETTLE_S: Final = 2.0
"""Virtual seconds before the new notice, as in benchmarks.gossip: every
node's timers in their steady phase, and the previous record everywhere."""

PREVIOUS_AT_S: Final = 0.5
"""The leader's record with the previous notice goes out first, so the new
one spreads as an update (newer seq) of a record every node holds."""


def notice_spread(
    nodes: int,
    seed: int,
    notice: LedgerNotice,
    *,
    previous: LedgerNotice | None = None,
    target: int | None = None,
    window_s: float = 6.0,
    network: NetworkConfig | None = None,
) -> NoticeSpread:
    """Node 0 (the leader) publishes its record with `notice` on `nodes`
    real membership cores; how long until each node holds it. `target`
    (default: the last node) is the node the assignment is for."""
    cluster = MembershipCluster(
        nodes,
        seed,
        config=MembershipConfig.lan(),
        network=network or NetworkConfig.lan(),
        join="preconverged",
    )
    leader = 0
    target = nodes - 1 if target is None else target
    old = encode_record_body(leader_record(previous))
    cluster.publish(leader, at=PREVIOUS_AT_S, body=old)
    cluster.run_until(SETTLE_S)
    body = encode_record_body(leader_record(notice))
    publication = cluster.publish(leader, at=SETTLE_S, body=body)
    cluster.run_until(SETTLE_S + window_s)
    spread = cluster.spread_times(publication)
    leader_id = cluster.node_id(leader)
    verified = 0
    for index in cluster.running():
        record = cluster.membership(index).record(leader_id)
        if record is not None and decode_record_body(record.body).ledger == notice:
            verified += 1
    return NoticeSpread(
        nodes=nodes,
        body_bytes=len(body),
        times=tuple(sorted(t for t in spread.values() if t is not None)),
        target_s=spread.get(target),
        verified=verified,
    )
