"""Parsing and formatting of the `H:P` endpoints the CLI takes.

Users type `HOST:PORT`; ZeroMQ wants `tcp://HOST:PORT`; hypercorn wants
`HOST:PORT` with IPv6 hosts in brackets; the status command wants a URL.
Converting in one place keeps every command accepting the same spellings and
rejecting bad ones with the same clear message.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*", ""})


class EndpointError(ValueError):
    """An endpoint the user typed cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str
    port: int

    @property
    def is_wildcard(self) -> bool:
        """True for addresses that mean "every interface" and so cannot be
        given to a peer as a place to reach us."""
        return self.host in WILDCARD_HOSTS

    def bracketed_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    def text(self) -> str:
        """`H:P` (IPv6 hosts bracketed)."""
        return f"{self.bracketed_host()}:{self.port}"

    def zmq(self) -> str:
        """`tcp://H:P`, the form transport addresses take."""
        return f"tcp://{self.text()}"

    def http(self) -> str:
        return f"http://{self.text()}"


def parse_hostport(text: str, *, allow_zero_port: bool = True) -> HostPort:
    """Parse `H:P`, `[v6]:P` or `tcp://H:P` into a HostPort.

    Port 0 asks the OS for a free port (useful for tests and the demo, where
    fixed ports would collide); callers that must dial the address forbid it.
    """
    raw = text.strip()
    if raw.startswith("tcp://"):
        raw = raw[len("tcp://") :]
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0 or raw[end + 1 : end + 2] != ":":
            raise EndpointError(f"{text!r} is not [IPV6]:PORT")
        host, port_text = raw[1:end], raw[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise EndpointError(f"{text!r}: {host!r} is not an IPv6 address") from exc
    else:
        host, sep, port_text = raw.rpartition(":")
        if not sep:
            raise EndpointError(f"{text!r} is not HOST:PORT")
        if ":" in host:
            raise EndpointError(f"{text!r}: write IPv6 hosts in brackets, [HOST]:PORT")
    if not host:
        raise EndpointError(f"{text!r} has no host")
    if not port_text.isdigit():
        raise EndpointError(f"{text!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535 or (port == 0 and not allow_zero_port):
        raise EndpointError(f"{text!r}: port {port} is out of range")
    return HostPort(host, port)


@dataclass(frozen=True, slots=True)
class Seed:
    """A node to join through: its id and its control address.

    The id is needed as much as the address: the planes are encrypted to
    the key that *is* the node's id, so a joiner that knew only an address
    could neither reach the node nor tell it from an impostor there (a
    libp2p bootstrap address carries its peer id for the same reason).
    """

    node: bytes
    at: HostPort

    def text(self) -> str:
        return f"{self.node.hex()}@{self.at.text()}"


def parse_seed(text: str) -> Seed:
    """Parse `NODE_ID@H:P` (`--join`); the id is 64 hex digits."""
    node_text, sep, address = text.strip().partition("@")
    if not sep:
        raise EndpointError(
            f"{text!r}: --join takes NODE_ID@HOST:PORT, the node's id and its address "
            "(a node prints its join address when it starts; `shardmesh status` shows it)"
        )
    try:
        node = bytes.fromhex(node_text)
    except ValueError:
        node = b""
    if len(node) != 32:
        raise EndpointError(f"{text!r}: {node_text!r} is not a node id (64 hex digits)")
    return Seed(node, parse_hostport(address, allow_zero_port=False))


def api_url(text: str) -> str:
    """Normalise what `status --api` accepts (`H:P` or a URL) to a base URL
    without a trailing slash."""
    raw = text.strip().rstrip("/")
    if raw.startswith(("http://", "https://")):
        return raw
    return parse_hostport(raw, allow_zero_port=False).http()
