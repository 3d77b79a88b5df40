"""The sans-IO Raft core: messages and ticks in, a `Ready` of effects out.

`RaftNode` is built like etcd-io/raft's `RawNode`: it never reads a clock,
the disk or the network, and its only randomness is an injected
`random.Random`, so the trio driver (`runtime/node/raft_driver.py`) and the
simulator drive the same object. It has PreVote, CheckQuorum, snapshots,
learners, single-server membership changes and leadership transfer; it
drops messages from senders outside the configuration and not `eligible`,
and a node whose log lost acknowledged entries (`repair_until`) never votes
until a leader has repaired it. The driving loop, who may speak and the
proof that repair is safe are in docs/design/raft.md.
"""

from __future__ import annotations

import random
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from consensus.log import Entry, EntryKind, HardState, LogPosition, Snapshot

__all__ = [
    "REFUSED_LEADER_FROM_NON_VOTER",
    "REFUSED_NOT_IN_CONFIGURATION",
    "AppendEntries",
    "AppendResponse",
    "InstallSnapshot",
    "Message",
    "RaftConfig",
    "RaftNode",
    "Ready",
    "RequestVote",
    "Role",
    "TimeoutNow",
    "VoteResponse",
    "decode_config",
    "encode_config",
]


@dataclass(frozen=True)
class RaftConfig:
    """Timing and limits, in logical ticks (the driver decides what a tick is)."""

    election_ticks: int = 10
    """Base election timeout. The thesis (ch. 9) and etcd use ≈ 10 heartbeats:
    long enough that one or two lost heartbeats do not start an election. The
    actual timeout is drawn from [election_ticks, 2*election_ticks) each time
    so that split votes resolve quickly (without randomness, the thesis saw
    elections take over 10 s)."""
    heartbeat_ticks: int = 1
    """A leader heartbeats every tick by default: the driver's tick *is* the
    heartbeat interval (15 ms for 150-300 ms election timeouts)."""
    pre_vote: bool = True
    """Thesis §9.6: a node rejoining from a partition first asks whether it
    could win, without bumping its term, so it cannot depose a healthy leader."""
    check_quorum: bool = True
    """A leader that has not heard from a quorum within an election timeout
    steps down, and followers that heard from a leader recently refuse votes
    (the leader lease)."""
    max_entries_per_append: int = 64
    """Caps one AppendEntries so a far-behind follower is fed in bounded
    messages rather than one message the size of the log."""

    def __post_init__(self) -> None:
        if self.election_ticks <= self.heartbeat_ticks or self.heartbeat_ticks < 1:
            raise ValueError("need 1 <= heartbeat_ticks < election_ticks")
        if self.max_entries_per_append < 1:
            raise ValueError("max_entries_per_append must be >= 1")


class Role(StrEnum):
    """The Raft states. Learners are FOLLOWERs that are not voters (see module doc)."""

    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre_candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


# --- messages ---------------------------------------------------------------
# Every message names its destination (`to`) and its sender (`sender`, an
# alias of the role-specific field) so drivers can route without a lookup.


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestVote:
    to: bytes
    term: int
    """For a pre-vote: the term the candidate *would* campaign in (its term + 1)."""
    candidate: bytes
    last_index: int
    last_term: int
    pre_vote: bool = False
    transfer: bool = False
    """Set by a leadership-transfer target: voters ignore their leader lease."""

    @property
    def sender(self) -> bytes:
        return self.candidate


@dataclass(frozen=True, slots=True, kw_only=True)
class VoteResponse:
    to: bytes
    term: int
    voter: bytes
    granted: bool
    pre_vote: bool = False

    @property
    def sender(self) -> bytes:
        return self.voter


@dataclass(frozen=True, slots=True, kw_only=True)
class AppendEntries:
    """Also the heartbeat: an AppendEntries with no entries."""

    to: bytes
    term: int
    leader: bytes
    prev_index: int
    prev_term: int
    entries: tuple[Entry, ...]
    commit: int

    @property
    def sender(self) -> bytes:
        return self.leader


@dataclass(frozen=True, slots=True, kw_only=True)
class AppendResponse:
    """Answers AppendEntries and InstallSnapshot.

    On success `match_index` is the last index known to match the leader. On
    rejection `match_index` is the rejected `prev_index` (so the leader can
    discard stale rejections) and `reject_hint` is the follower's guess of
    the highest index that may match, for fast back-off.
    """

    to: bytes
    term: int
    follower: bytes
    success: bool
    match_index: int
    reject_hint: int = 0

    @property
    def sender(self) -> bytes:
        return self.follower


@dataclass(frozen=True, slots=True, kw_only=True)
class InstallSnapshot:
    to: bytes
    term: int
    leader: bytes
    snapshot: Snapshot

    @property
    def sender(self) -> bytes:
        return self.leader


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeoutNow:
    """Leadership transfer: the target should campaign now, ignoring leases."""

    to: bytes
    term: int
    leader: bytes

    @property
    def sender(self) -> bytes:
        return self.leader


