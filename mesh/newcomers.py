"""Sybil bounds: how fast one network neighbourhood may bring in new identities.

A key costs nothing to make, so an open swarm cannot stop one machine from
presenting a thousand identities; it can make them arrive slowly.
`NewcomerLimit` admits new identities per source address and per network
prefix (/24 for IPv4, /48 for IPv6) at the rate the membership profile sets
(`MembershipConfig.newcomers_per_address`, `newcomers_per_prefix`). The
membership core applies it to advertised addresses, the planes' handshake
gate (`mesh.zap.HandshakeGate`) to real source addresses. A refused newcomer
is counted and learned later, never an error. Sans-IO: time is the caller's
`now`; no lock (the ZAP wrapper adds one).

Where it applies and why each address is good enough:
docs/design/membership.md#newcomer-limits.
"""

from __future__ import annotations

import functools
import ipaddress
from collections import OrderedDict
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
