"""SWIM membership with Lifeguard, as a protocol object with no I/O.

Who is in the swarm, who is suspect or dead, and every member's signed
node record. The object is driven from outside, like h11: `receive(envelope,
now)` feeds a message, `tick(now)` fires due timers, `next_deadline()` says
when to tick next, `take_sends()` and `take_events()` drain what it wants
sent and what changed. It reads no clock and draws randomness only from the
injected `random.Random`, so the trio node and the simulator drive the same
object. Every update is signed and every accusation checked against rules
that hold with Byzantine members (only alive members accuse, never above an
incarnation the subject signed, acks only from whom we asked). A new id
is a member only once it answered our own ping or enough members vouched
for it, and each member may introduce only so many a minute (`_Candidate`).

The protocol, its trust rules and their reasons: docs/design/membership.md.
"""

from __future__ import annotations

import collections
import heapq
import math
import random
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from mesh.broadcasts import BroadcastQueue
from mesh.config import MembershipConfig
from mesh.fields import MAX_UINT
from mesh.identity import Signer, Verifier
from mesh.member_table import (
    GONE_STATES,
    LIVE_STATES,
    MemberEntry,
    MemberState,
    MemberTable,
    ProbeOrder,
    StartingView,
)
from mesh.messages import (
    Ack,
    Alive,
    Dead,
    Envelope,
    Gossip,
    Message,
    Nack,
    Ping,
    PingReq,
    PushPull,
    Record,
    Suspect,
    SyncDelta,
    SyncDigest,
    Update,
    alive_signing_bytes,
    dead_signing_bytes,
    record_signing_bytes,
    suspect_signing_bytes,
)
from mesh.newcomers import IntroductionLimit, NewcomerLimit
from mesh.sync import bits_for, digest_bits, well_formed_delta

MAX_COUNTER = MAX_UINT
"""Incarnations and record sequence numbers stay below 2**63 (wire limit)."""

MAX_FORMER_ADDRS = 8
"""Former addresses of this life remembered (`Membership.set_address`): a
node moves between a few relays, and an Alive older than eight moves has
been outbid everywhere long since."""
JOIN_BACKOFF_MAX_FACTOR = 8
"""Join retries back off up to this many `join_retry_interval`s apart (8 s
on a LAN): a seed that comes up late is still found within seconds, and a
wrong address costs its owner one small message per few seconds."""

RELAY_NACK_FRACTION = 0.8
"""A helper probing on someone's behalf sends its nack after this fraction
of its probe timeout, so the nack lands before the requester's probe ends."""

R_ACCUSER_UNKNOWN = "accuser_unknown"
"""Drop reason: a suspicion or death accused by a key that is no member."""
R_ACCUSER_NOT_ALIVE = "accuser_not_alive"
"""Drop reason: accused by a member we hold suspect, dead or departed."""
R_ABOVE_SIGNED = "accusation_above_signed"
"""Drop reason: an accusation at an incarnation its subject never signed."""
R_UNASKED_ACK = "ack_from_unasked"
"""Drop reason: an ack or nack for one of our probes from a node that is
neither the probe's target nor a helper we asked. Sequence numbers are
easy to guess; the sender, authenticated by the plane, is not, so only
the target itself (directly, or through a helper) can keep it alive."""
R_SYNC_MALFORMED = "sync_malformed"
"""Drop reason: a delta-sync message out of shape (`mesh.sync`): a digest
that is not a power of two of at most 256 fingerprints, or a delta whose
buckets are not ascending within its bits or that holds a member outside
them. The wire refuses these too; the core checks again because the
simulator hands it messages that never were bytes."""
R_CANDIDATE_SILENT = "candidate_silent"
"""Drop reason: a new id did not answer our ping in time and too few
members vouched for it; it is forgotten, and learned again (charged again)
when news of it comes again. See `_Candidate`."""

# Estimated encoded sizes, used only to keep piggybacked updates within the
# packet budget without encoding them twice. Generous upper bounds.
_SIZE_ALIVE = 120
_SIZE_ACCUSATION = 160
_SIZE_RECORD = 130


@dataclass(frozen=True, slots=True)
class Send:
    """Send `envelope` to the node `node` listening at `addr`. The transport
    needs both: it authenticates the peer by its id (its key) before anything
    is delivered."""

    addr: str
    node: bytes
    envelope: Envelope


@dataclass(frozen=True, slots=True)
class MemberEvent:
    """A change in this node's view. `kind` is one of
    "joined", "alive", "suspect", "dead", "left", "record", "twin" (another
    process holds our key: `Membership.twin_addr`); for "record",
    `incarnation` carries the record's seq."""

    kind: str
    node: bytes
    incarnation: int
    at: float


@dataclass(frozen=True, slots=True)
class MemberView:
    node: bytes
    addr: str
    incarnation: int
    state: MemberState
    state_since: float
    last_seen: float | None
    record: Record | None


class _Suspicion:
    """Lifeguard's shrinking suspicion timer for one member.

    A partition has every member suspect most others at once, so this is
    kept small: accusers are a tuple (one or two of them at most, since
    confirmations stop once `settled`), and (k, min, max timeout), which
    depend only on the swarm's size, are one tuple shared by every
    suspicion made at that size."""

    __slots__ = ("accusers", "deadline", "last_look", "limits", "start")

    def __init__(self, start: float, accuser: bytes, limits: tuple[int, float, float]) -> None:
        self.start = start
        self.last_look = False
        self.accusers: tuple[bytes, ...] = (accuser,)
        self.limits = limits
        k, lo, hi = limits
        self.deadline = start + (lo if k == 0 else hi)

    @property
    def k(self) -> int:
        """Independent confirmations that bring the timeout to its minimum."""
        return self.limits[0]

    @property
    def settled(self) -> bool:
        """At its minimum timeout: further confirmations change nothing, so
        they are neither counted nor gossiped (in a 50/50 partition that is
        the difference between k and n/2 accusations per suspect)."""
        return len(self.accusers) > self.limits[0]

    def confirm(self, accuser: bytes) -> None:
        """Count one more independent accuser and shorten the timeout."""
        self.accusers += (accuser,)
        confirmations = len(self.accusers) - 1
        k, lo, hi = self.limits
        if k > 0:
            fraction = math.log(confirmations + 1) / math.log(k + 1)
            timeout = hi - fraction * (hi - lo)
            self.deadline = self.start + max(lo, timeout)


RTT_SAMPLES = 5
"""A member's round trip (`Membership.rtts`) is the least of our last five
direct probes' to it, the first probe not counted. Routes want the path's
delay, and every excess is noise on it: the first probe to a member also
opens the connection (CURVE's handshake, three round trips more), a lost
packet waits for TCP's retransmission, a busy event loop answers late.
Measured in the WAN lab, 40 ms apart under load, single samples ran from 57
to 390 ms. The least of five is 40-odd ms there, and follows a path that
got longer within five probes of that member (a few probe rounds)."""


