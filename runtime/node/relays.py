"""A node's relays, wired: the relay it offers, and the ones it is reached through.

A reachable node runs a `RelayServer` (unless `--no-relay`) on its control
port plus `mesh.relay.RELAY_PORT_OFFSET` (any free port if that is taken)
and names it in its record (`addresses.relay`). A node the reachability
check found behind NAT picks relays (`mesh.relay.RelaySet`: its join seeds
first, then reachable members that offer one), holds a reservation with
each (`runtime.node.relay_client`), and advertises the first one's ports as
its control and data addresses: membership gossips a new Alive, the record
is re-signed with `reach` "relayed", and replies come to the relayed data
address. When that relay goes, the next one's ports are advertised.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Final, Protocol

import trio

from mesh.identity import Identity, node_id_text
from mesh.relay import RELAY_PORT_OFFSET, Held, Plane, RelaySet
from mesh.transport import Plane as ZmqPlane
from runtime.inference.dispatch import Engine
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


def _local(address: str) -> HostPort:
    """Where this machine reaches a plane bound at `address`."""
    bound = parse_hostport(address)
    if bound.host in WILDCARD_HOSTS:
        return HostPort("::1" if ":" in bound.host else "127.0.0.1", bound.port)
    return bound


class NodeRelays:
    """Both sides of relaying for one node; `start` in its nursery."""

    def __init__(self, node: RelayedNode, control: ZmqPlane, data: ZmqPlane) -> None:
        self._node = node
        self._local: dict[Plane, HostPort] = {
            "control": _local(control.address),
            "data": _local(data.address),
        }
        self._direct = (node.membership.address, node.options.advertised(data.address))
        self._advertised = self._direct
        self.server: RelayServer | None = None
        self.held = RelaySet()
        self._relay_of: dict[bytes, str] = {}
        self.counters: Counter[str] = Counter()

    async def start(self, nursery: trio.Nursery, api: str) -> dict[str, str]:
        """Bind the relay (if offered) and start choosing relays; the
        node's addresses as it starts (API at `api`), for its record."""
        options = self._node.options
        if options.relay:
            port = options.relay_port or self._local["control"].port + RELAY_PORT_OFFSET
            self.server = await self._bind(nursery, options.listen.host, port)
            log.info("relay: nodes behind NAT reserve at port %d", self.server.port)
        nursery.start_soon(self._choose_relays)
        control, data = self._direct
        return {"control": control, "data": data, "api": api, **self.offered_relay()}

    async def _bind(self, nursery: trio.Nursery, host: str, port: int) -> RelayServer:
        try:
            server = RelayServer(host, port)
            await nursery.start(server.run)
        except OSError as exc:
            log.warning("relay: cannot listen on port %d (%s); using any free port", port, exc)
            server = RelayServer(host, 0)
            await nursery.start(server.run)
        return server

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
                {"relay": self._relay_of.get(h.relay), "control": h.control, "data": h.data}
                for h in self.held.held
            ],
            "counters": dict(self.counters),
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
        def reserved(control: str, data: str) -> None:
            self.held.reserved(Held(relay, control, data))
            self.counters["reserved"] += 1
            log.info("relay: reserved at %s: control %s, data %s", address, control, data)
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

    def _advertise(self) -> None:
        """Advertise the first held relay's ports (else our own addresses)."""
        first = self.held.advertised
        wanted = self._direct if first is None else (first.control, first.data)
        if wanted == self._advertised:
            return
        self._advertised = control, data = wanted
        node = self._node
        node.addresses.update(control=control, data=data)
        node.engine.pipeline.reply_address = data
        node.reachability.relay = None if first is None else self._relay_of.get(first.relay)
        log.info("reached at control %s, data %s (%s)", control, data, node.reachability.reach)
        node.republish()  # the record first: the move tells every member of both at once
        node.membership.set_address(control)