Message = RequestVote | VoteResponse | AppendEntries | AppendResponse | InstallSnapshot | TimeoutNow
_MESSAGE_TYPES = (
    RequestVote,
    VoteResponse,
    AppendEntries,
    AppendResponse,
    InstallSnapshot,
    TimeoutNow,
)


@dataclass
class Ready:
    """Effects for the driver, in the order it must carry them out (module doc).

    `messages` are only safe to send after `snapshot`, `entries` and
    `hard_state` of the same Ready are durable: a vote or an append
    acknowledgement in `messages` is a promise that they are.
    """

    hard_state: HardState | None
    """Changed since the previous Ready; None if unchanged."""
    entries: tuple[Entry, ...]
    """To persist: truncate the log from entries[0].index, then append."""
    snapshot: Snapshot | None
    """Received from a leader: persist it, drop the whole log, restore from it."""
    messages: tuple[Message, ...]
    committed: tuple[Entry, ...]
    """To apply, in order, after the above."""


REFUSED_NOT_IN_CONFIGURATION = "not_in_configuration"
REFUSED_LEADER_FROM_NON_VOTER = "leader_message_from_non_voter"
"""`RaftNode.refusal`'s reasons (counted by drivers under these names)."""

_LEADER_MESSAGES = (AppendEntries, InstallSnapshot, TimeoutNow)
"""What only a leader sends: taken only from a voter (module doc)."""


# --- configuration entries ----------------------------------------------------

_CONFIG_FORMAT_VERSION = 1
"""First byte of a CONFIG entry's data, so the encoding can change later
without misreading entries already on disk."""
_ID_LEN = struct.Struct(">H")
"""Node ids and set sizes are u16-prefixed: ids are short (key hashes) and a
configuration has a handful of members; u16 keeps the encoding compact."""


def encode_config(voters: frozenset[bytes], learners: frozenset[bytes]) -> bytes:
    """The data of a CONFIG entry. Sorted, so equal configurations encode equally."""
    parts = [bytes([_CONFIG_FORMAT_VERSION])]
    for group in (voters, learners):
        members = sorted(group)
        parts.append(_ID_LEN.pack(len(members)))
        for member in members:
            parts.append(_ID_LEN.pack(len(member)) + member)
    return b"".join(parts)


def decode_config(data: bytes) -> tuple[frozenset[bytes], frozenset[bytes]]:
    """Inverse of `encode_config`; ValueError on anything malformed."""
    if not data or data[0] != _CONFIG_FORMAT_VERSION:
        raise ValueError("unknown configuration encoding")
    pos = 1
    groups: list[frozenset[bytes]] = []
    try:
        for _ in range(2):
            (count,) = _ID_LEN.unpack_from(data, pos)
            pos += _ID_LEN.size
            members = []
            for _ in range(count):
                (length,) = _ID_LEN.unpack_from(data, pos)
                pos += _ID_LEN.size
                if pos + length > len(data):
                    raise ValueError("truncated configuration")
                members.append(bytes(data[pos : pos + length]))
                pos += length
            groups.append(frozenset(members))
    except struct.error as exc:
        raise ValueError("truncated configuration") from exc
    if pos != len(data):
        raise ValueError("trailing bytes in configuration")
    voters, learners = groups
    if voters & learners:
        raise ValueError("a node cannot be both voter and learner")
    return voters, learners


# --- the node -------------------------------------------------------------------


@dataclass(slots=True)
class _Progress:
    """The leader's view of one peer."""

    match: int = 0
    next: int = 1
    recent_active: bool = False


