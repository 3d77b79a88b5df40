"""Sybil bounds: how fast one neighbourhood, or one member, may bring in new identities.

A key costs nothing to make, so an open swarm cannot stop one machine from
presenting a thousand identities; it can make them arrive slowly.
`NewcomerLimit` admits new identities per source address and per network
prefix (/24 for IPv4, /48 for IPv6) at the rate the membership profile sets
(`MembershipConfig.newcomers_per_address`, `newcomers_per_prefix`). The
membership core applies it to advertised addresses, the planes' handshake
gate (`mesh.zap.HandshakeGate`) to real source addresses. Those say nothing
when each made-up id advertises an address of its own, so `IntroductionLimit`
also bounds new ids per introducing member and in all, per minute
(`MembershipConfig.introductions_per_member`, `introductions_total`). A
refused newcomer is counted and learned later, never an error. Sans-IO: time
is the caller's `now`; no lock (the ZAP wrapper adds one).

Where it applies and why each address is good enough:
docs/design/membership.md#newcomer-limits and #introductions.
"""

from __future__ import annotations

import functools
import ipaddress
from collections import OrderedDict, deque
from typing import Final

NEWCOMER_WINDOW_S: Final = 60.0
"""The limits are per this many seconds ("per minute")."""

MAX_TRACKED: Final = 16_384
"""Address and prefix buckets kept at most (least recently used go first).
A bucket untouched for a window is full again and carries no information,
so forgetting it costs nothing; only a flood from more distinct
neighbourhoods than this within one window could reset a depleted bucket,
and such an attacker is not bounded by per-neighbourhood limits anyway."""

R_ADDRESS: Final = "newcomer_address_rate"
"""Drop reason: the newcomer's address brought in its quota of new identities."""
R_PREFIX: Final = "newcomer_prefix_rate"
"""Drop reason: the newcomer's /24 (IPv4) or /48 (IPv6) brought in its quota."""

IPV4_PREFIX: Final = 24
IPV6_PREFIX: Final = 48


@functools.lru_cache(maxsize=65_536)
def neighbourhood(addr: str) -> tuple[str, str]:
    """`(address, prefix)` keys of an endpoint: ``tcp://10.1.2.3:7000``
    gives ``("10.1.2.3", "10.1.2.0/24")``, ``tcp://[2001:db8::1]:7000``
    gives ``("2001:db8::1", "2001:db8::/48")``; a bare IP (what ZAP
    reports) works the same. A host name (or a simulator's address) cannot
    be placed in a network without a lookup the core may not do, so it is
    its own address and its own prefix."""
    host = addr.split("://", 1)[-1]
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host, host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    bits = IPV4_PREFIX if ip.version == 4 else IPV6_PREFIX
    network = ipaddress.ip_network(f"{ip}/{bits}", strict=False)
    return str(ip), str(network)


class _Buckets:
    """Token buckets by key: `capacity` tokens, refilled at capacity/window
    per second. A bucket allows a burst of `capacity` and then a steady
    `capacity` per window, so no window of that length ever admits more
    than twice the limit."""

    __slots__ = ("_buckets", "_capacity", "_max", "_rate")

    def __init__(self, capacity: int, window: float, max_tracked: int) -> None:
        self._capacity = float(capacity)
        self._rate = capacity / window
        self._max = max_tracked
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()

    def level(self, key: str, now: float) -> float:
        bucket = self._buckets.get(key)
        if bucket is None:
            return self._capacity
        tokens, then = bucket
        return min(self._capacity, tokens + max(0.0, now - then) * self._rate)

    def take(self, key: str, now: float) -> None:
        self._buckets[key] = [self.level(key, now) - 1.0, now]
        self._buckets.move_to_end(key)
        while len(self._buckets) > self._max:
            self._buckets.popitem(last=False)