class _Probe:
    __slots__ = (
        "acked",
        "asked",
        "direct_deadline",
        "end",
        "helpers",
        "nacks",
        "sent",
        "seq",
        "target",
    )

    def __init__(
        self, seq: int, target: bytes, direct_deadline: float, end: float, sent: float
    ) -> None:
        self.sent = sent  # when the direct ping went out: its ack times a round trip
        self.seq = seq
        self.target = target
        self.direct_deadline = direct_deadline  # inf once the indirect phase began
        self.end = end
        self.acked = False
        self.helpers = 0
        self.asked: frozenset[bytes] = frozenset()  # the helpers, by id
        self.nacks = 0


class _Candidate:
    """A new id we were told of but have not verified: not a member yet.

    It lives outside the member table, so nothing that reads members (the
    probe round, gossip targets, the live count that timeouts and
    retransmits scale with, syncs, status, routes, placement) sees it, and
    gossip never carries it. It becomes a member when it answers our ping
    (`seq`) at the address it advertises, or when `vouches_to_verify`
    alive members relayed its Alive (`vouchers`); else it is dropped at
    `deadline`. An accusation of it heard meanwhile is held, unchecked,
    and applied once it is a member (`accusation`), so a sync that brings
    a new member and its suspicion together ends as it would have before.
    Details: docs/design/membership.md#introductions."""

    __slots__ = ("accusation", "alive", "deadline", "seq", "vouchers")

    def __init__(self, alive: Alive, seq: int, deadline: float) -> None:
        self.alive = alive
        self.seq = seq
        self.deadline = deadline
        self.vouchers: tuple[bytes, ...] = ()
        self.accusation: Suspect | Dead | None = None


def _update_size(update: Update) -> int:
    if isinstance(update, Alive):
        return _SIZE_ALIVE + len(update.addr)
    if isinstance(update, Record):
        return _SIZE_RECORD + len(update.body)
    return _SIZE_ACCUSATION


def _broadcast_key(update: Update) -> Hashable:
    """Updates with the same key supersede one another in the send queue:
    news of a member (its id itself, the cheapest key to keep by the
    thousand), or its record."""
    return ("r", update.node) if isinstance(update, Record) else update.node


