"""How many chats each HTTP client may run at once on this node.

Chat is public (docs/threat-model.md: HTTP clients are untrusted), so one
client must not take the node's whole capacity: every chat in flight holds a
session on each hop of its chain, a pipeline here and an open response.
`ChatQuota` counts chats in flight per client and in all, and refuses one
over either bound; the route answers `429` with `Retry-After` before it
reads the body (`runtime.api.openai`). A client is its peer address (IPv4,
or an IPv6 /64); `X-Forwarded-For` is never read. Sans-IO: `acquire` and
`release` are plain calls. Why these bounds and who counts as a client,
behind a proxy too: docs/design/api.md.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass
from typing import Final

MAX_CONCURRENT_PER_CLIENT: Final = 4
"""Chats one client may have in flight on this node (`shardmesh node
--max-chats-per-client`). A hop serves 16 sessions by default, so four
clients at their limit still leave a hop room for others; four is also more
than an interactive user (one conversation streaming, a retry) ever needs.
A batch client wanting more runs its own node, or asks several."""
MAX_CONCURRENT_TOTAL: Final = 64
"""Chats this node runs as an entry at once, whoever asks. Per-client
counting alone does not bound the node: an IPv6 attacker has 2**64
addresses in one /64 and more /64s to spare. 64 is four hops' worth of
default session slots, beyond what the chains one entry routes through can
serve at once, while still bounding this node's open responses and
pipelines."""
RETRY_AFTER_S: Final = 1
"""The `Retry-After` of a refusal: a slot frees as soon as one of the
client's chats ends, and a short chat on a small model takes about a second."""
IPV6_CLIENT_PREFIX: Final = 64
"""IPv6 clients are counted per /64 (one subnet, usually one machine's)."""

REASON_CLIENT: Final = "client_limit"
"""This client already has its share of chats in flight."""
REASON_TOTAL: Final = "node_busy"
"""The node already runs `max_total` chats, from all clients together."""


def client_key(host: str | None) -> str:
    """The quota's name for the peer `host`: the IPv4 address, the IPv6
    /64 (an IPv4-mapped IPv6 address is its IPv4 address), or the text as
    given when it is not an IP address (a Unix socket, a test client)."""
    if not host:
        return "unknown"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_CLIENT_PREFIX), strict=False))
    return str(address)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a chat was refused: `reason` (`REASON_CLIENT` or `REASON_TOTAL`) and a message."""

    reason: str
    message: str
    retry_after_s: int = RETRY_AFTER_S


class ChatQuota:
    """Chats in flight per client and in all. `acquire` a slot before a chat
    starts; `release` it exactly once when the chat is over."""

    def __init__(
        self, per_client: int = MAX_CONCURRENT_PER_CLIENT, total: int = MAX_CONCURRENT_TOTAL
    ) -> None:
        if per_client < 1 or total < 1:
            raise ValueError(f"quota limits must be >= 1, got {per_client} per client, {total}")
        self.per_client = per_client
        self.total = total
        self._in_flight: Counter[str] = Counter()
        self._count = 0

    def acquire(self, client: str) -> Refusal | None:
        """Take a slot for `client` (a `client_key`), or say why not."""
        if self._in_flight[client] >= self.per_client:
            return Refusal(
                REASON_CLIENT,
                f"this client already has {self.per_client} chats in flight on this node, "
                "its limit; retry when one has finished",
            )
        if self._count >= self.total:
            return Refusal(
                REASON_TOTAL,
                f"this node is running {self.total} chats, its limit; retry shortly",
            )
        self._in_flight[client] += 1
        self._count += 1
        return None

    def release(self, client: str) -> None:
        """Give back a slot `acquire` granted to `client`."""
        held = self._in_flight[client]
        if held <= 0:
            raise RuntimeError(f"release without acquire for client {client!r}")
        if held == 1:
            del self._in_flight[client]  # forget idle clients: the table stays small
        else:
            self._in_flight[client] = held - 1
        self._count -= 1

    def in_flight(self, client: str | None = None) -> int:
        """Chats in flight for `client`, or on the whole node."""
        return self._count if client is None else self._in_flight.get(client, 0)

    def clients(self) -> int:
        """How many clients have a chat in flight."""
        return len(self._in_flight)
