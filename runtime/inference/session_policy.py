"""Who gets a hop's session slots when they run short: admit, refuse, or displace.

A hop serves at most `max_sessions` at once, and an `open` costs a stranger
nothing, so `SessionLimits.decide` bounds what one key and one network
(/24, /48) may hold, lets a session that never forwarded give way after a
short grace to an asker holding fewer, and lets a member with standing on
this hop (`Standing`: it completed a session here) displace strangers.
The `runtime.inference.hop_server.HopServer` applies its decisions.
Sans-IO: `now` comes in; no clock, socket or randomness here.

Why each rule: docs/design/inference-protocol.md#who-holds-a-hops-sessions.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from runtime.inference.deadlines import DEADLINE_FLOOR_S, OPEN_S

__all__ = [
    "MAX_PREFIX_SHARE",
    "MAX_SESSION_SHARE",
    "MAX_STANDING_PEERS",
    "PENDING_GRACE_S",
    "Admit",
    "Decision",
    "Holder",
    "Refuse",
    "SessionLimits",
    "Slot",
    "Standing",
]

MAX_SESSION_SHARE: Final = 0.5
"""The share of a hop's sessions one peer (one entry) may hold at once. An
entry that many clients use legitimately routes many chats through one
hop, so the share is generous; below 1 it stops one peer, honest or not,
from taking every slot and turning everyone else away with "busy"."""

MAX_PREFIX_SHARE: Final = 0.75
"""The share one source network (an IPv4 /24, an IPv6 /48: what one
operator can cheaply hold many addresses in) may hold, counting the
sessions of its peers without standing. Keys are free, networks are not,
so this is the bound a swarm of fresh keys meets. It is above the key
share because honest entries share networks too (a LAN, a NAT, a campus,
loopback in tests), and members with standing are outside it: a network
of returning members is never capped by its newcomers."""

PENDING_GRACE_S: Final = OPEN_S + DEADLINE_FLOOR_S
"""How long a session that has not had its first ``forward`` keeps its slot
against any asker: 4 s. An entry sends its prefill once every hop answered
``open`` (within ``OPEN_S``), so a first hop sees its forward within that;
a later hop also waits for the hops before it to prefill, which
``DEADLINE_FLOOR_S`` covers for ordinary prompts on ordinary hardware.
Past it a pending session is not closed (a slow chain's prefill may take
minutes, bounded by the idle reaper); it only gives way, first of all
sessions, when the hop is full and the asker holds fewer sessions here
than its holder. So no stranger holds a slot it never uses for longer
than this against someone who needs it."""

MAX_STANDING_PEERS: Final = 4096
"""Peers a hop remembers as having standing; the least recently served
go first. Far above the entries one hop serves; a flood of keys that each
completed a session (real work, on this hop) can only evict."""


@dataclass(frozen=True, slots=True)
class Holder:
    """Who asks for or holds a session: its proved ``peer`` id, its source
    network (``prefix``; None for the node itself, whose messages never
    cross a socket) and whether it has ``standing`` here."""

    peer: bytes
    prefix: str | None
    standing: bool


@dataclass(frozen=True, slots=True)
class Slot:
    """One held session as the policy sees it: opened at ``opened_at``,
    ``started`` once its first forward came, last used at ``last_used``;
    ``graced`` unless it was opened by displacing another (see `Admit`)."""

    session: str
    holder: Holder
    opened_at: float
    started: bool
    last_used: float
    graced: bool = True


@dataclass(frozen=True, slots=True)
class Admit:
    """Open the session; first end ``displace`` (None: a slot is free),
    telling its entry ``why`` so that it routes around this hop. The new
    session is ``graced`` (it keeps its slot through `PENDING_GRACE_S`)
    unless a stranger's open displaced another for it: otherwise two
    squatters displacing each other would keep refreshing their grace."""

    displace: str | None = None
    why: str = ""
    graced: bool = True


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer ``busy`` with ``reason``."""

    reason: str


Decision = Admit | Refuse


