"""The trio driver around the sans-IO Raft core: clock, disk and control plane.

`consensus.raft.RaftNode` decides everything and touches nothing. One task
(`run`) owns the core and is the only code that calls it: it feeds in what
arrived (a burst of proposals becomes one fsync), ticks, and carries out
every Ready in the order the core's contract demands: persist (sqlite, in a
worker thread), then send, then apply to the ledger, then advance. A
proposal is acknowledged only once applied, after it is durable on a
quorum. The driver knows time, not sockets or signatures.

The loop step by step, and which clock is used for what: docs/design/node.md#the-raft-driver.
"""

from __future__ import annotations

import collections
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Final

import trio

from consensus.codec import RaftDecodeError, RaftEncodeError, decode_raft, encode_raft
from consensus.commands import ELIGIBILITY_COMMANDS, Command, LedgerError, encode_command
from consensus.config import ConsensusConfig
from consensus.ledger import ApplyResult, PlacementLedger, changed_node, snapshot_digest
from consensus.log import Entry, EntryKind
from consensus.raft import (
    REFUSED_LEADER_FROM_NON_VOTER,
    REFUSED_NOT_IN_CONFIGURATION,
    AppendEntries,
    InstallSnapshot,
    Message,
    RaftNode,
    Ready,
    Role,
)
from consensus.storage import RaftStorage, StorageError
from consensus.voters import MemberInfo, next_change
from mesh.identity import NODE_ID_BYTES, node_id_text
from mesh.member_table import LIVE_STATES, MemberStateName
from mesh.records import MAX_NOTICE_CHANGES, LedgerNotice
from runtime.node.leadership import Leadership, judge, lost_leader_fix, silence_s

log = logging.getLogger("shardmesh.raft")

INBOX_CAPACITY: Final = 4096
"""Messages and proposals waiting for the core. Raft tolerates loss, so a
full inbox drops (counted) rather than blocking the control-plane reader,
which also carries membership probes that must never wait behind Raft."""

TRUST_REFUSALS: Final = (REFUSED_NOT_IN_CONFIGURATION, REFUSED_LEADER_FROM_NON_VOTER)
"""`RaftNode.refusal`'s reasons: who sent it, not what it says."""


FAILOVER_ELIGIBLE: Final = 3
"""Eligible nodes a swarm needs before losing a voter costs no leader: a
quorum of 3 voters survives one failure, and only eligible nodes vote."""

RECENT_DECISIONS: Final = 32
"""Voter changes the status API shows, newest last."""

MemberSource = Callable[[], Iterable[tuple[bytes, MemberStateName, float]]]
"""(node, membership state, state_since) for every member but ourselves."""
Sender = Callable[[bytes, bytes], None]
"""send(to, payload): sign and carry an encoded Raft message to a node."""


class NotLeader(Exception):
    """Only the leader accepts proposals; `leader` is who to ask (None: no one known)."""

    def __init__(self, leader: bytes | None) -> None:
        self.leader = leader
        where = f"the leader is {node_id_text(leader)}" if leader else "no leader is known"
        super().__init__(f"this node is not the leader; {where}")


class RefoundRefused(Exception):
    """The node may not refound the cluster now; the message says why."""


class ProposalFailed(Exception):
    """A proposal that is not known to be committed: its entry was replaced by
    another leader's (certainly lost), or the wait timed out (it may yet
    commit; retrying may apply it twice)."""


@dataclass(frozen=True, slots=True)
class Committed:
    """An acknowledged proposal: durable on a quorum and applied at `index`."""

    index: int
    term: int
    accepted: bool
    reason: str = ""
    detail: str = ""


@dataclass(eq=False)
class _Refound:
    """The operator's refound, carried to the task that owns the core."""

    done: trio.Event = field(default_factory=trio.Event)
    index: int = 0
    error: Exception | None = None


