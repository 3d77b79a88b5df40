"""Relays, sans-IO: how a node behind NAT is reached through a reachable one.

A relay splices TCP byte streams and never speaks ZeroMQ: the two peers'
ZMTP/CURVE session runs end to end through it, so it cannot read or alter
what they say. A node behind NAT holds a *reservation* (an outbound control
connection, signed with its key); the relay opens three public ports for it
(control plane, data plane, HTTP API), and when someone dials one it tells the node over
that connection, the node dials the relay again (outbound, so its NAT lets
it) and the relay joins the two streams. This module holds what decides:
the line protocol (`parse_line`), the relay's bookkeeping and limits
(`RelayBook`, `TokenBucket`) and the client's choice of relays (`RelaySet`),
all with `now` passed in. The trio drivers are `runtime/node/relay_server.py`
and `runtime/node/relay_client.py`; the design: docs/design/relays.md.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from mesh.identity import NODE_ID_BYTES

Plane = Literal["control", "data", "api"]
PLANES: Final[tuple[Plane, ...]] = ("control", "data", "api")
"""What a relay opens a public port for: the two ZeroMQ planes (CURVE end to
end) and the HTTP API (manifests, model files, the tokenizer an entry
fetches, calls passed to a leader; plain HTTP as it is when direct)."""

# --- limits -----------------------------------------------------------------

MAX_LINE_BYTES: Final = 256
"""A protocol line is a verb and at most two hex fields (64 + 128 chars):
under 220 bytes. Longer is garbage, refused before it is buffered."""
LINE_TIMEOUT_S: Final = 5.0
"""A new connection must send its line within this: two RTTs at 300 ms and
a busy interpreter fit many times; a slowloris holding sockets does not."""
MAX_RESERVATIONS: Final = 16
"""Nodes one relay serves at once: each costs three listening ports and a
connection. A swarm needs few relays per NAT'd node (two), so 16 per relay
covers a swarm where most nodes sit behind NAT and a few relay."""
MAX_SESSIONS: Final = 64
"""Spliced connections at once, all reservations together: a node's peers
keep one connection per ZeroMQ plane each (HTTP calls are short), so 64 is
a few NAT'd nodes each talking to a dozen peers; beyond it a dial is
refused (and the dialer retries)."""
MAX_PENDING: Final = 8
"""Dials waiting for their node to connect back, per reservation: a dial
burst from many peers at once is bounded, the rest refused."""
PENDING_TIMEOUT_S: Final = 5.0
"""How long a dialer waits for the node to dial back: one RTT from relay
to node and one back, under a second on any WAN."""
RELAY_BYTES_PER_S: Final = 8 * 1024 * 1024
"""What one relay forwards per second, all sessions together: a volunteer's
uplink, not a data centre's. Decode steps are a few KiB a token, so a relay
carries several chains at 8 MiB/s; a prefill of a long prompt is slower
through a relay than direct (docs/design/relays.md has the figures)."""
RELAY_BURST_BYTES: Final = 1024 * 1024
"""What may pass at once before the rate applies: one prefill chunk."""
KEEPALIVE_S: Final = 2.0
"""The client pings its relay this often on the reservation..."""
SILENT_S: Final = 3 * KEEPALIVE_S
"""...and either side ends a reservation silent this long (the local
profile declares a dead node dead in about 7 s: a relay's death is noticed
first, so the node moves to its other relay before peers give up)."""
RELAYS_WANTED: Final = 2
"""Relays a node behind NAT holds: one to be reached through, one ready
when the first dies."""
RETRY_S: Final = 5.0
"""A relay that refused or failed is not tried again for this long."""
RELAY_PORT_OFFSET: Final = 100
"""A relay listens for reservations at its control port plus this, so a
node behind NAT finds its join seed's relay from `--join ID@HOST:PORT`
alone; members also name their relay address in their record."""

# --- the line protocol ------------------------------------------------------

REASON_GARBAGE: Final = "garbage"
REASON_OVERSIZED: Final = "oversized"
REASON_SLOW: Final = "slow"
REASON_BAD_SIGNATURE: Final = "bad_signature"
REASON_FULL: Final = "reservations_full"
REASON_SESSIONS_FULL: Final = "sessions_full"
REASON_PENDING_FULL: Final = "pending_full"
REASON_UNKNOWN_TOKEN: Final = "unknown_token"
REASON_NO_ANSWER: Final = "no_answer"

TOKEN_BYTES: Final = 16
NONCE_BYTES: Final = 16
SIGNATURE_BYTES: Final = 64
RESERVE_CONTEXT: Final = b"shardmesh relay reservation v1\0"


def reserve_signing_bytes(nonce: bytes) -> bytes:
    """What a reserving node signs: the relay's fresh per-connection nonce,
    so a reservation cannot be replayed on another connection."""
    return RESERVE_CONTEXT + nonce


@dataclass(frozen=True, slots=True)
class Line:
    """One parsed protocol line: `verb` and its fields as bytes/ints."""

    verb: str
    fields: tuple[bytes | int | str, ...] = ()


class LineError(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_HEX_FIELDS: Final[Mapping[str, tuple[int, ...]]] = {
    "HELLO": (NONCE_BYTES,),
    "RESERVE": (NODE_ID_BYTES, SIGNATURE_BYTES),
    "ACCEPT": (TOKEN_BYTES,),
}


def encode_line(verb: str, *fields: bytes | int | str) -> bytes:
    parts = [verb, *(f.hex() if isinstance(f, bytes) else str(f) for f in fields)]
    return (" ".join(parts) + "\n").encode("ascii")


def parse_line(raw: bytes) -> Line:
    """A line (without its newline) as a `Line`; `LineError` names why not."""
    if len(raw) > MAX_LINE_BYTES:
        raise LineError(REASON_OVERSIZED)
    try:
        verb, *parts = raw.decode("ascii").split(" ")
    except UnicodeDecodeError:
        raise LineError(REASON_GARBAGE) from None
    if verb in _HEX_FIELDS:
        return Line(verb, _hex_fields(parts, _HEX_FIELDS[verb]))
    if verb == "RESERVED":
        *ports, seen = _exactly(parts, len(PLANES) + 1)
        return Line(verb, (*(_port(p) for p in ports), _ip(seen)))
    if verb == "CONNECT":
        token, plane = _exactly(parts, 2)
        if plane not in PLANES:
            raise LineError(REASON_GARBAGE)
        return Line(verb, (*_hex_fields([token], (TOKEN_BYTES,)), plane))
    if verb == "REFUSED":
        (reason,) = _exactly(parts, 1)
        return Line(verb, (reason[:64],))
    if verb in ("PING", "PONG") and not parts:
        return Line(verb)
    raise LineError(REASON_GARBAGE)


def _exactly(parts: list[str], n: int) -> list[str]:
    if len(parts) != n:
        raise LineError(REASON_GARBAGE)
    return parts


def _hex_fields(parts: list[str], sizes: tuple[int, ...]) -> tuple[bytes, ...]:
    values = []
    for part, size in zip(_exactly(parts, len(sizes)), sizes, strict=True):
        try:
            value = bytes.fromhex(part)
        except ValueError:
            raise LineError(REASON_GARBAGE) from None
        if len(value) != size:
            raise LineError(REASON_GARBAGE)
        values.append(value)
    return tuple(values)


def _ip(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise LineError(REASON_GARBAGE) from None


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise LineError(REASON_GARBAGE)
    return int(text)


# --- the relay's bookkeeping ------------------------------------------------


@dataclass(slots=True)
class _Pending:
    node: bytes
    plane: Plane
    since: float


@dataclass(slots=True)
class RelayBook:
    """What a relay holds: reservations, dials waiting for their node, and
    sessions spliced; each bounded, each refusal counted by its reason."""

    max_reservations: int = MAX_RESERVATIONS
    max_sessions: int = MAX_SESSIONS
    max_pending: int = MAX_PENDING
    reservations: dict[bytes, float] = field(default_factory=dict)
    """node -> when its reservation was made."""
    sessions: int = 0
    counters: Counter[str] = field(default_factory=Counter)
    _pending: dict[bytes, _Pending] = field(default_factory=dict)

    def reserve(self, node: bytes, now: float) -> str | None:
        """A refusal reason, or None: `node` holds a reservation from now
        (a second one replaces the first: the node reconnected)."""
        if node not in self.reservations and len(self.reservations) >= self.max_reservations:
            return self.refuse(REASON_FULL)
        self.reservations[node] = now
        self.counters["reservations_made"] += 1
        return None

    def release(self, node: bytes) -> None:
        self.reservations.pop(node, None)
        for token in [t for t, p in self._pending.items() if p.node == node]:
            del self._pending[token]

    def dialed(self, node: bytes, plane: Plane, token: bytes, now: float) -> str | None:
        """Someone dialed `node`'s `plane` port; `token` names the wait."""
        if node not in self.reservations:
            return self.refuse(REASON_UNKNOWN_TOKEN)
        if self.sessions + len(self._pending) >= self.max_sessions:
            return self.refuse(REASON_SESSIONS_FULL)
        if sum(1 for p in self._pending.values() if p.node == node) >= self.max_pending:
            return self.refuse(REASON_PENDING_FULL)
        self._pending[token] = _Pending(node, plane, now)
        return None

    def accepted(self, token: bytes, now: float) -> tuple[bytes, Plane] | None:
        """The node dialed back with `token`: (node, plane), and the session
        counts from now; None (counted) for a token nobody waits on."""
        pending = self._pending.pop(token, None)
        if pending is None or now - pending.since > PENDING_TIMEOUT_S:
            self.refuse(REASON_UNKNOWN_TOKEN)
            return None
        self.sessions += 1
        self.counters["sessions_spliced"] += 1
        return pending.node, pending.plane

    def abandon(self, token: bytes) -> None:
        """A dial nobody accepted in time."""
        if self._pending.pop(token, None) is not None:
            self.refuse(REASON_NO_ANSWER)

    def ended(self) -> None:
        self.sessions = max(0, self.sessions - 1)

    def refuse(self, reason: str) -> str:
        self.counters[f"refused_{reason}"] += 1
        return reason

    def status(self) -> dict[str, object]:
        return {
            "reservations": len(self.reservations),
            "sessions": self.sessions,
            "pending": len(self._pending),
            "counters": dict(self.counters),
        }