class RaftNode:
    """One Raft participant as a deterministic state machine (see module doc)."""

    def __init__(
        self,
        node_id: bytes,
        config: RaftConfig,
        rng: random.Random,
        *,
        hard_state: HardState = HardState(),  # noqa: B008 - frozen value
        entries: Sequence[Entry] = (),
        snapshot: Snapshot | None = None,
        voters: frozenset[bytes] = frozenset(),
        learners: frozenset[bytes] = frozenset(),
        applied: int = 0,
        repair_until: LogPosition | None = None,
    ) -> None:
        """Start from durable state (empty for a new node).

        `voters`/`learners` bootstrap the configuration when neither the
        snapshot nor a CONFIG entry in `entries` says otherwise: pass
        `voters={node_id}` to bootstrap a one-voter cluster; a joining node
        passes nothing and learns its configuration from the leader.
        `applied` is how far the state machine already is (entries after it
        are handed out again as committed). `repair_until`: the log lost
        acknowledged entries up to this position (storage's
        `damaged_until`); the node neither votes nor campaigns until a
        leader has repaired it (module doc, "Repair"). Raises ValueError on
        durable state that is inconsistent: that is a driver/storage bug,
        not peer input.
        """
        self._id = node_id
        self._cfg = config
        self._rng = rng
        self._snapshot = snapshot
        self._snap_index = snapshot.index if snapshot else 0
        self._snap_term = snapshot.term if snapshot else 0
        self._base_voters = snapshot.voters if snapshot else frozenset(voters)
        self._base_learners = snapshot.learners if snapshot else frozenset(learners)
        self._entries: list[Entry] = list(entries)
        for offset, entry in enumerate(self._entries):
            if entry.index != self._snap_index + 1 + offset:
                raise ValueError(f"log is not contiguous at index {entry.index}")
            if entry.kind == EntryKind.CONFIG:
                decode_config(entry.data)
        self._term = hard_state.term
        self._vote = hard_state.vote
        self._commit = max(hard_state.commit, self._snap_index)
        if self._commit > self.last_index:
            raise ValueError(f"commit {self._commit} is beyond the log ({self.last_index})")
        self._role = Role.FOLLOWER
        self._voters, self._learners = self._config_at(self.last_index)
        self._config_index = self._latest_config_index()

        self._leader: bytes | None = None
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self._randomized_timeout = self._draw_timeout()
        self._votes: dict[bytes, bool] = {}
        self._progress: dict[bytes, _Progress] = {}
        self._pending_config_index = 0
        self._transferee: bytes | None = None
        self._transfer_elapsed = 0

        self._messages: list[Message] = []
        self._unstable_from = self.last_index + 1
        self._pending_snapshot: Snapshot | None = None
        self._applied = min(max(applied, self._snap_index), self._commit)
        self._prev_hard_state = HardState(self._term, self._vote, self._commit)
        self._outstanding: Ready | None = None
        self._repair_until = repair_until
        self.refused: Counter[str] = Counter()
        """Messages dropped for who sent them, by reason (module doc)."""
        self.eligible: frozenset[bytes] = frozenset()
        """Nodes trusted like voters although this node's configuration may
        not (yet) say so; the driver keeps it to the ledger's (module doc)."""

    # --- properties -------------------------------------------------------------

    @property
    def node_id(self) -> bytes:
        return self._id

    @property
    def term(self) -> int:
        return self._term

    @property
    def vote(self) -> bytes | None:
        return self._vote

    @property
    def role(self) -> Role:
        return self._role

    @property
    def leader(self) -> bytes | None:
        """Who this node believes leads the current term (for redirects), or None."""
        return self._leader

    @property
    def is_leader(self) -> bool:
        return self._role == Role.LEADER

    @property
    def commit_index(self) -> int:
        return self._commit

    @property
    def applied_index(self) -> int:
        """Committed entries up to here have been handed out in a Ready."""
        return self._applied

    @property
    def first_index(self) -> int:
        """The first index still in the log (earlier ones are in the snapshot)."""
        return self._snap_index + 1

    @property
    def last_index(self) -> int:
        return self._snap_index + len(self._entries)

    @property
    def last_term(self) -> int:
        return self._entries[-1].term if self._entries else self._snap_term

    @property
    def voters(self) -> frozenset[bytes]:
        return self._voters

    @property
    def learners(self) -> frozenset[bytes]:
        return self._learners

    @property
    def is_learner(self) -> bool:
        return self._id in self._learners

    @property
    def transferring_to(self) -> bytes | None:
        return self._transferee

    @property
    def repairing_until(self) -> LogPosition | None:
        """While set, the log is being repaired and this node does not vote
        or campaign (module doc, "Repair"); None once repaired."""
        return self._repair_until

    def entries(self, lo: int, hi: int) -> tuple[Entry, ...]:
        """Log entries lo..hi inclusive that are still held (for tests/inspection)."""
        lo = max(lo, self.first_index)
        hi = min(hi, self.last_index)
        if lo > hi:
            return ()
        base = self._snap_index + 1
        return tuple(self._entries[lo - base : hi - base + 1])

    # --- inputs -------------------------------------------------------------------

    def tick(self) -> None:
        """Advance logical time by one heartbeat interval."""
        self._election_elapsed += 1
        if self._role == Role.LEADER:
            self._tick_leader()
        elif self._promotable() and self._election_elapsed >= self._randomized_timeout:
            self._campaign(transfer=False)

    def campaign(self) -> None:
        """Start an election now (through PreVote if enabled); no-op for leaders,
        for nodes that are not voters and for nodes being repaired."""
        if self._role != Role.LEADER and self._promotable():
            self._campaign(transfer=False)

    def refound(self) -> int:
        """Make this node the only voter, and lead: the operator's way out
        when the voters are gone for good (like etcd's --force-new-cluster).

        Never automatic, because it is not safe in general: entries the lost
        voters committed that this log lacks are gone, so it belongs on the
        surviving node with the longest log. The new configuration goes in
        at a new term, so it can never share an (index, term) with an entry
        of a leader of the old one; learners stay learners, and the voter
        policy grows the cluster again from there. Returns the new
        configuration entry's index; ValueError while the log is being
        repaired (a shortened log is the worst one to keep).
        """
        if self._repair_until is not None:
            raise ValueError("this log is being repaired; refound from a node with a whole log")
        self._term += 1
        self._vote = self._id
        self._become_follower(self._term, None)
        config = encode_config(frozenset({self._id}), self._learners - {self._id})
        index = self.last_index + 1
        self._truncate_append([Entry(self._term, index, EntryKind.CONFIG, config)])
        self._campaign_real(transfer=False)
        return index

    def propose(self, data: bytes) -> int | None:
        """Append a command; its index, or None if not leader (see `leader`).

        Refused during a leadership transfer: entries proposed then would be
        lost with the old leader's term or delay the transfer.
        """
        if self._role != Role.LEADER or self._transferee is not None:
            return None
        return self._leader_append(EntryKind.COMMAND, data)

    def propose_config(
        self,
        *,
        add_voter: bytes | None = None,
        add_learner: bytes | None = None,
        remove: bytes | None = None,
    ) -> int | None:
        """Propose one single-server membership change; its index or None.

        None when not leader, transferring, or while an earlier CONFIG entry
        is uncommitted: single-server changes are only safe one at a time
        (thesis §4.1). `add_voter` promotes a learner; `add_learner` adds a
        new member or demotes a voter. ValueError if not exactly one change
        is named or the change would leave no voters.
        """
        named = [x for x in (add_voter, add_learner, remove) if x is not None]
        if len(named) != 1:
            raise ValueError("name exactly one of add_voter, add_learner, remove")
        if self._role != Role.LEADER or self._transferee is not None:
            return None
        if self._pending_config_index > self._commit:
            return None
        voters, learners = set(self._voters), set(self._learners)
        if add_voter is not None:
            learners.discard(add_voter)
            voters.add(add_voter)
        elif add_learner is not None:
            voters.discard(add_learner)
            learners.add(add_learner)
        elif remove is not None:
            voters.discard(remove)
            learners.discard(remove)
        if not voters:
            raise ValueError("a configuration needs at least one voter")
        data = encode_config(frozenset(voters), frozenset(learners))
        return self._leader_append(EntryKind.CONFIG, data)

    def transfer_leadership(self, to: bytes) -> bool:
        """Hand leadership to voter `to`; False if not leader or `to` is not a
        peer voter. Proposals are refused until the transfer ends (success,
        or abort after an election timeout)."""
        if self._role != Role.LEADER or to == self._id or to not in self._voters:
            return False
        if to not in self._progress:
            return False
        self._transferee = to
        self._transfer_elapsed = 0
        if self._progress[to].match == self.last_index:
            self._send(TimeoutNow(to=to, term=self._term, leader=self._id))
        else:
            self._send_append(to)
        return True

    def step(self, message: Message) -> None:
        """Feed one message from a peer. Invalid or stale input is dropped,
        never raised: peers are not trusted to be well-formed."""
        if not self._valid(message):
            return
        refusal = self.refusal(message)
        if refusal is not None:
            self.refused[refusal] += 1
            return
        m = message
        if m.term > self._term:
            if isinstance(m, RequestVote):
                in_lease = (
                    self._leader is not None
                    and self._election_elapsed < self._cfg.election_ticks
                    and (m.pre_vote or self._cfg.check_quorum)
                )
                if in_lease and not m.transfer:
                    # We heard from a live leader recently: this candidate is
                    # likely a rejoining partitioned node. Not even its term.
                    return
            if (isinstance(m, RequestVote) and m.pre_vote) or (
                isinstance(m, VoteResponse) and m.pre_vote and m.granted
            ):
                pass  # pre-votes carry a future term without changing ours
            else:
                leader = m.leader if isinstance(m, (AppendEntries, InstallSnapshot)) else None
                self._become_follower(m.term, leader)
        elif m.term < self._term:
            if isinstance(m, (AppendEntries, InstallSnapshot)):
                # Tell a stale leader about the newer term so it steps down;
                # with PreVote/CheckQuorum it might otherwise never learn it.
                self._send(
                    AppendResponse(
                        to=m.leader, term=self._term, follower=self._id, success=False,
                        match_index=0, reject_hint=0,
                    )
                )  # fmt: skip
            elif isinstance(m, RequestVote) and m.pre_vote:
                self._send(
                    VoteResponse(
                        to=m.candidate, term=self._term, voter=self._id, granted=False,
                        pre_vote=True,
                    )
                )  # fmt: skip
            return

        if isinstance(m, RequestVote):
            self._handle_vote_request(m)
        elif isinstance(m, VoteResponse):
            self._handle_vote_response(m)
        elif isinstance(m, AppendEntries):
            if self._role == Role.LEADER:
                return  # two leaders in one term cannot happen; drop
            self._follow(m.leader)
            self._handle_append(m)
        elif isinstance(m, InstallSnapshot):
            if self._role == Role.LEADER:
                return
            self._follow(m.leader)
            self._handle_snapshot(m)
        elif isinstance(m, AppendResponse):
            if self._role == Role.LEADER:
                self._handle_append_response(m)
        elif isinstance(m, TimeoutNow) and self._role == Role.FOLLOWER and self._promotable():
            self._campaign(transfer=True)

    # --- output -------------------------------------------------------------------

    def has_ready(self) -> bool:
        """Whether `ready()` would hand out anything (False while one is outstanding)."""
        if self._outstanding is not None:
            return False
        # Field by field, not `_hard_state() != ...`: drivers (and the random
        # schedules) ask after every message, and building a HardState to
        # compare was half of this method's cost.
        prev = self._prev_hard_state
        return bool(
            self._messages
            or self._unstable_from <= self.last_index
            or self._pending_snapshot is not None
            or self._applied < self._commit
            or self._term != prev.term
            or self._vote != prev.vote
            or self._commit != prev.commit
        )

    def ready(self) -> Ready:
        """Take the pending effects. Call `advance` with it before the next `ready`.

        The messages are only safe to send once this Ready's snapshot,
        entries and hard state are durable (see `Ready`).
        """
        if self._outstanding is not None:
            raise RuntimeError("advance() the previous Ready first")
        hard_state = self._hard_state()
        start = max(self._unstable_from, self.first_index)
        rd = Ready(
            hard_state=hard_state if hard_state != self._prev_hard_state else None,
            entries=self.entries(start, self.last_index),
            snapshot=self._pending_snapshot,
            messages=tuple(self._messages),
            committed=self.entries(self._applied + 1, self._commit),
        )
        self._messages = []
        self._pending_snapshot = None
        self._unstable_from = self.last_index + 1
        self._applied = self._commit
        self._prev_hard_state = hard_state
        self._outstanding = rd
        return rd

    def advance(self, ready: Ready) -> None:
        """The driver has persisted, sent and applied `ready`."""
        if ready is not self._outstanding:
            raise RuntimeError("advance() takes the Ready last returned by ready()")
        self._outstanding = None

    def compact(self, index: int, data: bytes) -> Snapshot:
        """The application says its state at `index` is `data`: drop the log up
        to `index` and keep the snapshot to send to lagging followers.

        The caller persists the returned snapshot itself (store it, delete
        entries <= index); it does not come back in a Ready. ValueError if
        `index` is not applied yet or is older than the current snapshot.
        """
        if index > self._applied or index < self._snap_index:
            raise ValueError(f"cannot compact to {index} (snapshot {self._snap_index}, "
                             f"applied {self._applied})")  # fmt: skip
        term = self._term_at(index)
        assert term is not None
        voters, learners = self._config_at(index)
        snapshot = Snapshot(index, term, voters, learners, data)
        del self._entries[: index - self._snap_index]
        self._snap_index, self._snap_term = index, term
        self._base_voters, self._base_learners = voters, learners
        self._snapshot = snapshot
        return snapshot

    # --- log helpers ------------------------------------------------------------

    def _term_at(self, index: int) -> int | None:
        if index == self._snap_index:
            return self._snap_term
        if self._snap_index < index <= self.last_index:
            return self._entries[index - self._snap_index - 1].term
        return None

    def _hard_state(self) -> HardState:
        return HardState(self._term, self._vote, self._commit)

    def _truncate_append(self, entries: Sequence[Entry]) -> None:
        first = entries[0].index
        cut = first - self._snap_index - 1
        dropped = self._entries[cut:]
        del self._entries[cut:]
        self._entries.extend(entries)
        self._unstable_from = min(self._unstable_from, first)
        touched = any(e.kind == EntryKind.CONFIG for e in (*dropped, *entries))
        if touched:
            self._recompute_config()

    def _config_at(self, index: int) -> tuple[frozenset[bytes], frozenset[bytes]]:
        for entry in reversed(self.entries(self.first_index, index)):
            if entry.kind == EntryKind.CONFIG:
                return decode_config(entry.data)
        return self._base_voters, self._base_learners

    def _latest_config_index(self) -> int:
        """Index of the last CONFIG entry in the log (0: the snapshot's or bootstrap config)."""
        for entry in reversed(self.entries(self.first_index, self.last_index)):
            if entry.kind == EntryKind.CONFIG:
                return entry.index
        return 0

    def _recompute_config(self) -> None:
        """Thesis §4.1: the latest CONFIG entry in the log rules, committed or not."""
        self._voters, self._learners = self._config_at(self.last_index)
        self._config_index = self._latest_config_index()
        if self._role == Role.LEADER:
            self._sync_progress()

    def _promotable(self) -> bool:
        """May this node campaign? Voters may; so may a node that an
        *uncommitted* configuration removes (thesis §4.2.2): until that
        entry commits the old configuration may still need it, and if it
        holds the only up-to-date log no one else can win. It campaigns
        under its latest configuration, where its own vote does not count
        (`_tally_won`), so it can only lead long enough to commit the
        removal, and then steps down. A node being repaired may not
        (module doc, "Repair")."""
        if self._repair_until is not None:
            return False
        if self._id in self._voters:
            return True
        if self._config_index <= self._commit:
            return False
        return self._id in self._config_at(self._commit)[0]

    def _quorum(self) -> int:
        return len(self._voters) // 2 + 1

    def _draw_timeout(self) -> int:
        e = self._cfg.election_ticks
        return self._rng.randrange(e, 2 * e)

    def _send(self, message: Message) -> None:
        self._messages.append(message)

    # --- validation ---------------------------------------------------------------

    def refusal(self, m: Message) -> str | None:
        """Why `m`'s sender may not say this to us, or None (module doc).
        `step` drops such a message; a driver may ask first, to spare work
        (decoding a snapshot) on a message that would be dropped anyway."""
        sender = m.sender
        if not (self._voters or self._learners or self.eligible):
            return None
        if not (sender in self._voters or sender in self._learners or sender in self.eligible):
            return REFUSED_NOT_IN_CONFIGURATION
        if isinstance(m, _LEADER_MESSAGES) and not (
            m.sender in self._voters or m.sender in self.eligible
        ):
            return REFUSED_LEADER_FROM_NON_VOTER
        return None

    def _valid(self, m: object) -> bool:
        if not isinstance(m, _MESSAGE_TYPES) or m.to != self._id or m.sender == self._id:
            return False
        if not isinstance(m.term, int) or m.term < 0:
            return False
        if isinstance(m, AppendEntries):
            if m.prev_index < 0 or m.prev_term < 0 or m.commit < 0 or m.prev_term > m.term:
                return False
            prev_term = m.prev_term
            for offset, e in enumerate(m.entries):
                if not isinstance(e, Entry) or e.index != m.prev_index + 1 + offset:
                    return False
                if not prev_term <= e.term <= m.term or not isinstance(e.kind, EntryKind):
                    return False
                if e.kind == EntryKind.CONFIG:
                    try:
                        decode_config(e.data)
                    except ValueError:
                        return False
                prev_term = e.term
        elif isinstance(m, InstallSnapshot):
            s = m.snapshot
            if not isinstance(s, Snapshot) or s.index < 1 or not 0 < s.term <= m.term:
                return False
            if not s.voters or s.voters & s.learners:
                return False
        elif isinstance(m, RequestVote):
            if m.last_index < 0 or m.last_term < 0:
                return False
        elif isinstance(m, AppendResponse) and (m.match_index < 0 or m.reject_hint < 0):
            return False
        return True

    # --- roles --------------------------------------------------------------------

    def _reset_timers(self) -> None:
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self._randomized_timeout = self._draw_timeout()

    def _become_follower(self, term: int, leader: bytes | None) -> None:
        if term != self._term:
            self._term = term
            self._vote = None
        self._role = Role.FOLLOWER
        self._leader = leader
        self._votes = {}
        self._progress = {}
        self._transferee = None
        self._reset_timers()

    def _follow(self, leader: bytes) -> None:
        """A valid message from this term's leader: follow it, restart the timer."""
        if self._role != Role.FOLLOWER or self._leader != leader:
            self._become_follower(self._term, leader)
        self._election_elapsed = 0

    def _campaign(self, *, transfer: bool) -> None:
        """PreVote first (unless transferring: the leader asked us to), then a real election."""
        if not self._cfg.pre_vote or transfer:
            self._campaign_real(transfer=transfer)
            return
        self._role = Role.PRE_CANDIDATE
        self._leader = None
        self._progress = {}
        self._transferee = None
        self._reset_timers()
        self._votes = {self._id: True}
        if self._tally_won():
            self._campaign_real(transfer=False)
            return
        self._request_votes(term=self._term + 1, pre_vote=True, transfer=False)

    def _campaign_real(self, *, transfer: bool) -> None:
        self._become_follower(self._term + 1, None)
        self._role = Role.CANDIDATE
        self._vote = self._id
        self._votes = {self._id: True}
        if self._tally_won():
            self._become_leader()
            return
        self._request_votes(term=self._term, pre_vote=False, transfer=transfer)

    def _request_votes(self, *, term: int, pre_vote: bool, transfer: bool) -> None:
        for voter in sorted(self._voters - {self._id}):
            self._send(
                RequestVote(
                    to=voter, term=term, candidate=self._id, last_index=self.last_index,
                    last_term=self.last_term, pre_vote=pre_vote, transfer=transfer,
                )
            )  # fmt: skip

    def _tally_won(self) -> bool:
        granted = sum(1 for v, ok in self._votes.items() if ok and v in self._voters)
        return granted >= self._quorum()

    def _tally_lost(self) -> bool:
        rejected = sum(1 for v, ok in self._votes.items() if not ok and v in self._voters)
        return rejected >= self._quorum()

    def _become_leader(self) -> None:
        self._role = Role.LEADER
        self._leader = self._id
        self._votes = {}
        self._transferee = None
        self._reset_timers()
        self._progress = {}
        self._sync_progress()
        # Entries of earlier terms can only commit through one of this term
        # (paper §5.4.2, figure 8); the NOOP makes that happen right away.
        # Any uncommitted CONFIG entry still blocks new ones until it commits.
        self._pending_config_index = 0
        for entry in self.entries(self._commit + 1, self.last_index):
            if entry.kind == EntryKind.CONFIG:
                self._pending_config_index = entry.index
        self._leader_append(EntryKind.NOOP, b"")

    def _sync_progress(self) -> None:
        peers = (self._voters | self._learners) - {self._id}
        for peer in list(self._progress):
            if peer not in peers:
                del self._progress[peer]
        for peer in peers:
            if peer not in self._progress:
                self._progress[peer] = _Progress(match=0, next=self.last_index + 1)
        if self._transferee is not None and self._transferee not in self._voters:
            self._transferee = None

    # --- voting -------------------------------------------------------------------

    def _handle_vote_request(self, m: RequestVote) -> None:
        can_vote = (
            self._vote == m.candidate
            or (self._vote is None and self._leader is None)
            or (m.pre_vote and m.term > self._term)
        )
        up_to_date = (m.last_term, m.last_index) >= (self.last_term, self.last_index)
        # A log being repaired may lack entries it acknowledged: its
        # up-to-date check would let through candidates without them.
        granted = can_vote and up_to_date and self._repair_until is None
        if granted and not m.pre_vote:
            self._vote = m.candidate
            self._election_elapsed = 0
        # A granted pre-vote answers in the candidate's future term so the
        # candidate can match it to its campaign; a rejection in ours.
        term = m.term if granted and m.pre_vote else self._term
        self._send(
            VoteResponse(to=m.candidate, term=term, voter=self._id, granted=granted,
                         pre_vote=m.pre_vote)
        )  # fmt: skip

    def _handle_vote_response(self, m: VoteResponse) -> None:
        if self._role == Role.PRE_CANDIDATE and m.pre_vote:
            if m.granted and m.term != self._term + 1:
                return
        elif self._role == Role.CANDIDATE and not m.pre_vote:
            if m.term != self._term:
                return
        else:
            return
        self._votes.setdefault(m.voter, m.granted)
        if self._tally_won():
            if self._role == Role.PRE_CANDIDATE:
                self._campaign_real(transfer=False)
            else:
                self._become_leader()
        elif self._tally_lost():
            self._become_follower(self._term, None)

    # --- replication: follower side ---------------------------------------------

    def _reply_append(self, to: bytes, success: bool, match: int, hint: int = 0) -> None:
        if success and self._repair_until is not None:
            # A success says the log matches the leader's through `match`.
            term = self._term_at(match)
            if term is not None and LogPosition(term=term, index=match) >= self._repair_until:
                self._repair_until = None
        self._send(
            AppendResponse(to=to, term=self._term, follower=self._id, success=success,
                           match_index=match, reject_hint=hint)
        )  # fmt: skip

    def _handle_append(self, m: AppendEntries) -> None:
        if m.prev_index < self._commit:
            # Our committed prefix matches any leader's; say how far it goes.
            self._reply_append(m.leader, True, self._commit)
            return
        if self._term_at(m.prev_index) != m.prev_term:
            if m.prev_index > self.last_index:
                hint = self.last_index
            else:
                # Skip back over our entries from terms the leader does not
                # have at prev_index: none of them can match.
                hint = m.prev_index - 1
                while hint > self._commit and (self._term_at(hint) or 0) > m.prev_term:
                    hint -= 1
            self._reply_append(m.leader, False, m.prev_index, hint)
            return
        for offset, entry in enumerate(m.entries):
            if self._term_at(entry.index) == entry.term:
                continue
            if entry.index <= self._commit:
                return  # would rewrite a committed entry: not a valid leader
            self._truncate_append(m.entries[offset:])
            break
        match = m.prev_index + len(m.entries)
        self._commit = max(self._commit, min(m.commit, match))
        self._reply_append(m.leader, True, match)

    def _handle_snapshot(self, m: InstallSnapshot) -> None:
        s = m.snapshot
        if s.index <= self._commit:
            self._reply_append(m.leader, True, self._commit)
            return
        if self._term_at(s.index) == s.term:
            # We hold that entry already: the log matches up to it.
            self._commit = s.index
            self._reply_append(m.leader, True, s.index)
            return
        self._entries = []
        self._snap_index, self._snap_term = s.index, s.term
        self._base_voters, self._base_learners = s.voters, s.learners
        self._snapshot = s
        self._pending_snapshot = s
        self._commit = s.index
        self._applied = s.index
        self._unstable_from = s.index + 1
        self._recompute_config()
        self._reply_append(m.leader, True, s.index)

    # --- replication: leader side -----------------------------------------------

    def _leader_append(self, kind: EntryKind, data: bytes) -> int:
        entry = Entry(self._term, self.last_index + 1, kind, data)
        self._entries.append(entry)
        if kind == EntryKind.CONFIG:
            self._pending_config_index = entry.index
            self._recompute_config()
        self._bcast_append()
        self._maybe_commit()
        return entry.index

    def _bcast_append(self) -> None:
        for peer in sorted(self._progress):
            self._send_append(peer)

    def _send_append(self, peer: bytes) -> None:
        pr = self._progress[peer]
        prev = pr.next - 1
        prev_term = self._term_at(prev)
        if prev_term is None:
            if prev > self.last_index:  # cannot happen; repair rather than fail
                pr.next = self.last_index + 1
                self._send_append(peer)
                return
            assert self._snapshot is not None
            self._send(InstallSnapshot(to=peer, term=self._term, leader=self._id,
                                       snapshot=self._snapshot))  # fmt: skip
            pr.next = self._snapshot.index + 1
            return
        hi = min(self.last_index, pr.next + self._cfg.max_entries_per_append - 1)
        batch = self.entries(pr.next, hi)
        self._send(
            AppendEntries(to=peer, term=self._term, leader=self._id, prev_index=prev,
                          prev_term=prev_term, entries=batch, commit=self._commit)
        )  # fmt: skip
        if batch:
            pr.next = batch[-1].index + 1  # optimistic: a loss shows up as a rejection

    def _handle_append_response(self, m: AppendResponse) -> None:
        pr = self._progress.get(m.follower)
        if pr is None:
            return
        pr.recent_active = True
        if not m.success:
            if m.match_index < pr.match:
                return  # stale: that prefix has been acknowledged since
            if m.reject_hint < pr.match:
                # A follower that still holds what it acknowledged never hints
                # below it: this one lost entries (a damaged log, module doc,
                # "Repair"). Forget its acknowledgements and back off from
                # what it has now; the commit index never goes back.
                pr.match = 0
            new_next = max(pr.match + 1, min(pr.next, m.reject_hint + 1))
            if new_next != pr.next:
                pr.next = new_next
                self._send_append(m.follower)
            return
        if m.match_index > self.last_index:
            return  # acknowledges entries we never sent: drop
        if m.match_index > pr.match:
            pr.match = m.match_index
        pr.next = max(pr.next, pr.match + 1)
        if self._maybe_commit():
            if self._role != Role.LEADER:
                return
            self._bcast_append()
        elif pr.next <= self.last_index:
            self._send_append(m.follower)
        if m.follower == self._transferee and pr.match == self.last_index:
            self._send(TimeoutNow(to=m.follower, term=self._term, leader=self._id))

    def _maybe_commit(self) -> bool:
        matches = sorted(
            (
                self.last_index if v == self._id else self._progress[v].match
                if v in self._progress else 0
                for v in self._voters
            ),
            reverse=True,
        )  # fmt: skip
        if not matches:
            return False
        candidate = matches[self._quorum() - 1]
        if candidate <= self._commit or self._term_at(candidate) != self._term:
            return False
        self._commit = candidate
        if self._id not in self._voters and self._commit >= self._pending_config_index:
            # Thesis §4.2.2: a leader removed from the configuration steps
            # down once that configuration is committed.
            self._become_follower(self._term, None)
        return True

    def _tick_leader(self) -> None:
        self._heartbeat_elapsed += 1
        if self._election_elapsed >= self._cfg.election_ticks:
            self._election_elapsed = 0
            if self._cfg.check_quorum:
                active = sum(
                    1
                    for v in self._voters
                    if v == self._id or (v in self._progress and self._progress[v].recent_active)
                )
                for pr in self._progress.values():
                    pr.recent_active = False
                if active < self._quorum():
                    self._become_follower(self._term, None)
                    return
        if self._transferee is not None:
            self._transfer_elapsed += 1
            if self._transfer_elapsed >= self._cfg.election_ticks:
                self._transferee = None  # the target did not take over: resume
        if self._heartbeat_elapsed >= self._cfg.heartbeat_ticks:
            self._heartbeat_elapsed = 0
            self._bcast_append()
