"""A node's relays, wired: the relay it offers, and the ones it is reached through.

A reachable node runs a `RelayServer` (unless `--no-relay`) on its control
port plus `mesh.relay.RELAY_PORT_OFFSET` (any free port if that is taken)
and names it in its record (`addresses.relay`). A node the reachability
check found behind NAT picks relays (`mesh.relay.RelaySet`: its join seeds
first, then reachable members that offer one), holds a reservation with
each (`runtime.node.relay_client`), and advertises the first one's ports as
its control, data and API addresses (the API only when it listens beyond
loopback: the relay must not publish what the operator kept local), and
every relay it holds in the record's `addresses.relayed`: membership
gossips a new Alive, the record is re-signed with `reach` "relayed", and
replies come to the relayed data address. When that relay goes, the next
one's ports are advertised.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

import trio

from mesh.identity import Identity, node_id_text
from mesh.records import RelayedAt
from mesh.relay import RELAY_PORT_OFFSET, Held, Plane, RelaySet
from mesh.transport import Plane as ZmqPlane
from runtime.inference.dispatch import Engine
from runtime.node.direct_paths import NodeDirectPaths, Reach, public_reach
from runtime.node.hostport import WILDCARD_HOSTS, HostPort, parse_hostport
from runtime.node.membership_driver import MembershipDriver
from runtime.node.options import NodeOptions
from runtime.node.reachability_driver import ReachabilityDriver
from runtime.node.relay_client import STREAM_ERRORS, RelayRefused, hold_reservation
from runtime.node.relay_server import RelayServer
from runtime.node.swarm_view import SwarmView

log = logging.getLogger("shardmesh.node")

TICK_S: Final = 0.5
"""How often the relays wanted are compared with those held."""


class RelayedNode(Protocol):
    """What the wiring reads and moves (`runtime.node.daemon.Node`)."""

    options: NodeOptions
    identity: Identity
    membership: MembershipDriver
    swarm: SwarmView
    reachability: ReachabilityDriver
    engine: Engine
    addresses: dict[str, str]

    def republish(self) -> None: ...


LOOPBACK_HOSTS: Final = frozenset({"127.0.0.1", "::1", "localhost"})


def _local(address: str | HostPort) -> HostPort:
    """Where this machine reaches a plane bound at `address`."""
    bound = parse_hostport(address) if isinstance(address, str) else address
    if bound.host in WILDCARD_HOSTS:
        return HostPort("::1" if ":" in bound.host else "127.0.0.1", bound.port)
    return bound


def relayed_api(bind: HostPort, url: str) -> HostPort | None:
    """Where the relay splices API dials to: the HTTP server bound at
    `bind` (its port from `url`, the advertised URL), unless it listens on
    loopback only, which the operator meant to keep off the network."""
    if bind.host in LOOPBACK_HOSTS:
        return None
    port = urlsplit(url).port
    assert port is not None, "the API's URL names its bound port"
    return _local(HostPort(bind.host, port))


class NodeRelays:
    """Both sides of relaying for one node; `start` in its nursery."""

    def __init__(self, node: RelayedNode, control: ZmqPlane, data: ZmqPlane) -> None:
        self._node = node
        self._local: dict[Plane, HostPort] = {
            "control": _local(control.address),
            "data": _local(data.address),
        }
        self._data_bound = data.address
        self._direct: dict[str, str] = {}
        self._advertised: dict[str, str] = {}
        self.server: RelayServer | None = None
        self.held = RelaySet()
        self._relay_of: dict[bytes, str] = {}
        self._published: tuple[RelayedAt, ...] = ()
        self.seen_as: str | None = None
        """This node's public IP as the last relay that took its
        reservation saw it (its NAT's): where a direct path meets it."""
        self.direct = NodeDirectPaths(
            node.identity,
            node.swarm,
            {"control": control, "data": data},
            {"control": self._local["control"], "data": self._local["data"]},
            self._reach,
        )
        node.reachability.direct_peers = self.direct.peers
        self.counters: Counter[str] = Counter()

    async def start(self, nursery: trio.Nursery, api: str) -> dict[str, str]:
        """Bind the relay (if offered) and start choosing relays; the
        node's addresses as it starts (API at `api`), for its record."""
        options = self._node.options
        if options.relay:
            port = options.relay_port or self._local["control"].port + RELAY_PORT_OFFSET
            self.server = await self._bind(nursery, options.listen.host, port)
            log.info("relay: nodes behind NAT reserve at port %d", self.server.port)
        api_local = relayed_api(options.api_bind, api)
        if api_local is not None:
            self._local["api"] = api_local
        nursery.start_soon(self._choose_relays)
        nursery.start_soon(self.direct.run)
        data = options.advertised(self._data_bound)
        self._direct = {"control": self._node.membership.address, "data": data, "api": api}
        self._advertised = dict(self._direct)
        return {**self._direct, **self.offered_relay()}

    async def _bind(self, nursery: trio.Nursery, host: str, port: int) -> RelayServer:
        try:
            server = RelayServer(host, port)
            await nursery.start(server.run)
        except OSError as exc:
            log.warning("relay: cannot listen on port %d (%s); using any free port", port, exc)
            server = RelayServer(host, 0)
            await nursery.start(server.run)
        return server

    def _reach(self) -> Reach:
        node = self._node
        return public_reach(node.reachability.reach, node.membership.address, self.seen_as)

    def offered_relay(self) -> dict[str, str]:
        """`relay` for the record's addresses, when this node offers one."""
        if self.server is None:
            return {}
        host = parse_hostport(self._node.membership.address).host
        return {"relay": HostPort(host, self.server.port).zmq()}

    def status(self) -> dict[str, Any]:
        """The status document's `relays`."""
        return {
            "offered": None if self.server is None else self.server.status(),
            "held": [
                {
                    "relay": self._relay_of.get(h.relay),
                    "control": h.control,
                    "data": h.data,
                    "api": h.api,
                }
                for h in self.held.held
            ],
            "counters": dict(self.counters),
            "direct": self.direct.status(),
        }

    # --- reached through relays ------------------------------------------------

    def _offered(self) -> dict[bytes, str]:
        """Relays to choose from, in order: the join seeds (at the relay
        address their record names, else at their control port plus
        `RELAY_PORT_OFFSET`), then reachable members offering one."""
        own = self._node.identity.node_id
        named = {
            view.node: record.addresses.relay
            for view, record in self._node.swarm.records()
            if view.node != own
            and record is not None
            and record.addresses.relay is not None
            and record.reach == "direct"
            and str(view.state) == "alive"
        }
        found: dict[bytes, str] = {}
        for seed, address in self._node.options.seed_addresses():
            at = parse_hostport(address)
            guessed = HostPort(at.host, at.port + RELAY_PORT_OFFSET).zmq()
            found[seed] = named.get(seed) or guessed
        for node, relay in named.items():
            found.setdefault(node, relay)
        found.pop(own, None)
        return found

    async def _choose_relays(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                if self._node.reachability.verdict == "unreachable":
                    for relay, address in self.held.to_try(self._offered(), trio.current_time()):
                        self._relay_of[relay] = address
                        nursery.start_soon(self._hold, relay, address)
                await trio.sleep(TICK_S)

    async def _hold(self, relay: bytes, address: str) -> None:
        def reserved(ports: dict[Plane, HostPort], seen: str) -> None:
            held = Held(relay, ports["control"].zmq(), ports["data"].zmq(), ports["api"].http())
            self.held.reserved(held)
            self.seen_as = seen
            self.counters["reserved"] += 1
            log.info("relay: reserved at %s: %s", address, held)
            self._advertise()

        try:
            await hold_reservation(
                self._node.identity, address, self._local, reserved, self.counters
            )
            self.counters["ended"] += 1
        except (RelayRefused, trio.TooSlowError, *STREAM_ERRORS) as exc:
            self.counters["failed"] += 1
            log.info("relay %s (%s): %s", address, node_id_text(relay)[:16], exc or type(exc))
        finally:
            self.held.lost(relay, trio.current_time())
            self._advertise()

    def relayed(self) -> tuple[RelayedAt, ...]:
        """The record's `addresses.relayed`: every relay held, the
        advertised one first."""
        return tuple(
            RelayedAt(node_id_text(h.relay), h.control, h.data, self._api_of(h))
            for h in self.held.held
        )

    def _api_of(self, held: Held) -> str:
        """The API address to advertise with `held`: its port if the relay
        splices to our API, else the API as it is (loopback only)."""
        return held.api if "api" in self._local else self._direct["api"]

    def _advertise(self) -> None:
        """Advertise the first held relay's ports (else our own addresses)."""
        first = self.held.advertised
        wanted = dict(self._direct)
        if first is not None:
            wanted.update(control=first.control, data=first.data, api=self._api_of(first))
        relayed = self.relayed()
        if wanted == self._advertised and relayed == self._published:
            return
        self._advertised, self._published = wanted, relayed
        node = self._node
        node.addresses.update(wanted)
        node.engine.pipeline.reply_address = wanted["data"]
        node.reachability.relay = None if first is None else self._relay_of.get(first.relay)
        log.info("reached at %s (%s)", wanted, node.reachability.reach)
        node.republish()  # the record first: the move tells every member of both at once
        node.membership.set_address(wanted["control"])