@dataclass(slots=True)
class TokenBucket:
    """Bytes per second with a burst: `delay` charges `n` bytes at `now`
    and says how long the sender waits before sending them."""

    rate: float = RELAY_BYTES_PER_S
    burst: float = RELAY_BURST_BYTES
    _level: float | None = None
    _at: float = 0.0

    def delay(self, n: int, now: float) -> float:
        level = self.burst if self._level is None else self._level
        level = min(self.burst, level + (now - self._at) * self.rate) - n
        self._level, self._at = level, now
        return 0.0 if level >= 0 else -level / self.rate


# --- the client's choice of relays ------------------------------------------


@dataclass(frozen=True, slots=True)
class Held:
    """A reservation a node holds: the relay and the addresses it gave
    (`tcp://` for the planes, `http://` for the API)."""

    relay: bytes
    control: str
    data: str
    api: str


@dataclass(slots=True)
class RelaySet:
    """Which relays a node behind NAT holds: at most `RELAYS_WANTED`, chosen
    from the relays on offer (its join seeds, and reachable members whose
    record offers relaying), a failed one not retried within `RETRY_S`.
    The first reservation made is the one advertised until it is lost."""

    wanted: int = RELAYS_WANTED
    held: list[Held] = field(default_factory=list)
    trying: set[bytes] = field(default_factory=set)
    _failed: dict[bytes, float] = field(default_factory=dict)

    def to_try(self, offered: Mapping[bytes, str], now: float) -> list[tuple[bytes, str]]:
        """Relays to reserve at now, in a stable order (seeds first: the
        caller orders `offered`); each is then `trying` until settled."""
        busy = {h.relay for h in self.held} | self.trying
        room = self.wanted - len(busy)
        picks = []
        for relay, address in offered.items():
            if room <= 0:
                break
            if relay in busy or now - self._failed.get(relay, -RETRY_S) < RETRY_S:
                continue
            picks.append((relay, address))
            self.trying.add(relay)
            room -= 1
        return picks

    def reserved(self, held: Held) -> None:
        self.trying.discard(held.relay)
        self.held = [h for h in self.held if h.relay != held.relay] + [held]

    def lost(self, relay: bytes, now: float) -> None:
        """A reservation failed or ended: forget it, retry later."""
        self.trying.discard(relay)
        self.held = [h for h in self.held if h.relay != relay]
        self._failed[relay] = now

    @property
    def advertised(self) -> Held | None:
        return self.held[0] if self.held else None