class Membership:
    """One node's view of the swarm; see the module docstring."""

    def __init__(
        self,
        *,
        signer: Signer,
        verifier: Verifier,
        addr: str,
        config: MembershipConfig,
        rng: random.Random,
        now: float,
        incarnation: int = 0,
        record_body: bytes | None = None,
        record_seq: int = 0,
        validate_record_body: Callable[[bytes], str | None] | None = None,
        starting_view: StartingView | None = None,
    ) -> None:
        self.node_id: bytes = signer.node_id
        self.addr = addr
        self.config = config
        self.drops: Counter[str] = Counter()
        self._signer = signer
        self._verify = verifier
        self._first_incarnation = incarnation
        self.twin_addr: str | None = None
        """Where another live process holding our key says it is (see
        `_apply_alive`); None while no such process has been heard of."""
        self._former_addrs: collections.deque[str] = collections.deque(maxlen=MAX_FORMER_ADDRS)
        """Addresses this life advertised before (`set_address`): an old
        Alive of ours naming one is news of us, not of a twin."""
        self._rng = rng
        self._validate_body = validate_record_body
        self._newcomers = NewcomerLimit(config.newcomers_per_address, config.newcomers_per_prefix)
        self._introductions = IntroductionLimit(
            config.introductions_per_member, config.introductions_total
        )
        # Unverified new ids, oldest first (so by deadline: `_expire_candidates`).
        self._candidates: dict[bytes, _Candidate] = {}

        self._table = MemberTable(self.node_id, starting_view)
        self._probe_order = ProbeOrder(self._table, rng)

        self._broadcasts = BroadcastQueue()
        self._sends: list[Send] = []
        self._events: list[MemberEvent] = []

        self._seq = 0
        self._probe: _Probe | None = None
        # member -> its last RTT_SAMPLES direct-probe round trips
        self._rtt: dict[bytes, collections.deque[float]] = {}
        # seq -> (requester, its address, its seq, when to nack, target)
        self._relays: dict[int, tuple[bytes, str, int, float, bytes]] = {}
        self._suspicions: dict[bytes, _Suspicion] = {}
        # (deadline, node) for every armed suspicion timer; entries whose
        # suspicion is gone or was re-armed are skipped when they surface.
        self._suspicion_timers: list[tuple[float, bytes]] = []
        self._limits_at = -1  # the live count `_limits` was worked out for
        self._limits: tuple[int, float, float] = (0, 0.0, 0.0)
        self._oldest_gone = math.inf  # no member gone (dead or left) before this
        self._awareness = 0
        self._leaving = False
        self._join_seeds: tuple[tuple[bytes, str], ...] = ()
        self._joined = True
        self._join_attempts = 0

        jitter = rng.random()
        self._next_probe = now + config.probe_interval * jitter
        self._next_gossip = now + config.gossip_interval * jitter
        self._next_push_pull = now + config.push_pull_interval * (0.5 + jitter)
        self._next_reconnect = now + config.reconnect_interval * (0.5 + jitter)
        self._next_join = math.inf
        self._next_introduction = now

        me = MemberEntry(self._sign_alive(min(incarnation, MAX_COUNTER)), now)
        in_view = self._table.get(self.node_id) is not None
        self._table.add(me)
        self._table.seen(self.node_id, now)
        self._me = me
        self._live_count = self._table.initial_live_count() + (0 if in_view else 1)
        # (live count, its retransmit limit): a log10 per gossip packet was
        # 3% of a 1,000-node run, and the count changes rarely.
        self._retransmit: tuple[int, int] = (-1, 0)
        self._queue(me.alive)
        self._record_seq = record_seq
        if record_body is not None:
            self.publish_record(record_body, now)

    # --- public driving API ----------------------------------------------------------

    @property
    def incarnation(self) -> int:
        return self._me.incarnation

    @property
    def joining(self) -> tuple[bool, int]:
        """(whether a seed has answered our join, join attempts so far);
        (True, 0) for a node that was given no seeds."""
        return self._joined, self._join_attempts

    @property
    def health(self) -> int:
        """Lifeguard local-health score: 0 is healthy; timeouts scale by score + 1."""
        return self._awareness

    def join(self, seeds: Sequence[tuple[bytes, str]], now: float) -> None:
        """Start a full-state exchange with every seed `(node id, address)`,
        retried until one answers."""
        self._join_seeds = tuple(seed for seed in seeds if seed[0] != self.node_id)
        if not self._join_seeds:
            return
        self._joined = False
        self._join_attempts = 0
        self._send_join(now)

    def leave(self, now: float) -> None:
        """Announce a graceful leave (a `Dead` about ourselves, self-signed)."""
        if self._leaving:
            return
        self._leaving = True
        me = self._me
        farewell = Dead(
            self.node_id,
            me.incarnation,
            self.node_id,
            self._signer.sign(dead_signing_bytes(self.node_id, me.incarnation, self.node_id)),
        )
        self._table.restate(me, me.alive, farewell)
        self._set_state(me, MemberState.LEFT, now)
        self._queue(farewell)
        # Send it now to more members than one gossip round would reach: the
        # process is about to exit and may not get another round.
        for node in self._random_peers(2 * self.config.gossip_fanout, now):
            self._send(node, self._table.entry(node).addr, Gossip((farewell,)))

    def set_address(self, addr: str, now: float) -> None:
        """Our advertised control address is now `addr` (a node behind NAT
        reached through a relay, or through another one, or directly again):
        an Alive at the next incarnation names it and rides out on the next
        messages, and a join not answered yet is sent again at once (its
        seed could not answer the old address)."""
        if addr == self.addr:
            return
        self._former_addrs.append(self.addr)
        self.addr = addr
        self._refute(self._me.incarnation, now)
        if not self._joined:
            self._next_join = now
        # Told to every live member at once, with our record (which names
        # the new data address): a member that learned it only by gossip
        # would meanwhile probe the old address, and take us for suspect.
        # A move is rare (a relay lost), so one small message per member.
        record = self._table.record(self.node_id)
        news = (self._me.alive, *(() if record is None else (record,)))
        for member in self._table:
            if member.node != self.node_id and member.state in LIVE_STATES:
                self._send(member.node, member.addr, Gossip(news))

    def publish_record(self, body: bytes, now: float) -> Record:
        """Sign `body` as our new node record (seq + 1) and disseminate it."""
        self._record_seq = min(self._record_seq + 1, MAX_COUNTER)
        record = Record(
            self.node_id,
            self._record_seq,
            body,
            self._signer.sign(record_signing_bytes(self.node_id, self._record_seq, body)),
        )
        self._table.set_record(record)
        self._events.append(MemberEvent("record", self.node_id, record.seq, now))
        self._queue(record)
        return record

    def receive(self, envelope: Envelope, now: float) -> None:
        """Feed one decoded inbound message; then drain sends and events."""
        message = envelope.message
        if (
            now >= self._next_introduction
            and not isinstance(message, PushPull)  # a full state introduces itself
            and not self._leaving
            and self._table.get(envelope.sender) is None
        ):
            self._ask_stranger(envelope, now)
        match message:
            case Ping():
                self._on_ping(envelope, message, now)
            case Ack():
                self._apply_all(message.updates, now, envelope.sender)
                self._on_ack(envelope, message, now)
            case PingReq():
                self._apply_all(message.updates, now, envelope.sender)
                self._on_ping_req(envelope, message, now)
            case Nack():
                probe = self._probe
                if probe is not None and probe.seq == message.seq:
                    if envelope.sender in probe.asked:
                        probe.nacks += 1
                    else:
                        self.drops[R_UNASKED_ACK] += 1
            case Gossip():
                self._apply_all(message.updates, now, envelope.sender)
            case PushPull():
                self._on_push_pull(envelope, message, now)
            case SyncDigest():
                self._on_sync_digest(envelope, message, now)
            case SyncDelta():
                self._on_sync_delta(envelope, message, now)

    def tick(self, now: float) -> None:
        """Fire every timer due at `now`; call it at `next_deadline()` (or later)."""
        if self._leaving:
            if now >= self._next_gossip:
                self._gossip(now)
            return
        if now >= self._next_join:
            self._send_join(now)
        probe = self._probe
        if probe is not None and not probe.acked and now >= probe.direct_deadline:
            self._send_indirect_probes(probe, now)
        if probe is not None and now >= probe.end:
            self._finish_probe(probe, now)
        if now >= self._next_probe:
            self._start_probe(now)
        if self._candidates:
            self._expire_candidates(now)
        timers = self._suspicion_timers
        while timers and timers[0][0] <= now:
            deadline, node = heapq.heappop(timers)
            suspicion = self._suspicions.get(node)
            if suspicion is not None and suspicion.deadline == deadline:
                self._suspicion_expired(node, now)
        for seq in [s for s, relay in self._relays.items() if now >= relay[3]]:
            requester, requester_addr, requester_seq, _, _ = self._relays.pop(seq)
            if self.config.nacks:
                self._send(requester, requester_addr, Nack(requester_seq))
        if now >= self._next_gossip:
            self._gossip(now)
        if now >= self._next_push_pull:
            self._periodic_sync(now)
        if now >= self._next_reconnect:
            self._reconnect(now)

    def next_deadline(self) -> float:
        """When `tick` must next run; any call other than a `take_*` may move
        it, so drivers re-read it after every step."""
        # Gossip rounds only matter while there is something to gossip; an
        # idle swarm then wakes once per probe, not five times a second.
        # (Comparisons rather than min(): drivers ask after every message.)
        deadline = self._next_join
        if self._broadcasts and self._next_gossip < deadline:
            deadline = self._next_gossip
        if self._leaving:
            return deadline
        for due in (self._next_probe, self._next_push_pull, self._next_reconnect):
            if due < deadline:
                deadline = due
        probe = self._probe
        if probe is not None:
            if probe.end < deadline:
                deadline = probe.end
            if not probe.acked and probe.direct_deadline < deadline:
                deadline = probe.direct_deadline
        timers = self._suspicion_timers
        while timers:
            due, node = timers[0]
            suspicion = self._suspicions.get(node)
            if suspicion is not None and suspicion.deadline == due:
                if due < deadline:
                    deadline = due
                break
            heapq.heappop(timers)  # stale: refuted, decided or re-armed
        for _, _, _, nack_at, _ in self._relays.values():
            if nack_at < deadline:
                deadline = nack_at
        if self._candidates:
            oldest = next(iter(self._candidates.values())).deadline
            if oldest < deadline:
                deadline = oldest
        return deadline

    def take_sends(self) -> list[Send]:
        sends, self._sends = self._sends, []
        return sends

    def take_events(self) -> list[MemberEvent]:
        events, self._events = self._events, []
        return events

    def members(self) -> list[MemberView]:
        return [self._view(m) for m in self._table]

    def member(self, node: bytes) -> MemberView | None:
        m = self._table.get(node)
        return None if m is None else self._view(m)

    def record(self, node: bytes) -> Record | None:
        return self._table.record(node)

    def rtts(self) -> dict[bytes, float]:
        """Member -> the least round trip of our last `RTT_SAMPLES` direct
        probes' acks, in seconds, for members not dead (an ack through a
        helper, or to a ping re-sent in the indirect phase, times nothing)."""
        known = {}
        for node, samples in list(self._rtt.items()):
            entry = self._table.get(node)
            if entry is None:
                del self._rtt[node]
            elif entry.state is not MemberState.DEAD and samples:
                known[node] = min(samples)
        return known

    def _note_rtt(self, node: bytes, sample: float) -> None:
        """Keep a direct probe's round trip, but the first to a member: it
        also opened the connection (`RTT_SAMPLES`), so while it is the only
        sample it would say the member is several times farther than it is
        (routes then price the member as unmeasured instead)."""
        samples = self._rtt.get(node)
        if samples is None:
            self._rtt[node] = collections.deque(maxlen=RTT_SAMPLES)
            return
        samples.append(sample)

    @property
    def candidates(self) -> int:
        """New ids introduced to us and not verified yet (`_Candidate`):
        never members, so no `members()` view shows them."""
        return len(self._candidates)

    # --- probing -----------------------------------------------------------------------

    def _scaled(self, seconds: float) -> float:
        return seconds * (self._awareness + 1)

    def _adjust_awareness(self, delta: int) -> None:
        if not self.config.local_health:
            return
        top = self.config.awareness_max_multiplier - 1
        self._awareness = max(0, min(top, self._awareness + delta))

    def _next_probe_target(self) -> MemberEntry | None:
        """Next member in our round-robin, skipping dead and departed ones."""
        for _ in range(self._probe_order.cycle_length() + 1):
            node = self._probe_order.next_candidate()
            if node is None:
                continue
            member = self._table.get(node)
            if member is not None and member.state in LIVE_STATES:
                return member
        return None

    def _start_probe(self, now: float) -> None:
        self._next_probe = now + self._scaled(self.config.probe_interval)
        target = self._next_probe_target()
        if target is None:
            return
        self._seq += 1
        self._probe = _Probe(
            self._seq,
            target.node,
            now + self._scaled(self.config.probe_timeout),
            self._next_probe,
            now,
        )
        # Buddy system: a suspect hears of its suspicion on the probe itself,
        # so it can refute at once rather than when gossip happens to reach it.
        first: tuple[Update, ...] = ()
        if (
            self.config.buddy
            and target.state is MemberState.SUSPECT
            and isinstance(target.accusation, Suspect)
        ):
            first = (target.accusation,)
        self._send(
            target.node, target.addr, Ping(self._seq, target.node, first + self._piggyback())
        )

    def _send_indirect_probes(self, probe: _Probe, now: float) -> None:
        probe.direct_deadline = math.inf
        target = self._table.get(probe.target)
        if target is None:
            return
        candidates = self._random_peers(self.config.indirect_checks + 1, now, live_only=True)
        helpers = [n for n in candidates if n != probe.target][: self.config.indirect_checks]
        probe.helpers = len(helpers)
        probe.asked = frozenset(helpers)
        # A second direct ping beside the indirect ones (memberlist sends a
        # TCP ping here): under 10% loss it alone turns most would-be
        # suspicions into acks, and every suspicion avoided is a refutation
        # the whole swarm does not have to gossip.
        self._send(target.node, target.addr, Ping(probe.seq, probe.target, self._piggyback()))
        for node in helpers:
            self._send(
                node,
                self._table.entry(node).addr,
                PingReq(probe.seq, probe.target, target.addr, self._piggyback()),
            )

    def _finish_probe(self, probe: _Probe, now: float) -> None:
        self._probe = None
        if probe.acked:
            return
        # Lifeguard: every helper that did not even nack suggests our own
        # links are the problem; with no helpers to ask (or no nacks to tell
        # us who tried), blame ourselves once.
        if probe.helpers > 0 and self.config.nacks:
            self._adjust_awareness(probe.helpers - probe.nacks)
        else:
            self._adjust_awareness(1)
        target = self._table.get(probe.target)
        if target is None or target.state not in LIVE_STATES:
            return
        self._accuse(target, now)

    def _on_ping(self, envelope: Envelope, ping: Ping, now: float) -> None:
        if ping.target != self.node_id:
            self.drops["wrong_target"] += 1
            return
        self._apply_all(ping.updates, now, envelope.sender)
        updates = self._piggyback()
        if any(self._is_stale_accusation_of_us(u) for u in ping.updates):
            # The prober still suspects an older life of ours: our refutation
            # missed it, so it rides on this ack whatever the queue holds.
            updates = (self._me.alive, *updates)
        self._send(envelope.sender, envelope.addr, Ack(ping.seq, updates))

    def _is_stale_accusation_of_us(self, update: Update) -> bool:
        return (
            isinstance(update, Suspect | Dead)
            and update.node == self.node_id
            and update.incarnation < self._me.incarnation
        )

    def _on_ack(self, envelope: Envelope, ack: Ack, now: float) -> None:
        probe = self._probe
        if probe is not None and probe.seq == ack.seq and not probe.acked:
            if envelope.sender != probe.target and envelope.sender not in probe.asked:
                self.drops[R_UNASKED_ACK] += 1
                return
            probe.acked = True
            self._adjust_awareness(-1)
            if self._table.get(probe.target) is not None:
                self._table.seen(probe.target, now)
                if envelope.sender == probe.target and probe.direct_deadline != math.inf:
                    self._note_rtt(probe.target, now - probe.sent)
            return
        relay = self._relays.get(ack.seq)
        if relay is not None:
            if envelope.sender != relay[4]:
                self.drops[R_UNASKED_ACK] += 1
                return
            del self._relays[ack.seq]
            self._send(relay[0], relay[1], Ack(relay[2]))
            return
        candidate = self._candidates.get(envelope.sender)
        if candidate is not None and candidate.seq == ack.seq:
            self._on_candidate_ack(candidate, now)
            return
        sender = self._table.get(envelope.sender)
        if sender is not None and sender.state is MemberState.DEAD:
            # A reconnect ping came back: the "dead" member is reachable again
            # (typically a healed partition). Sync our states.
            self._start_sync(sender.node, sender.addr)

    def _on_ping_req(self, envelope: Envelope, req: PingReq, now: float) -> None:
        self._seq += 1
        nack_at = now + self.config.probe_timeout * RELAY_NACK_FRACTION
        self._relays[self._seq] = (envelope.sender, envelope.addr, req.seq, nack_at, req.target)
        self._send(req.target, req.target_addr, Ping(self._seq, req.target, self._piggyback()))

    # --- suspicion -------------------------------------------------------------------

    def _accuse(self, target: MemberEntry, now: float) -> None:
        """Our own probe failed: suspect the target (or confirm its suspicion)."""
        incarnation = target.incarnation
        accusation = Suspect(
            target.node,
            incarnation,
            self.node_id,
            self._signer.sign(suspect_signing_bytes(target.node, incarnation, self.node_id)),
        )
        self._apply_suspect(accusation, now, verified=True)

    def _suspicion_expired(self, node: bytes, now: float) -> None:
        member = self._table.get(node)
        if member is None or member.state is not MemberState.SUSPECT:
            self._suspicions.pop(node, None)
            return
        suspicion = self._suspicions[node]
        if len(suspicion.accusers) == 1 and suspicion.k > 0 and not suspicion.last_look:
            # Nobody confirmed this suspicion in its whole (maximal) timeout.
            # Either the suspect is truly gone and only we noticed, or its
            # refutation missed us while everyone else got it. Before a
            # verdict, look once more ourselves: the ping carries the stale
            # accusation, and a live suspect answers with its current Alive.
            suspicion.last_look = True
            suspicion.deadline = now + 2 * self._scaled(self.config.probe_timeout)
            heapq.heappush(self._suspicion_timers, (suspicion.deadline, node))
            self._seq += 1
            accusation = (member.accusation,) if member.accusation is not None else ()
            self._send(node, member.addr, Ping(self._seq, node, accusation))
            return
        del self._suspicions[node]
        verdict = Dead(
            node,
            member.incarnation,
            self.node_id,
            self._signer.sign(dead_signing_bytes(node, member.incarnation, self.node_id)),
        )
        self._apply_dead(verdict, now, verified=True)

    def _refute(self, incarnation: int, now: float, accuser: bytes | None = None) -> None:
        """Someone accused us (or remembers an older life): outbid them.

        The accuser also gets the refutation directly: it is the member most
        likely to declare us dead, and gossip alone may take a few rounds.
        """
        me = self._me
        me.incarnation = min(max(me.incarnation, incarnation) + 1, MAX_COUNTER)
        self._table.restate(me, self._sign_alive(me.incarnation), None)
        self._queue(me.alive)
        self._adjust_awareness(1)
        accuser_member = self._table.get(accuser) if accuser is not None else None
        if accuser_member is not None and accuser != self.node_id and self.config.refute_to_accuser:
            self._send(accuser_member.node, accuser_member.addr, Gossip((me.alive,)))

    # --- applying updates --------------------------------------------------------------

    def _apply_all(self, updates: tuple[Update, ...], now: float, sender: bytes) -> None:
        """Apply piggybacked updates in order.

        Most are news we already hold: every member sends each update
        about 4 * log10(N) times, so a healed 1,000-node partition brings
        each member some 20,000 copies of what it learned once. Those are
        recognised here by the very tests the `_apply_*` methods open with
        (an Alive not above what we hold; an accusation of a stranger,
        below what we hold, or of a member already gone; a confirmation of
        a suspicion that has it, or needs no more), at the cost of one
        lookup; everything else takes the full path. `sender`, who sent
        them, introduces any new id among them (`_consider`).
        """
        get = self._table.get
        me = self.node_id
        suspicions = self._suspicions
        for update in updates:
            if isinstance(update, Record) or update.node == me:
                self._apply(update, now, sender)
                continue
            member = get(update.node)
            if isinstance(update, Alive):
                if member is None or update.incarnation > member.incarnation:
                    self._apply_alive(update, now, sender)
            elif member is None:
                if self._candidates:
                    self._hold_accusation(update)
            elif update.incarnation < member.incarnation or member.state in GONE_STATES:
                continue
            elif isinstance(update, Dead):
                self._apply_dead(update, now)
            elif member.state is not MemberState.SUSPECT or update.incarnation > member.incarnation:
                self._apply_suspect(update, now)
            else:
                suspicion = suspicions.get(update.node)
                if not (
                    suspicion is None or suspicion.settled or update.accuser in suspicion.accusers
                ):
                    self._apply_suspect(update, now)

    def _apply(self, update: Update, now: float, sender: bytes, relay: bool = True) -> None:
        match update:
            case Alive():
                self._apply_alive(update, now, sender, relay)
            case Suspect():
                self._apply_suspect(update, now, relay=relay)
            case Dead():
                self._apply_dead(update, now, relay=relay)
            case Record():
                self._apply_record(update, now, relay)

    def _check_twin(self, alive: Alive, now: float) -> None:
        """An Alive of ours, from another address, at an incarnation this
        life has reached: only our key signs it, and a previous life's
        incarnations are all below this one's first (the state dir keeps the
        count), so another process holds our key right now (a copied state
        dir). Reported as a "twin" event; what to do is the node's call.
        The twin gets our newest Alive straight away, so it learns of us now
        rather than at its next full-state sync: the newcomer of the two
        must find out within moments of its start (`runtime.node.daemon`)."""
        if (
            alive.addr != self.addr
            and alive.addr not in self._former_addrs
            and alive.incarnation >= self._first_incarnation
            and alive.addr != self.twin_addr
            and self._authentic(alive)
        ):
            self.twin_addr = alive.addr
            self._events.append(MemberEvent("twin", self.node_id, alive.incarnation, now))
            self._send(self.node_id, alive.addr, Gossip((self._me.alive,)))

    def _may_accuse(self, accusation: Suspect | Dead, subject: MemberEntry) -> bool:
        """Whether `accusation` of `subject` (a member we hold) may be taken,
        before its signature is checked; a refusal is counted by its reason.
        The rules and why: docs/design/membership.md#trust.

        A graceful leave (a death signed by its own subject) passes: it is
        the subject's own word, at whatever incarnation it names."""
        if accusation.accuser == accusation.node and isinstance(accusation, Dead):
            return True
        if accusation.incarnation > subject.alive.incarnation:
            self.drops[R_ABOVE_SIGNED] += 1
            return False
        accuser = self._table.get(accusation.accuser)
        if accuser is None:
            self.drops[R_ACCUSER_UNKNOWN] += 1
            return False
        if accuser.state is not MemberState.ALIVE and subject.node != self.node_id:
            self.drops[R_ACCUSER_NOT_ALIVE] += 1
            return False
        return True

    def _authentic(self, update: Update) -> bool:
        if update.verified(self._verify):
            return True
        self.drops["bad_signature"] += 1
        return False

    def _apply_alive(
        self,
        alive: Alive,
        now: float,
        sender: bytes,
        relay: bool = True,
        *,
        vouched: bool = False,
    ) -> None:
        """Learn or update a member from its own signed Alive, which
        `sender` passed on. An id new to us is a candidate first
        (`_consider`), unless `vouched` (our join's seed: `_on_push_pull`)."""
        if alive.node == self.node_id:
            stale_self = alive.incarnation > self._me.incarnation and not self._leaving
            if stale_self and self._authentic(alive):
                self._refute(alive.incarnation, now)
            self._check_twin(alive, now)
            return
        member = self._table.get(alive.node)
        if member is None:
            if not vouched:
                self._consider(alive, sender, now)
            elif self._authentic(alive):
                self._candidates.pop(alive.node, None)
                self._learn(alive, now, relay)
            return
        if alive.incarnation <= member.incarnation:
            return
        if not self._authentic(alive):
            return
        member = self._table.own(member)
        was = member.state
        member.incarnation = alive.incarnation
        member.addr = alive.addr
        self._table.restate(member, alive, None)
        self._suspicions.pop(alive.node, None)
        if was is not MemberState.ALIVE:
            self._set_state(member, MemberState.ALIVE, now)
            self._events.append(MemberEvent("alive", alive.node, alive.incarnation, now))
        if relay:
            self._queue(alive)

    # --- introductions (docs/design/membership.md#introductions) ----------------------

    def _consider(self, alive: Alive, introducer: bytes, now: float) -> None:
        """An Alive of an id we do not know, from `introducer`: a vouch for
        a candidate we hold, or a new candidate if the introducer, this
        node and the id's neighbourhood are all within their bounds (else
        dropped and counted; learned when the news comes again). Bounds
        are checked before the signature, so a flood over them costs a
        lookup per id, not a signature check. A new candidate gets one
        ping, without piggybacked news: gossip is not spent on an address
        nobody may listen at."""
        candidate = self._candidates.get(alive.node)
        if candidate is not None:
            self._vouch(candidate, alive, introducer, now)
            return
        refused = self._introductions.refusal(introducer, now) or self._newcomers.refusal(
            alive.addr, now
        )
        if refused is not None:
            self.drops[refused] += 1
            return
        if not self._authentic(alive):
            return
        self._introductions.admit(introducer, now)
        self._newcomers.admit(alive.addr, now)
        self._seq += 1
        candidate = _Candidate(alive, self._seq, now + self.config.probe_interval)
        self._candidates[alive.node] = candidate
        self._send(alive.node, alive.addr, Ping(self._seq, alive.node, ()))
        self._vouch(candidate, alive, introducer, now)

    def _vouch(self, candidate: _Candidate, alive: Alive, voucher: bytes, now: float) -> None:
        """`voucher` passed on `candidate`'s Alive: one vouch if it is an
        alive member other than the candidate (an id's word for itself is
        no vouch) not counted yet; enough of them verify the candidate."""
        node = candidate.alive.node
        if alive.incarnation > candidate.alive.incarnation and self._authentic(alive):
            candidate.alive = alive
        member = self._table.get(voucher)
        if (
            voucher == node
            or voucher in candidate.vouchers
            or member is None
            or member.state is not MemberState.ALIVE
        ):
            return
        candidate.vouchers += (voucher,)
        if len(candidate.vouchers) >= self.config.vouches_to_verify:
            self._promote(candidate, now)

    def _promote(self, candidate: _Candidate, now: float) -> None:
        """`candidate` is verified: a member now, and its news (its Alive,
        its record if we hold one) ours to gossip. A held accusation is
        then checked like any other; a death as a death we did not witness
        (`_merge_remote_death`)."""
        alive = candidate.alive
        del self._candidates[alive.node]
        self._learn(alive, now, relay=True)
        record = self._table.record(alive.node)
        if record is not None:
            self._queue(record)
        accusation = candidate.accusation
        if isinstance(accusation, Dead) and accusation.accuser != accusation.node:
            self._merge_remote_death(accusation, now)
        elif accusation is not None:
            self._apply(accusation, now, self.node_id)

    def _hold_accusation(self, accusation: Suspect | Dead) -> None:
        """Keep the latest accusation of a candidate until it is a member."""
        candidate = self._candidates.get(accusation.node)
        if candidate is None:
            return
        held = candidate.accusation
        if held is None or accusation.incarnation >= held.incarnation:
            candidate.accusation = accusation

    def _on_candidate_ack(self, candidate: _Candidate, now: float) -> None:
        """The candidate answered our ping: it holds its key and listens
        where it says."""
        self._promote(candidate, now)
        self._table.seen(candidate.alive.node, now)

    def _expire_candidates(self, now: float) -> None:
        """Drop candidates past their deadline. All share one delay and
        `now` only grows, so the oldest come first and the scan stops at
        the first one still waiting."""
        candidates = self._candidates
        while candidates:
            node, candidate = next(iter(candidates.items()))
            if candidate.deadline > now:
                return
            del candidates[node]
            self.drops[R_CANDIDATE_SILENT] += 1

    def _learn(self, alive: Alive, now: float, relay: bool) -> None:
        """Make `alive`'s id a member (verified, or from our join's seed)."""
        self._table.add(MemberEntry(alive, now))
        self._probe_order.joined(alive.node)
        self._live_count += 1
        self._events.append(MemberEvent("joined", alive.node, alive.incarnation, now))
        if relay:
            self._queue(alive)

    def _apply_suspect(
        self, suspect: Suspect, now: float, *, verified: bool = False, relay: bool = True
    ) -> None:
        member = self._table.get(suspect.node)
        if member is None:
            self._hold_accusation(suspect)
            return
        if suspect.incarnation < member.incarnation:
            return
        if member.state in GONE_STATES:
            return
        if member.state is MemberState.SUSPECT and suspect.incarnation == member.incarnation:
            # A confirmation (we never hold ourselves suspect). One that
            # would change nothing is dropped before its accuser and its
            # signature are checked: most are copies of one we counted.
            suspicion = self._suspicions.get(suspect.node)
            if suspicion is None or suspicion.settled or suspect.accuser in suspicion.accusers:
                return
            if not (verified or (self._may_accuse(suspect, member) and self._authentic(suspect))):
                return
            suspicion.confirm(suspect.accuser)
            heapq.heappush(self._suspicion_timers, (suspicion.deadline, suspect.node))
            if relay:
                self._queue(suspect, key=("s", suspect.node, suspect.accuser))
            return
        if not (verified or self._may_accuse(suspect, member)):
            return
        if suspect.node == self.node_id:
            if not self._leaving and (verified or self._authentic(suspect)):
                self._refute(suspect.incarnation, now, suspect.accuser)
            return
        if not (verified or self._authentic(suspect)):
            return
        member = self._table.own(member)
        member.incarnation = suspect.incarnation
        self._table.restate(member, member.alive, suspect)
        self._set_state(member, MemberState.SUSPECT, now)
        suspicion = _Suspicion(now, suspect.accuser, self._suspicion_limits())
        self._suspicions[suspect.node] = suspicion
        heapq.heappush(self._suspicion_timers, (suspicion.deadline, suspect.node))
        self._events.append(MemberEvent("suspect", suspect.node, suspect.incarnation, now))
        if relay:
            self._queue(suspect)

    def _suspicion_limits(self) -> tuple[int, float, float]:
        """(k, min, max timeout) for a suspicion starting now (`_Suspicion`)."""
        n = self._live_count
        if self._limits_at != n:
            config = self.config
            self._limits_at = n
            self._limits = (
                config.suspicion_confirmations(n) if config.dynamic_suspicion else 0,
                config.suspicion_min_timeout(n),
                config.suspicion_max_timeout(n),
            )
        return self._limits

    def _apply_dead(
        self, dead: Dead, now: float, *, verified: bool = False, relay: bool = True
    ) -> None:
        member = self._table.get(dead.node)
        if member is None:
            self._hold_accusation(dead)
            return
        if dead.incarnation < member.incarnation:
            return
        if member.state in GONE_STATES:
            return
        if not (verified or self._may_accuse(dead, member)):
            return
        if dead.node == self.node_id:
            if not self._leaving and (verified or self._authentic(dead)):
                self._refute(dead.incarnation, now, dead.accuser)
            return
        if not (verified or self._authentic(dead)):
            return
        departed = dead.accuser == dead.node
        member = self._table.own(member)
        member.incarnation = dead.incarnation
        self._table.restate(member, member.alive, dead)
        self._suspicions.pop(dead.node, None)
        state = MemberState.LEFT if departed else MemberState.DEAD
        self._set_state(member, state, now)
        self._events.append(MemberEvent(state.value, dead.node, dead.incarnation, now))
        if relay:
            self._queue(dead)

    def _apply_record(self, record: Record, now: float, relay: bool = True) -> None:
        known = self._table.record(record.node)
        if record.node == self.node_id:
            # A record of ours we do not remember: our previous life published
            # it. Outbid it so the swarm takes our current record.
            if record != known and record.seq >= self._record_seq and self._authentic(record):
                self._record_seq = record.seq
                if known is not None:
                    self.publish_record(known.body, now)
            return
        if known is not None:
            if record.seq < known.seq:
                self.drops["stale_record"] += 1
                return
            if record.seq == known.seq:
                return
        if self._validate_body is not None:
            reason = self._validate_body(record.body)
            if reason is not None:
                self.drops[reason] += 1
                return
        if not self._authentic(record):
            return
        self._table.set_record(record)
        self._events.append(MemberEvent("record", record.node, record.seq, now))
        # Only a member's record is gossiped on: one of an id we have not
        # verified (a candidate, or one we never heard of) would spend the
        # packet budget that real news needs. A candidate's is gossiped
        # when it becomes a member (`_promote`).
        if relay and self._table.get(record.node) is not None:
            self._queue(record)

    def _set_state(self, member: MemberEntry, state: MemberState, now: float) -> None:
        live_before = member.state in LIVE_STATES
        live_after = state in LIVE_STATES
        self._live_count += int(live_after) - int(live_before)
        member.state = state
        member.state_since = now
        if not live_after and now < self._oldest_gone:
            self._oldest_gone = now

    # --- dissemination ---------------------------------------------------------------

    def _queue(self, update: Update, key: Hashable | None = None) -> None:
        """Queue `update` for piggybacking, replacing older news of the same
        node; with eager gossip, a round is due at once."""
        self._broadcasts.put(key or _broadcast_key(update), update, _update_size(update))
        if self.config.eager_gossip:
            self._next_gossip = -math.inf

    def _piggyback(self) -> tuple[Update, ...]:
        """Take the least-sent updates that fit the packet budget."""
        if not self._broadcasts:
            return ()
        count, limit = self._retransmit
        if count != self._live_count:
            count = self._live_count
            limit = self.config.retransmit_limit(count)
            self._retransmit = (count, limit)
        return self._broadcasts.take(self.config.packet_budget, limit)

    def _gossip(self, now: float) -> None:
        self._next_gossip = now + self.config.gossip_interval
        if not self._broadcasts:
            return
        for node in self._random_peers(self.config.gossip_fanout, now):
            updates = self._piggyback()
            if not updates:
                return
            self._send(node, self._table.entry(node).addr, Gossip(updates))

    def _random_peers(self, count: int, now: float, *, live_only: bool = False) -> list[bytes]:
        """Up to `count` distinct random peers we may send to.

        Rejection sampling over the peer list keeps this O(count) per round,
        which matters when 10,000 simulated nodes gossip five times a second.
        """
        chosen: list[bytes] = []
        for _ in range(4 * count + 4):
            node = self._table.random_peer(self._rng)
            if node is None or node in chosen:
                continue
            member = self._table.entry(node)
            state = member.state
            if live_only and state is not MemberState.ALIVE:
                continue
            if state is MemberState.LEFT or (
                state is MemberState.DEAD
                and now - member.state_since > self.config.gossip_to_dead_time
            ):
                continue
            chosen.append(node)
            if len(chosen) == count:
                break
        return chosen

    # --- full-state sync, join and reconnect -------------------------------------------

    def _full_state(self, *, join: bool, reply: bool) -> PushPull:
        states: list[Alive | Suspect | Dead] = []
        for member in self._table:
            states.append(member.alive)
            if member.accusation is not None:
                states.append(member.accusation)
        return PushPull(join, reply, tuple(states), tuple(self._table.records()))

    def _send_join(self, now: float) -> None:
        # Back off while no seed answers (a wrong address or id, a seed not
        # up yet): 1, 2, 4, 8, 8... intervals, so a node left alone keeps
        # trying without hammering the addresses it was given.
        backoff = min(2**self._join_attempts, JOIN_BACKOFF_MAX_FACTOR)
        self._join_attempts += 1
        self._next_join = now + self.config.join_retry_interval * backoff
        state = self._full_state(join=True, reply=False)
        for node, addr in self._join_seeds:
            self._send(node, addr, state)

    def _ask_stranger(self, stranger: Envelope, now: float) -> None:
        """A node we do not know talked to us: ask for its full state.

        Gossip is probabilistic and can miss a member that joined at the same
        moment as we did; a stranger probing us is proof of such a gap. We
        send only our own entry and let it answer with everything, so a
        forged sender address cannot turn us into an amplifier against a
        third party. At most one such request per gossip interval.
        """
        self._next_introduction = now + self.config.gossip_interval
        record = self._table.record(self.node_id)
        records = () if record is None else (record,)
        self._send(
            stranger.sender, stranger.addr, PushPull(True, False, (self._me.alive,), records)
        )

    def _on_push_pull(self, envelope: Envelope, message: PushPull, now: float) -> None:
        """Merge another node's full state, then answer with ours."""
        sender = envelope.sender
        # The first full state a seed returns to our join: we asked for it,
        # and it is how a joiner learns a swarm of thousands at once, so its
        # members are not charged against the newcomer limits.
        vouched = (
            message.reply and not self._joined and any(sender == s for s, _ in self._join_seeds)
        )
        self._merge(sender, message.states, message.records, now, vouched=vouched)
        if message.reply:
            if not self._joined:
                self._joined = True
                self._next_join = math.inf
            return
        self._send(envelope.sender, envelope.addr, self._full_state(join=False, reply=True))

    def _merge(
        self,
        sender: bytes,
        states: Sequence[Alive | Suspect | Dead],
        records: Sequence[Record],
        now: float,
        *,
        vouched: bool = False,
    ) -> None:
        """Merge another node's state for some members (all of them, in a
        full state), in order: each member's Alive before its accusation.

        Only news about the sender itself is gossiped on (that is how a
        joiner becomes known); the rest stays local. Re-gossiping a whole
        swarm's worth of state after every sync would flood the network,
        and the other nodes get the same news from their own syncs.
        """
        for update in states:
            if isinstance(update, Dead) and update.accuser != update.node:
                self._merge_remote_death(update, now)
            elif isinstance(update, Alive):
                self._apply_alive(update, now, sender, update.node == sender, vouched=vouched)
            else:
                self._apply(update, now, sender, relay=update.node == sender)
        for record in records:
            self._apply_record(record, now, relay=record.node == sender)

    # --- delta sync (mesh.sync) ------------------------------------------------------

    def _start_sync(self, node: bytes, addr: str) -> None:
        """Open a delta sync with `node`: our digest, at a bucket count
        that suits the swarm's size, with our latest changes."""
        states, records = self._state_of(self._table.take_changed())
        digest = self._table.digest(digest_bits(self._live_count))
        self._send(node, addr, SyncDigest(digest, states, records))

    def _on_sync_digest(self, envelope: Envelope, message: SyncDigest, now: float) -> None:
        """Step two: merge the latest changes it carries; then, where our
        digests differ, send all we hold there."""
        theirs = message.fingerprints
        bits = bits_for(len(theirs))
        if bits is None:
            self.drops[R_SYNC_MALFORMED] += 1
            return
        self._merge(envelope.sender, message.states, message.records, now)
        ours = self._table.digest(bits)
        differ = tuple(
            bucket
            for bucket, (mine, other) in enumerate(zip(ours, theirs, strict=True))
            if mine != other
        )
        if not differ:
            return
        states, records = self._state_of(self._table.in_buckets(bits, differ))
        self._send(envelope.sender, envelope.addr, SyncDelta(False, bits, differ, states, records))

    def _on_sync_delta(self, envelope: Envelope, message: SyncDelta, now: float) -> None:
        """Step two's answer: merge what we hold differently, then send back
        what the other side holds differently or not at all. Step three's:
        merge it."""
        if not well_formed_delta(
            message.reply, message.bits, message.buckets, message.states, message.records
        ):
            self.drops[R_SYNC_MALFORMED] += 1
            return
        if message.reply:
            self._merge(envelope.sender, message.states, message.records, now)
            return
        table = self._table
        theirs: dict[bytes, int] = {}  # their member fingerprints, as `mesh.sync` defines them
        for update in (*message.states, *message.records):
            theirs[update.node] = theirs.get(update.node, 0) ^ update.fingerprint()
        news = {node for node, fingerprint in theirs.items() if not self._holds(node, fingerprint)}
        states = [update for update in message.states if update.node in news]
        records = [record for record in message.records if record.node in news]
        self._merge(envelope.sender, states, records, now)
        stale = (
            entry
            for entry in table.in_buckets(message.bits, message.buckets)
            if theirs.get(entry.node) != table.fingerprint(entry)
        )
        ours, our_records = self._state_of(stale)
        if ours:
            self._send(envelope.sender, envelope.addr, SyncDelta(True, 0, (), ours, our_records))

    def _holds(self, node: bytes, fingerprint: int) -> bool:
        """Whether we hold member `node` exactly as `fingerprint` says."""
        entry = self._table.get(node)
        return entry is not None and self._table.fingerprint(entry) == fingerprint

    def _state_of(
        self, entries: Iterable[MemberEntry]
    ) -> tuple[tuple[Alive | Suspect | Dead, ...], tuple[Record, ...]]:
        """The states and records a full state would carry for `entries`."""
        states: list[Alive | Suspect | Dead] = []
        records: list[Record] = []
        for entry in entries:
            states.append(entry.alive)
            if entry.accusation is not None:
                states.append(entry.accusation)
            record = self._table.record(entry.node)
            if record is not None:
                records.append(record)
        return tuple(states), tuple(records)

    def _merge_remote_death(self, dead: Dead, now: float) -> None:
        """Another node's full state says `dead.node` is dead.

        A death we did not witness becomes our own suspicion instead (as
        memberlist does): if the node is in fact alive it gets the suspicion
        timeout to refute, rather than dying on one member's word carried by
        a sync that may be minutes old.
        """
        member = self._table.get(dead.node)
        if dead.node == self.node_id:
            self._apply_dead(dead, now)
            return
        if member is None:
            self._hold_accusation(dead)
            return
        if member.state is not MemberState.ALIVE:
            return
        if dead.incarnation < member.incarnation:
            return
        if not self._may_accuse(dead, member) or not self._authentic(dead):
            return
        self._accuse(member, now)

    def _periodic_sync(self, now: float) -> None:
        self._next_push_pull = now + self.config.push_pull_period(self._live_count)
        self._forget_old_members(now)
        peers = self._random_peers(1, now, live_only=True)
        if peers:
            peer = self._table.entry(peers[0])
            self._start_sync(peer.node, peer.addr)

    def _reconnect(self, now: float) -> None:
        """Ping one random dead member; its ack starts a sync (`_on_ack`)."""
        self._next_reconnect = now + self.config.reconnect_interval
        for _ in range(8):
            node = self._table.random_peer(self._rng)
            if node is None:
                continue
            member = self._table.entry(node)
            if member.state is MemberState.DEAD:
                self._seq += 1
                self._send(node, member.addr, Ping(self._seq, node, ()))
                return

    def _forget_old_members(self, now: float) -> None:
        """Forget members gone longer than `reconnect_timeout`. The table is
        read only when one may be due (`_oldest_gone`): every sync period,
        at every member, it would otherwise be a pass over the whole swarm."""
        horizon = now - self.config.reconnect_timeout
        if self._oldest_gone >= horizon:
            return
        stale = []
        oldest = math.inf
        for member in self._table:
            if member.state in GONE_STATES:
                if member.state_since < horizon:
                    stale.append(member.node)
                else:
                    oldest = min(oldest, member.state_since)
        for node in stale:
            self._table.forget(node)
        self._oldest_gone = oldest

    # --- helpers -------------------------------------------------------------------

    def _sign_alive(self, incarnation: int) -> Alive:
        return Alive(
            self.node_id,
            incarnation,
            self.addr,
            self._signer.sign(alive_signing_bytes(self.node_id, incarnation, self.addr)),
        )

    def _send(self, node: bytes, addr: str, message: Message) -> None:
        self._sends.append(Send(addr, node, Envelope(self.node_id, self.addr, message)))

    def _view(self, member: MemberEntry) -> MemberView:
        return MemberView(
            member.node,
            member.addr,
            member.incarnation,
            member.state,
            member.state_since,
            self._table.last_seen(member.node),
            self._table.record(member.node),
        )