@dataclass(frozen=True)
class SessionLimits:
    """The rules for one hop's ``max_sessions`` slots (see the module)."""

    max_sessions: int
    pending_grace_s: float = PENDING_GRACE_S

    @property
    def key_share(self) -> int:
        return max(1, int(self.max_sessions * MAX_SESSION_SHARE))

    @property
    def prefix_share(self) -> int:
        return max(1, int(self.max_sessions * MAX_PREFIX_SHARE))

    def decide(
        self, asker: Holder, slots: Sequence[Slot], now: float, *, leaving: bool = False
    ) -> Decision:
        """What to do with an ``open`` from ``asker`` while ``slots`` are held."""
        if leaving:
            return Refuse("this node is leaving the swarm")
        held = Counter(slot.holder.peer for slot in slots)
        if held[asker.peer] >= self.key_share:
            return Refuse(f"this peer holds its share ({self.key_share}) of the sessions")
        if not asker.standing and asker.prefix is not None:
            network = sum(
                1 for s in slots if s.holder.prefix == asker.prefix and not s.holder.standing
            )
            if network >= self.prefix_share:
                return Refuse(
                    f"this network ({asker.prefix}) holds its share ({self.prefix_share})"
                    " of the sessions"
                )
        if len(slots) < self.max_sessions:
            return Admit()
        return self._displace(asker, slots, held, now)

    def _displace(
        self, asker: Holder, slots: Sequence[Slot], held: Counter[bytes], now: float
    ) -> Decision:
        """The hop is full: the session that gives way to ``asker``, if any.
        Pending ones first, of the peer holding the most, oldest first; a
        started one only to a member with standing, least recently used."""
        mine = held[asker.peer]
        victims = [
            s for s in slots if self._gives_way(s, asker, _evener(held[s.holder.peer], mine), now)
        ]
        if not victims:
            return Refuse(f"session limit ({self.max_sessions}) reached")
        victim = min(
            victims,
            key=lambda s: (
                s.started,
                -held[s.holder.peer],
                s.last_used if s.started else s.opened_at,
            ),
        )
        if self._unused(victim, now):
            why = f"no forward within {self.pending_grace_s:g} s of open while this hop was full"
        else:
            why = "a member with standing on this hop needed the slot"
        return Admit(victim.session, f"displaced: {why}", graced=asker.standing)

    def _gives_way(self, slot: Slot, asker: Holder, evener: bool, now: float) -> bool:
        """Whether ``slot`` may end for ``asker``: unused past its grace, to
        an asker whom it leaves holding no more than its holder (`_evener`);
        or any stranger's, to a member with standing."""
        if slot.holder.peer == asker.peer:
            return False
        if evener and self._unused(slot, now):
            return True
        return asker.standing and not slot.holder.standing

    def _unused(self, slot: Slot, now: float) -> bool:
        """No forward yet, and no grace left (or none given)."""
        if slot.started:
            return False
        return not slot.graced or now - slot.opened_at >= self.pending_grace_s


def _evener(holder_count: int, asker_count: int) -> bool:
    """Whether moving a slot from a holder of ``holder_count`` to an asker of
    ``asker_count`` evens them out: the asker holds none, or at least two
    fewer. Between holders one apart it would only swap who holds more, and
    they would take the slot back and forth for ever."""
    return asker_count == 0 < holder_count or holder_count >= asker_count + 2


class Standing:
    """The peers with standing on this hop: each completed a session here
    (its entry closed it after this hop computed at least one step).

    The signal is local and unforgeable: a peer is the key its CURVE
    handshake proved, and only this hop's own work for that key earns it,
    so no gossip, record or other node's word can grant it. It is cheap to
    keep (a bounded set) and costs a peer real use of the hop to earn; a
    key that squats spends it: a session of its that is displaced or
    reaped before its first forward takes its standing away.
    """

    def __init__(self, max_peers: int = MAX_STANDING_PEERS) -> None:
        self._max = max_peers
        self._peers: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, peer: object) -> bool:
        return peer in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def earn(self, peer: bytes) -> None:
        self._peers[peer] = None
        self._peers.move_to_end(peer)
        while len(self._peers) > self._max:
            self._peers.popitem(last=False)

    def lose(self, peer: bytes) -> None:
        self._peers.pop(peer, None)
