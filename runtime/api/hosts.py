"""Which `Host` names a node takes calls that change the swarm for: the DNS rebinding guard.

A web page cannot make a cross-site JSON POST without a CORS preflight
(`runtime.api.http`), unless its own name resolves to the node: DNS
rebinding points `evil.example` at 127.0.0.1 once the page has loaded, and
the browser then treats the node as the page's own origin. The browser
still sends `Host: evil.example`, so calls that change the swarm (each
check of `runtime.api.auth.Gate`, and a join) are refused (`421`) unless
the Host is a name this node serves on: an IP address (no DNS, so nothing
to rebind: 127.0.0.1, the bound address, a LAN address), `localhost` or a
`*.localhost` name (RFC 6761: always loopback), or the host of one of the
node's own addresses (its API, control and data planes, `--advertise`d
names included). A request without a Host (HTTP/1.0 tools) passes: browsers
always send one.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

LOOPBACK_NAME: Final = "localhost"
"""RFC 6761: `localhost` and every name under it resolve to loopback only."""
MAX_SHOWN: Final = 80
"""How much of a refused Host a message repeats."""


def host_name(header: str) -> str:
    """The name of a `Host` header: its port, IPv6 brackets and a trailing
    dot dropped, lower case (`[::1]:8000` -> `::1`, `Node.Example.:80` ->
    `node.example`)."""
    host = header.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        name = host[1:end] if end > 0 else host
    elif host.count(":") == 1:
        name = host.partition(":")[0]
    else:
        name = host
    return name.rstrip(".")


def served_names(addresses: Mapping[str, str]) -> frozenset[str]:
    """The host names of a node's addresses (`tcp://h:p`, `http://h:p`)."""
    names = set()
    for address in addresses.values():
        name = urlsplit(address).hostname
        if name:
            names.add(name.rstrip("."))
    return frozenset(names)


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_refusal(header: str | None, addresses: Mapping[str, str]) -> str | None:
    """Why a call with `Host: header` is not for this node (whose addresses
    are `addresses`), or None when it is (see the module doc)."""
    if header is None:
        return None
    name = host_name(header)
    names = served_names(addresses)
    if is_ip(name) or name == LOOPBACK_NAME or name.endswith(f".{LOOPBACK_NAME}"):
        return None
    if name in names:
        return None
    known = ", ".join(sorted(n for n in names if not is_ip(n))) or "no other name"
    return (
        f"Host {header[:MAX_SHOWN]!r} is not a name this node serves on (an IP address, "
        f"localhost, {known}): calls that change the swarm are refused for other names, "
        "as a guard against DNS rebinding; call it by its address"
    )