class NewcomerLimit:
    """New identities admitted per address and per prefix, per window."""

    def __init__(
        self,
        per_address: int,
        per_prefix: int,
        *,
        window: float = NEWCOMER_WINDOW_S,
        max_tracked: int = MAX_TRACKED,
    ) -> None:
        if per_address < 1 or per_prefix < 1 or window <= 0:
            raise ValueError("newcomer limits must be at least 1 per positive window")
        self._addresses = _Buckets(per_address, window, max_tracked)
        self._prefixes = _Buckets(per_prefix, window, max_tracked)

    def refusal(self, addr: str, now: float) -> str | None:
        """The drop reason a newcomer from `addr` would get at `now`, taking
        nothing: a caller can refuse a flood before paying to verify it."""
        address, prefix = neighbourhood(addr)
        if self._addresses.level(address, now) < 1.0:
            return R_ADDRESS
        if self._prefixes.level(prefix, now) < 1.0:
            return R_PREFIX
        return None

    def admit(self, addr: str, now: float) -> str | None:
        """Take one newcomer from `addr` (an endpoint or a bare IP) at `now`:
        None if admitted, else the drop reason (`R_ADDRESS`, `R_PREFIX`).
        A refusal takes nothing, so a refused newcomer that comes back
        later is not charged twice."""
        refused = self.refusal(addr, now)
        if refused is not None:
            return refused
        address, prefix = neighbourhood(addr)
        self._addresses.take(address, now)
        self._prefixes.take(prefix, now)
        return None


R_INTRODUCER: Final = "introducer_rate"
"""Drop reason: the member that told us of a new id has introduced its
quota of new ids this minute (`MembershipConfig.introductions_per_member`)."""
R_INTRODUCTIONS: Final = "introductions_rate"
"""Drop reason: this node has learned its quota of new ids this minute from
all introducers together (`MembershipConfig.introductions_total`)."""

MAX_INTRODUCERS: Final = 4_096
"""Introducers whose windows are kept at most (least recently used go
first). Introducers are senders the plane authenticated, whose keys the
handshake gate lets in at a bounded rate; a forgotten window only lets its
introducer start afresh, still under the total bound."""


class _Window:
    """At most `capacity` takes in any `window` seconds: the times of the
    takes still inside the window, oldest first. Exact, unlike a token
    bucket (which lets twice its capacity through in one window): what a
    flood gets in during any minute is the bound the profile names."""

    __slots__ = ("_capacity", "_times", "_window")

    def __init__(self, capacity: int, window: float) -> None:
        self._capacity = capacity
        self._window = window
        self._times: deque[float] = deque()

    def full(self, now: float) -> bool:
        times = self._times
        while times and times[0] <= now - self._window:
            times.popleft()
        return len(times) >= self._capacity

    def take(self, now: float) -> None:
        self._times.append(now)


class IntroductionLimit:
    """New ids learned per introducer, and from all introducers together,
    per window: the bound on what one admitted key (or a few) can make a
    node learn, whatever addresses the ids advertise. An introducer is the
    authenticated sender that told us of the id (the id itself, when it
    introduces itself). Sans-IO, like `NewcomerLimit`.

    Why and with which trade-offs: docs/design/membership.md#introductions."""

    def __init__(
        self,
        per_member: int,
        total: int,
        *,
        window: float = NEWCOMER_WINDOW_S,
        max_tracked: int = MAX_INTRODUCERS,
    ) -> None:
        if per_member < 1 or total < 1 or window <= 0:
            raise ValueError("introduction limits must be at least 1 per positive window")
        self._per_member = per_member
        self._window = window
        self._max = max_tracked
        self._total = _Window(total, window)
        self._by_introducer: OrderedDict[bytes, _Window] = OrderedDict()

    def refusal(self, introducer: bytes, now: float) -> str | None:
        """The drop reason a new id from `introducer` would get at `now`,
        taking nothing (checked before any signature is)."""
        window = self._by_introducer.get(introducer)
        if window is not None and window.full(now):
            return R_INTRODUCER
        if self._total.full(now):
            return R_INTRODUCTIONS
        return None

    def admit(self, introducer: bytes, now: float) -> str | None:
        """Take one new id from `introducer` at `now`: None if admitted,
        else the drop reason (and nothing taken)."""
        refused = self.refusal(introducer, now)
        if refused is not None:
            return refused
        window = self._by_introducer.get(introducer)
        if window is None:
            window = self._by_introducer[introducer] = _Window(self._per_member, self._window)
        window.take(now)
        self._total.take(now)
        self._by_introducer.move_to_end(introducer)
        while len(self._by_introducer) > self._max:
            self._by_introducer.popitem(last=False)
        return None
