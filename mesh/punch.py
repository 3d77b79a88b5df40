"""Direct paths past NAT, sans-IO: which relayed peers to punch, how, and what came of it.

A node reached only through a relay costs every peer an extra leg per
message. Where the NATs allow, two nodes can talk directly instead
(issue 29, item 4; libp2p's DCUtR is the model): the *initiator*, a node
that sends to a relayed peer, asks that peer over its (relayed) HTTP API to
meet it, and both open one TCP connection at the same moment.

- `reverse`: the initiator is reachable, so it listens and the relayed peer
  dials it (outbound from behind any NAT: this always works).
- `simultaneous`: both are behind NAT. Each binds a port, learns the
  other's external address and connects to it at once (TCP simultaneous
  open); each NAT sees its own host's SYN go out first, so the other's is
  let in as its answer. It needs NATs that keep the port (the external
  port is the one bound); a symmetric NAT draws a new port per destination
  and the SYNs miss.

The punched connection carries the planes' ZMTP/CURVE end to end, so
nothing about it is trusted: CURVE proves who answers. This module holds
the decisions (`DirectPaths`: whom to try, when to try again, what to
count; `PunchBudget`: how many punches a node answers) and the request's
validation (`PunchRequest`), all with `now` passed in. The driver is
`runtime/node/direct_paths.py`; the design: docs/design/relays.md#direct-paths.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

Method = Literal["reverse", "simultaneous"]
METHODS: Final[tuple[Method, ...]] = ("reverse", "simultaneous")
PunchPlane = Literal["control", "data"]
PUNCH_PLANES: Final[tuple[PunchPlane, ...]] = ("control", "data")
"""The ZeroMQ planes a direct path carries; the HTTP API's calls are short
and rare, so they stay on the relay."""

PUNCH_TIMEOUT_S: Final = 5.0
"""How long both sides keep trying to connect: SYNs that cross before a
NAT opened are dropped and resent (Linux resends after 1 s, then 3 s), so
five seconds cover two resends at any RTT a chain can use."""
RETRY_S: Final = 60.0
"""A peer whose NAT let no punch through (`NAT_FAILURES`) is not tried
again on that plane for this long: a NAT that refused once refuses again
until something changes (its mappings, or the peer's relay and address)."""
SOON_RETRY_S: Final = 5.0
"""A punch that never reached the NATs (the peer did not answer, or said
not now) or a direct path that worked and then closed is tried again this
soon: the peer, not its NAT, was the trouble."""
NAT_FAILURES: Final = frozenset({"timeout", "connect_error"})
"""Failure reasons that are the NATs' verdict (`RETRY_S`); any other
reason is retried after `SOON_RETRY_S`."""
MAX_PATHS: Final = 32
"""Direct paths (peer and plane) a node keeps or tries at once: a node
talks to its chain's neighbours and a few members' probes, so 32 covers a
busy node, and each costs a socket and a local port."""
MAX_TRYING: Final = 4
"""Punches a node starts at once: each waits up to `PUNCH_TIMEOUT_S`."""
MAX_ANSWERING: Final = 8
"""Punches a node answers at once, all requesters together: each costs a
socket and a few SYNs to an address the requester named."""
ANSWER_INTERVAL_S: Final = PUNCH_TIMEOUT_S
"""One requester gets at most one answered punch per plane this often: a
member cannot turn a node into a SYN cannon at addresses of its choosing."""


class PunchError(ValueError):
    """A punch request or answer that is not well formed; the message says what."""


@dataclass(frozen=True, slots=True)
class PunchRequest:
    """What the initiator asks: meet me on `plane`, by `method`, at
    `host:port` (for `reverse` where it listens, for `simultaneous` its
    external address and the port it binds)."""

    plane: PunchPlane
    method: Method
    host: str
    port: int

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> PunchRequest:
        plane, method = body.get("plane"), body.get("method")
        if plane not in PUNCH_PLANES:
            raise PunchError(f"plane must be one of {', '.join(PUNCH_PLANES)}")
        if method not in METHODS:
            raise PunchError(f"method must be one of {', '.join(METHODS)}")
        return cls(plane, method, *meeting_point(body))

    def to_json(self) -> dict[str, Any]:
        return {"plane": self.plane, "method": self.method, "host": self.host, "port": self.port}


def meeting_point(body: object) -> tuple[str, int]:
    """(host, port) from a request or an answer: a routable unicast IP
    address (no names: nothing resolves a name a stranger chose; never
    loopback or link-local: a member must not make a node connect to its
    own machine's services and splice them into a plane) and a port."""
    if not isinstance(body, Mapping):
        raise PunchError("a meeting point is a JSON object with host and port")
    host, port = body.get("host"), body.get("port")
    try:
        address = ipaddress.ip_address(host) if isinstance(host, str) else None
    except ValueError:
        address = None
    if address is None or any(
        (address.is_unspecified, address.is_multicast, address.is_loopback, address.is_link_local)
    ):
        raise PunchError("host must be a routable unicast IP address")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise PunchError("port must be an integer in 1..65535")
    return str(address), port


def method_for(reachable: bool) -> Method:
    """How this node punches: a reachable one listens and is dialed."""
    return "reverse" if reachable else "simultaneous"


Key = tuple[bytes, PunchPlane]
State = Literal["trying", "direct", "failed", "lost"]


@dataclass(slots=True)
class _Path:
    state: State
    retry_at: float = float("inf")


@dataclass(slots=True)
class DirectPaths:
    """The initiator's book: per (peer, plane), trying, direct, failed or
    lost, bounded by `MAX_PATHS`; `to_try` picks what to punch next."""

    max_paths: int = MAX_PATHS
    max_trying: int = MAX_TRYING
    counters: Counter[str] = field(default_factory=Counter)
    _paths: dict[Key, _Path] = field(default_factory=dict)

    def to_try(self, wanted: Iterable[Key], now: float) -> list[Key]:
        """Of the peers and planes the caller would reach directly (relayed
        peers it talks to, in its order), those to punch now; each is
        `trying` until `succeeded` or `failed`."""
        picks: list[Key] = []
        room = self.max_trying - sum(1 for p in self._paths.values() if p.state == "trying")
        for key in wanted:
            if len(picks) >= room:
                break
            room_for_new = len(self._paths) + len(picks) < self.max_paths
            if self._due(key, now) and (key in self._paths or room_for_new):
                picks.append(key)
        for key in picks:
            self._paths[key] = _Path("trying")
            self.counters["attempts"] += 1
        return picks

    def _due(self, key: Key, now: float) -> bool:
        path = self._paths.get(key)
        return path is None or now >= path.retry_at

    def succeeded(self, key: Key, method: Method) -> None:
        self._paths[key] = _Path("direct")
        self.counters[f"direct_{method}"] += 1

    def failed(self, key: Key, reason: str, now: float) -> None:
        wait = RETRY_S if reason in NAT_FAILURES else SOON_RETRY_S
        self._paths[key] = _Path("failed", now + wait)
        self.counters[f"failed_{reason}"] += 1

    def lost(self, key: Key, now: float) -> None:
        """A direct path closed; it may be punched again soon."""
        if key in self._paths:
            self._paths[key] = _Path("lost", now + SOON_RETRY_S)
            self.counters["lost"] += 1

    def forget(self, keep: Iterable[bytes]) -> None:
        """Drop what is known of peers no longer relayed members (direct
        ones are closed by the driver)."""
        kept = set(keep)
        for key in [k for k in self._paths if k[0] not in kept]:
            del self._paths[key]

    def state(self, key: Key) -> State | None:
        path = self._paths.get(key)
        return None if path is None else path.state

    def direct(self) -> list[Key]:
        return [key for key, path in self._paths.items() if path.state == "direct"]


@dataclass(slots=True)
class PunchBudget:
    """The answering side's bound: at most `MAX_ANSWERING` punches at once,
    and one per requester and plane per `ANSWER_INTERVAL_S`."""

    max_answering: int = MAX_ANSWERING
    answering: int = 0
    counters: Counter[str] = field(default_factory=Counter)
    _last: dict[Key, float] = field(default_factory=dict)

    def admit(self, requester: bytes, plane: PunchPlane, now: float) -> str | None:
        """None if this punch may be answered (then `done` when over), else
        why not."""
        key = (requester, plane)
        if now - self._last.get(key, -ANSWER_INTERVAL_S) < ANSWER_INTERVAL_S:
            return self._refuse("too_often")
        if self.answering >= self.max_answering:
            return self._refuse("busy")
        for old in [k for k, t in self._last.items() if now - t >= ANSWER_INTERVAL_S]:
            del self._last[old]
        self._last[key] = now
        self.answering += 1
        return None

    def done(self, connected: bool) -> None:
        self.answering = max(0, self.answering - 1)
        self.counters["answered_direct" if connected else "answered_failed"] += 1

    def _refuse(self, reason: str) -> str:
        self.counters[f"refused_{reason}"] += 1
        return reason