@dataclass(eq=False)
class _Proposal:
    data: bytes
    done: trio.Event = field(default_factory=trio.Event)
    index: int = 0
    term: int = 0
    result: Committed | None = None
    error: Exception | None = None

    def finish(self, result: Committed | None = None, error: Exception | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class RaftDriver:
    """One node's Raft participant, run by `run()` inside the node's nursery."""

    def __init__(
        self,
        *,
        node_id: bytes,
        storage: RaftStorage,
        config: ConsensusConfig,
        bootstrap: bool,
        send: Sender,
        members: MemberSource,
        rng: random.Random,
    ) -> None:
        """Start from `storage`'s durable state.

        `bootstrap`: this node was started without anyone to join, so if its
        store holds no configuration yet it founds a one-voter cluster (and
        writes that configuration into the log as soon as it leads, so a
        restart finds it). A joining node starts with no configuration and
        waits for a leader to add it as a learner. A store whose log lost
        acknowledged entries (`LoadedState.damaged_until`, logged by the
        storage) starts the core in repair (`RaftNode(repair_until=...)`):
        it follows and is caught up by the leader but neither votes nor
        campaigns until then, and never founds a new cluster.
        """
        self.node_id = node_id
        self.config = config
        self._storage = storage
        self._send = send
        self._members = members
        loaded = storage.load()
        has_config = loaded.snapshot is not None or any(
            e.kind == EntryKind.CONFIG for e in loaded.entries
        )
        # A damaged store that lost its configuration is not a first start:
        # founding a one-voter cluster would make it a leader of its own.
        self._write_bootstrap_config = bootstrap and not has_config and loaded.damaged_until is None
        try:
            self.ledger = (
                PlacementLedger.restore(loaded.snapshot.data)
                if loaded.snapshot
                else PlacementLedger()
            )
        except LedgerError as exc:
            raise StorageError(f"{storage.path}: the ledger snapshot is unreadable: {exc}") from exc
        self.raft = RaftNode(
            node_id,
            config.raft,
            rng,
            hard_state=loaded.hard_state,
            entries=loaded.entries,
            snapshot=loaded.snapshot,
            voters=frozenset({node_id}) if self._write_bootstrap_config else frozenset(),
            applied=loaded.snapshot.index if loaded.snapshot else 0,
            repair_until=loaded.damaged_until,
        )
        self.raft.eligible = self.ledger.eligible_voters()
        self.drops: Counter[str] = Counter()
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=RECENT_DECISIONS
        )
        self._last_contact: dict[bytes, float] = {}
        self._waiting: dict[int, _Proposal] = {}
        self._inbox_send, self._inbox = trio.open_memory_channel[Message | _Proposal | _Refound](
            INBOX_CAPACITY
        )
        self._leaderless_since: float | None = None
        self._unrepairable_warned: set[bytes] = set()
        self._ticks = 0
        self._snapshot: tuple[PlacementLedger, int, bytes, str] | None = None
        self._changed: collections.deque[tuple[str, int]] = collections.deque(
            maxlen=MAX_NOTICE_CHANGES
        )  # (node, index) of the latest assignment and quarantine changes: the notice's `changed`
        self.followed_leader: Callable[[], bytes | None] = lambda: None
        """Who leads, as a member outside the configuration hears it (its
        ledger follower reads the leader's notice); Raft says it otherwise."""
        self.heard_up_to_date: Callable[[], bool] = lambda: True
        """Whether this node's ledger is as new as the leader's notice it
        has heard (`LedgerFollower.caught_up`); see `caught_up`."""
        self.member_of: Callable[[bytes], tuple[str, float] | None] = lambda node: None
        """Membership's (state, since) of a node (None: unknown): a node that
        cannot vote stops naming a leader declared dead (`leadership`)."""
        self.on_replace: list[Callable[[], None]] = []
        """Called when the ledger is replaced whole (a snapshot from the
        leader, or a copy followed from a voter), which no `on_apply` sees."""
        self.on_apply: list[Callable[[ApplyResult], None]] = []
        """Called with every applied command's result, in log order (the
        placement history and the node's managed-assignment watcher)."""

    # --- inputs from the node -------------------------------------------------------

    def deliver(self, sender: bytes, payload: bytes) -> None:
        """A Raft payload whose signature by `sender` the node has verified.

        Decoded strictly here; anything malformed, addressed to someone
        else, or claiming a different sender than the one who signed it is
        counted and dropped."""
        try:
            message = decode_raft(payload)
        except RaftDecodeError as exc:
            self.drops[exc.reason] += 1
            return
        if message.sender != sender:
            self.drops["sender_mismatch"] += 1
            return
        if message.to != self.node_id:
            self.drops["misdirected"] += 1
            return
        try:
            self._inbox_send.send_nowait(message)
        except trio.WouldBlock:
            self.drops["inbox_full"] += 1

    async def propose(self, command: Command, timeout: float | None = None) -> Committed:
        """Replicate `command` and wait until it is applied here.

        Raises `NotLeader` (with who leads, if known) on a follower, and
        `ProposalFailed` if the entry was superseded or did not commit within
        `timeout` (default: the profile's `proposal_timeout_s`)."""
        if self.raft.role != Role.LEADER:
            raise NotLeader(self.leader())
        proposal = _Proposal(encode_command(command))
        try:
            self._inbox_send.send_nowait(proposal)
        except trio.WouldBlock:
            raise ProposalFailed("the consensus inbox is full; retry shortly") from None
        limit = self.config.proposal_timeout_s if timeout is None else timeout
        with trio.move_on_after(limit):
            await proposal.done.wait()
        if not proposal.done.is_set():
            self._waiting.pop(proposal.index, None)
            raise ProposalFailed(
                f"entry {proposal.index} was not committed within {limit:g} s; it may still commit"
            )
        if proposal.error is not None:
            raise proposal.error
        assert proposal.result is not None
        return proposal.result

    def leaderless_s(self) -> float:
        """Seconds this node has known no leader (0 while it knows one)."""
        since, now = self._leaderless_since, _loop_time()
        return 0.0 if since is None or now is None else max(0.0, now - since)

    def refound_refusal(self) -> str | None:
        """Why this node may not refound the cluster now, or None.

        Only after a leader has been missing as long as a dead voter's grace
        (`VoterPolicy.dead_grace_s`: the time the voter policy itself waits
        before it gives a voter up), and only on an eligible node: refounding
        makes this node the swarm's one voter."""
        grace = self.config.voters.dead_grace_s
        if self.raft.leader is not None:
            return f"the swarm has a leader ({node_id_text(self.raft.leader)[:12]}): nothing to do"
        if self.leaderless_s() < grace:
            return (
                f"no leader for {self.leaderless_s():.0f} s; a refound is for voters gone for "
                f"good, so it waits {grace:g} s (an election may still succeed)"
            )
        swarm = self.ledger.founding
        eligible = self.ledger.eligible_voters() if swarm is not None else self.raft.voters
        if self.node_id not in eligible:
            return "this node is not eligible to vote: refound from an eligible node"
        return None

    async def refound(self) -> int:
        """Make this node the only voter and the leader (`RaftNode.refound`):
        the operator's explicit way out of a quorum lost for good. Returns
        the new configuration's log index; `RefoundRefused` says why not."""
        refusal = self.refound_refusal()
        if refusal is not None:
            raise RefoundRefused(refusal)
        request = _Refound()
        try:
            self._inbox_send.send_nowait(request)
        except trio.WouldBlock:
            raise RefoundRefused("the consensus inbox is full; retry shortly") from None
        await request.done.wait()
        if request.error is not None:
            raise request.error
        log.warning(
            "refounded the Raft configuration: this node is its only voter (entry %d, term %d)",
            request.index,
            self.raft.term,
        )
        return request.index

    # --- the loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """Own the core until cancelled (see the module doc for the loop)."""
        tick_s = self.config.tick_s
        if self.raft.voters == {self.node_id}:
            # Alone in the configuration: nobody can be disrupted, so lead
            # now instead of waiting out an election timeout.
            self.raft.campaign()
        next_tick = trio.current_time() + tick_s
        while True:
            with trio.move_on_at(next_tick):
                self._handle(await self._inbox.receive())
                while True:
                    try:
                        item = self._inbox.receive_nowait()
                    except trio.WouldBlock:
                        break
                    self._handle(item)
            now = trio.current_time()
            if now >= next_tick:
                self._tick(now)
                # After a stall, tick once rather than catch up: a burst of
                # ticks would start an election that the stall, not the
                # leader, deserves.
                next_tick = max(next_tick + tick_s, now + tick_s / 2)
            await self._carry_out_readies()

    def _handle(self, item: Message | _Proposal | _Refound) -> None:
        if isinstance(item, _Refound):
            try:
                item.index = self.raft.refound()
            except ValueError as exc:
                item.error = RefoundRefused(str(exc))
            item.done.set()
            return
        if isinstance(item, _Proposal):
            index = self.raft.propose(item.data)
            if index is None:
                item.finish(error=NotLeader(self.leader()))
                return
            item.index, item.term = index, self.raft.term
            self._waiting[index] = item
            return
        refusal = self.raft.refusal(item) or self._snapshot_refusal(item)
        if refusal is not None:
            self.drops[refusal] += 1
            self._warn_if_unrepairable(item, refusal)
            return
        self._last_contact[item.sender] = trio.current_time()
        self.raft.step(item)

    def _warn_if_unrepairable(self, message: Message, refusal: str) -> None:
        """A log being repaired can only be repaired by a leader it trusts;
        what is left of it may not know a voter promoted later. Say once per
        sender what the operator can do, rather than wait silently."""
        if self.raft.repairing_until is None or refusal not in TRUST_REFUSALS:
            return
        if not isinstance(message, AppendEntries | InstallSnapshot):
            return
        if message.sender in self._unrepairable_warned:
            return
        self._unrepairable_warned.add(message.sender)
        log.warning(
            "this node is repairing its Raft log but refuses %s as its leader: what is left of "
            "the log does not name it as a voter or an eligible node. If it does lead this "
            "swarm, stop this node, remove %s (and its -wal, -shm and .marker files) and start "
            "it again: it rejoins and catches up from the leader",
            node_id_text(message.sender)[:12],
            self._storage.path,
        )

    def _snapshot_refusal(self, message: Message) -> str | None:
        """A snapshot is checked whole before the core may take it: the core
        hands it out to be persisted, and a ledger that cannot be restored
        would then stop this node at every start."""
        if not isinstance(message, InstallSnapshot):
            return None
        snapshot = message.snapshot
        if any(len(n) != NODE_ID_BYTES for n in snapshot.voters | snapshot.learners):
            return "bad_snapshot_configuration"
        try:
            PlacementLedger.restore(snapshot.data)
        except LedgerError as exc:
            log.warning("refused a snapshot from %s: %s", node_id_text(message.sender)[:12], exc)
            return "bad_snapshot_ledger"
        return None

    def _tick(self, now: float) -> None:
        self.raft.tick()
        self._ticks += 1
        if self.raft.leader is not None:
            self._leaderless_since = None
        elif self._leaderless_since is None:
            self._leaderless_since = now
        if not self.raft.is_leader:
            return
        if self._write_bootstrap_config:
            # Re-proposing our own one-voter configuration puts it in the log.
            if self.raft.propose_config(add_voter=self.node_id) is not None:
                self._write_bootstrap_config = False
        elif self._ticks % self.config.voter_check_ticks == 0:
            self._manage_voters(now)

    def _manage_voters(self, now: float) -> None:
        members = {
            node: MemberInfo(
                state=state,
                alive_since=since if state == "alive" else None,
                last_contact=self._last_contact.get(node),
                state_since=since,
            )
            for node, state, since in self._members()
            if node != self.node_id
        }
        change = next_change(
            voters=self.raft.voters,
            learners=self.raft.learners,
            leader=self.node_id,
            members=members,
            eligible=self.ledger.eligible_voters(),
            now=now,
            policy=self.config.voters,
        )
        if change is None:
            return
        match change.kind:
            case "add_learner":
                index = self.raft.propose_config(add_learner=change.node)
            case "promote":
                index = self.raft.propose_config(add_voter=change.node)
            case "remove":
                index = self.raft.propose_config(remove=change.node)
        if index is None:
            return  # a change is still in flight; reconsider later
        log.info("voters: %s %s (%s)", change.kind, node_id_text(change.node)[:12], change.reason)
        self.decisions.append(
            {
                "change": change.kind,
                "node_id": node_id_text(change.node),
                "reason": change.reason,
                "index": index,
                "term": self.raft.term,
                "at": time.time(),
            }
        )

    async def _carry_out_readies(self) -> None:
        while self.raft.has_ready():
            rd = self.raft.ready()
            if rd.hard_state is not None or rd.entries or rd.snapshot is not None:
                await trio.to_thread.run_sync(
                    self._storage.save, rd.hard_state, rd.entries, rd.snapshot
                )
            self._send_all(rd)
            if rd.snapshot is not None:
                self._replace_ledger(PlacementLedger.restore(rd.snapshot.data))
            for entry in rd.committed:
                self._apply(entry)
            self.raft.advance(rd)
            await self._maybe_compact()

    def _send_all(self, rd: Ready) -> None:
        for message in rd.messages:
            try:
                payload = encode_raft(message)
            except RaftEncodeError as exc:
                log.error("not sending a %s: %s", type(message).__name__, exc)
                self.drops[f"encode_{exc.reason}"] += 1
                continue
            self._send(message.to, payload)

    def _apply(self, entry: Entry) -> None:
        result = (
            self.ledger.apply(entry.index, entry.data) if entry.kind == EntryKind.COMMAND else None
        )
        if result is not None:
            changed = changed_node(result)
            if changed is not None:
                self._changed.append((node_id_text(changed), entry.index))
            if result.accepted and isinstance(result.command, ELIGIBILITY_COMMANDS):
                self.raft.eligible = self.ledger.eligible_voters()
            for callback in self.on_apply:
                callback(result)
        proposal = self._waiting.pop(entry.index, None)
        if proposal is None:
            return
        if proposal.term != entry.term:
            proposal.finish(
                error=ProposalFailed(
                    f"entry {entry.index} was replaced by term {entry.term}'s leader; "
                    "the proposal is lost"
                )
            )
            return
        committed = Committed(entry.index, entry.term, accepted=True)
        if result is not None and not result.accepted:
            committed = Committed(entry.index, entry.term, False, result.reason, result.detail)
        proposal.finish(committed)

    async def _maybe_compact(self) -> None:
        applied = self.raft.applied_index
        if applied - self.raft.first_index + 1 < self.config.compact_every:
            return
        snapshot = self.raft.compact(applied, self.ledger.snapshot())
        await trio.to_thread.run_sync(self._storage.save, None, (), snapshot)

    # --- the ledger for members outside the configuration -----------------------------

    def in_configuration(self) -> bool:
        """Raft brings this node the ledger (it is a voter or a learner)."""
        return self.node_id in self.raft.voters or self.node_id in self.raft.learners

    def follow(self, ledger: PlacementLedger) -> None:
        """Install a copy pulled from a voter (`runtime.node.ledger_follower`),
        unless Raft now brings this node the ledger itself."""
        if self.in_configuration() or ledger.applied_index < self.ledger.applied_index:
            return
        self._replace_ledger(ledger)

    def _replace_ledger(self, ledger: PlacementLedger) -> None:
        self.ledger = ledger
        self.raft.eligible = ledger.eligible_voters()
        for callback in self.on_replace:
            callback()

    def ledger_snapshot(self) -> tuple[bytes, str]:
        """The ledger's snapshot and its digest, made once per applied index:
        the leader's notice and every member's pull of the same state share
        one serialization."""
        cached = self._snapshot
        if cached is None or cached[0] is not self.ledger or cached[1] != self.ledger.applied_index:
            snapshot = self.ledger.snapshot()
            cached = (self.ledger, self.ledger.applied_index, snapshot, snapshot_digest(snapshot))
            self._snapshot = cached
        return cached[2], cached[3]

    def notice(self) -> LedgerNotice | None:
        """The leader's notice for its record (None on any other node)."""
        if not self.raft.is_leader:
            return None
        return LedgerNotice(
            self.raft.term,
            self.ledger.applied_index,
            self.ledger_snapshot()[1],
            tuple(self._changed),
        )

    # --- views ------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self.raft.is_leader

    def caught_up(self) -> bool:
        """Whether this node's ledger may be read as the swarm's: it leads,
        or its copy is as new as the newest notice heard from the leader."""
        return self.raft.is_leader or self.heard_up_to_date()

    def leader(self) -> bytes | None:
        """The leader this node follows (itself when leading), or None. A
        member outside the configuration knows it by its notice; a node
        that cannot vote never names one membership holds gone, or (a
        learner) that has fallen silent (`runtime.node.leadership`)."""
        named = self._named_leader()
        if named is None or named == self.node_id or self.node_id in self.raft.voters:
            return named  # a voter's Raft timer judges its leader
        return self._judge(named).leader

    def _named_leader(self) -> bytes | None:
        if self.raft.leader is not None or self.in_configuration():
            return self.raft.leader
        return self.followed_leader()

    def _judge(self, named: bytes | None) -> Leadership:
        in_configuration = self.in_configuration()
        return judge(
            named=named,
            this_node=self.node_id,
            votes=self.node_id in self.raft.voters,
            member=None if named is None else self.member_of(named),
            heard_at=None if named is None else self._last_contact.get(named),
            silence=(
                silence_s(self.config.tick_s, self.config.raft.election_ticks)
                if in_configuration
                else None
            ),
            now=_loop_time(),
        )

    def leadership(self) -> Leadership:
        """Whom this node names as leader and, when nobody, why and what an
        operator can do (status "leadership")."""
        judged = self._judge(self._named_leader())
        if judged.state != "leaderless":
            return judged
        if judged.lost is not None:
            return replace(judged, fix=lost_leader_fix(judged.lost, self._alive_eligible()))
        if self.node_id in self.raft.voters:
            why = (
                f"no leader for {self.leaderless_s():.0f} s: an election is under way, "
                "or too few voters are alive to elect one"
            )
        else:
            why = "no leader heard of yet: no leader's Raft message or ledger notice reached here"
        return replace(judged, why=why, fix=self.refound_hint())

    def _alive_eligible(self) -> list[bytes]:
        """Nodes that may vote and that membership holds alive (this node too, if it may)."""
        eligible = self.ledger.eligible_voters() or self.raft.voters
        return [
            node
            for node in eligible
            if node == self.node_id
            or ((state := self.member_of(node)) is not None and state[0] in LIVE_STATES)
        ]

    def refound_hint(self) -> str | None:
        """What to run once the voters may be gone for good (None: not yet,
        or not on this node: `refound_refusal`)."""
        if self.refound_refusal() is not None:
            return None
        return (
            f"no leader for {self.leaderless_s():.0f} s: if the voters are gone for good, "
            "run `shardmesh voters refound --api URL` on the surviving eligible node with "
            "the longest log (raft.last_index); entries only the lost voters held are lost"
        )

    def voters_view(self) -> dict[str, Any]:
        """Who votes, who may (`GET /v1/network/voters`, status "raft"), a
        warning while too few may for the swarm to survive a lost voter, and
        what to run once a leader has been missing long enough that the
        voters may be gone for good."""
        eligible = self.ledger.eligible_voters()
        refound_hint = self.refound_hint()
        warning = None
        if len(eligible) < FAILOVER_ELIGIBLE:
            warning = (
                f"only {len(eligible)} node(s) may vote, so losing one leaves the swarm "
                f"without a leader (no failover); {FAILOVER_ELIGIBLE} are needed: make "
                "trusted nodes eligible with `shardmesh voters add NODE_ID --api URL`"
            )
        return {
            "voters": sorted(node_id_text(v) for v in self.raft.voters),
            "learners": sorted(node_id_text(n) for n in self.raft.learners),
            "eligible": sorted(node_id_text(n) for n in eligible),
            "eligibility_warning": warning,
            "leaderless_s": round(self.leaderless_s(), 1),
            "refound_hint": refound_hint,
        }

    def status(self) -> dict[str, Any]:
        """The consensus fields of `/v1/network/status`."""
        leadership = self.leadership()
        leader = leadership.leader
        repair = self.raft.repairing_until
        return {
            "leader": node_id_text(leader) if leader else None,
            # Why "leader" is null, and what to do (runtime.node.leadership).
            "leadership": leadership.to_json(),
            "term": self.raft.term,
            "commit_index": self.raft.commit_index,
            **self.ledger.to_json(),
            # The ledger's "quarantine" lists every record; these are in force now.
            "quarantined": sorted(node_id_text(n) for n in self.ledger.quarantined(time.time())),
            "raft": {
                "role": str(self.raft.role),
                "applied_index": self.raft.applied_index,
                "first_index": self.raft.first_index,
                "last_index": self.raft.last_index,
                # Index a damaged log must be repaired to before this node
                # votes or campaigns again (consensus.raft, "Repair"); None: intact.
                "repairing_until": None if repair is None else repair.index,
                **self.voters_view(),
                "voter_decisions": list(self.decisions),
                "profile": self.config.name,
            },
        }


def _loop_time() -> float | None:
    """trio's clock, or None outside trio.run: status may be read by a
    synchronous caller (a repair tool, a test) that has no event loop."""
    try:
        return trio.current_time()
    except RuntimeError:
        return None
