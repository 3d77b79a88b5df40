"""The trio driver around `mesh.reachability`: dial-back requests out, dial-backs in.

As the asker, every `TICK_S` it feeds the core the alive members and the
join seeds, and for each `Ask` opens a fresh CURVE connection to that
member's control address and sends a `DialRequest` (the handshake
completing is what tells the core the request was taken). As the prober,
it answers a `DialRequest` by dialling the control address in the
requester's own signed record (never an address a message names: the
request names none), at most once per `SERVE_INTERVAL_S` per requester and
`MAX_DIALS` at once, over a fresh connection with a short timeout, and
sends `DialBack` with the nonce: that it arrives proves the requester can
be dialled there. The verdict goes into the node's record (`reach`) and
its status, in words (`reachability_text`).
"""

from __future__ import annotations

import logging
import os
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final

import trio
import zmq

from mesh.identity import PlaneKeys, curve_public_key
from mesh.member_table import LIVE_STATES
from mesh.messages import DialBack, DialRequest, Envelope
from mesh.reachability import DIAL_TIMEOUT_S, Reachability, RequestLimit, Verdict
from mesh.records import NodeRecord, Reach
from mesh.transport import NODE_ID_PROPERTY
from mesh.wire import EncodeError, encode_envelope
from runtime.node.membership_driver import MembershipDriver

log = logging.getLogger("shardmesh.node")

TICK_S: Final = 0.5
"""How often the core is ticked: its timers are seconds long."""
FIRST_CHECK_S: Final = 1.0
"""The first round waits this long after start, so the join's push-pull
(which carries our record) reaches the seeds before our request does."""
MAX_DIALS: Final = 16
"""Dial-backs in flight at once: each is a socket and a TCP connection, so
a burst of requesters beyond it is refused (`requests_busy`) rather than
queued or allowed to exhaust file descriptors. (Our own requests are at
most `mesh.reachability.PROBERS` at once.)"""
RECORD_WAIT_S: Final = 2.0
"""A request from a member whose record has not reached us yet waits this
long for gossip to bring it: a newcomer asks soon after joining, and
`mesh.reachability.ANSWER_WAIT_S` leaves room for this and the dial."""
POLL_S: Final = 0.01
"""How often a dial looks at its socket monitor for the handshake."""
FLUSH_LINGER_MS: Final = 1_000
"""How long a closed dial socket keeps trying to deliver its one message."""

TEXT_CHECKING: Final = "checking reachability…"


def reachability_text(
    verdict: Verdict, address: str | None, relay: str | None = None, direct_peers: int = 0
) -> str:
    """The verdict in the words the status page and `shardmesh status` show
    (`relay`: the relay this node is reached through, if any;
    `direct_peers`: members it holds a direct path past NAT with)."""
    past_nat = f"; direct to {direct_peers} peers past NAT" if direct_peers else ""
    if verdict == "direct":
        return f"reachable at {address}{past_nat}"
    if verdict == "unreachable" and relay is not None:
        return f"behind NAT: serving through relay {relay} (peers cannot dial {address}){past_nat}"
    if verdict == "unreachable":
        return f"behind NAT: peers cannot dial {address} back; looking for a relay"
    return TEXT_CHECKING


async def dial_once(
    keys: PlaneKeys,
    node: bytes,
    address: str,
    payload: bytes,
    *,
    encrypted: bool,
    timeout: float = DIAL_TIMEOUT_S,
) -> bool:
    """Open a fresh connection to `node` at `address` (CURVE, its key
    pinned), send `payload` once the handshake completes, and close.
    True when the handshake completed within `timeout`: only the holder
    of `node`'s key can complete it, so that is proof it answers there."""
    server_key = curve_public_key(node)
    if server_key is None:
        return False
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    monitor = None
    try:
        sock.setsockopt(zmq.LINGER, FLUSH_LINGER_MS)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, int(timeout * 1000))
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(timeout * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL, int(timeout * 1000))
        sock.setsockopt(zmq.METADATA, f"{NODE_ID_PROPERTY}:{keys.node_id.hex()}".encode())
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[v6]:port addresses as well as v4
        if encrypted:
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.curve_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.curve_secret)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(address)
        if not await _handshake(monitor, timeout):
            return False
        sock.send(payload, zmq.NOBLOCK)
        return True
    except zmq.ZMQError:
        return False  # a malformed address, or a socket that could not be made
    finally:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close()


async def _handshake(monitor: zmq.Socket[bytes], timeout: float) -> bool:
    with trio.move_on_after(timeout):
        while True:
            try:
                monitor.recv_multipart(zmq.NOBLOCK)
                return True  # the only event it reports
            except zmq.Again:
                await trio.sleep(POLL_S)
    return False


class ReachabilityDriver:
    """This node's reachability, asked and answered; `run` in its nursery."""

    def __init__(
        self,
        *,
        membership: MembershipDriver,
        keys: PlaneKeys,
        encrypted: bool,
        seeds: Sequence[tuple[bytes, str]],
        record_of: Callable[[bytes], NodeRecord | None],
        on_change: Callable[[], None],
    ) -> None:
        """`seeds` are the join seeds (id, control address): a node behind
        NAT hears from no member, but can ask its seeds; `record_of` is a
        member's decoded record; `on_change` republishes our record."""
        self._membership = membership
        self._keys = keys
        self._encrypted = encrypted
        self._seeds = dict(seeds)
        self._record_of = record_of
        self._on_change = on_change
        self.core = Reachability(random.Random(int.from_bytes(os.urandom(16), "big")))
        self._limit = RequestLimit()
        self._serving = 0
        self._nursery: trio.Nursery | None = None
        self._verdict: Verdict = "unknown"
        self.relay: str | None = None
        """The relay this node is reached through (`runtime.node.relays`
        sets it): while one holds, the verdict stands unchecked, since the
        advertised address is the relay's and a dial-back would prove only
        that the relay works."""
        self.direct_peers: Callable[[], int] = lambda: 0
        """How many members this node holds a direct path past NAT with
        (`runtime.node.direct_paths`, which sets it), for the words."""
        self.counters: Counter[str] = Counter()
        membership.on_dial = self.handle

    # --- what others read ---------------------------------------------------------

    @property
    def verdict(self) -> Verdict:
        return self._verdict

    @property
    def reach(self) -> Reach:
        """What the record says: `direct`, `relayed` (through `relay`), or
        `unknown` (a node behind NAT that holds no relay yet)."""
        if self.relay is not None:
            return "relayed"
        return "direct" if self._verdict == "direct" else "unknown"

    def status(self) -> dict[str, Any]:
        """The status document's `reachability`."""
        address = self.core.address
        return {
            "verdict": self._verdict,
            "address": address,
            "says": reachability_text(self._verdict, address, self.relay, self.direct_peers()),
            "relay": self.relay,
            "answers": self.core.answers(),
            "counters": dict(self.counters),
        }

    # --- messages from the control plane ------------------------------------------

    def handle(self, peer: bytes, message: DialRequest | DialBack) -> None:
        """A dial-back message from `peer` (authenticated by the plane)."""
        if isinstance(message, DialBack):
            counted = self.core.dialed_back(peer, message.nonce, trio.current_time())
            self.counters["dial_backs" if counted else "unasked_dial_backs"] += 1
            self._update()
            return
        if self._nursery is None or not self._limit.allow(peer, trio.current_time()):
            self.counters["requests_refused"] += 1
            return
        if self._serving >= MAX_DIALS:
            self.counters["requests_busy"] += 1
            return
        self._serving += 1
        self._nursery.start_soon(self._serve, peer, message.nonce)

    # --- tasks ---------------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await trio.sleep(FIRST_CHECK_S)
            while True:
                self._step(nursery)
                await trio.sleep(TICK_S)

    def _step(self, nursery: trio.Nursery) -> None:
        if self.relay is not None:
            return  # the advertised address is the relay's (see `relay`)
        self.core.set_address(self._membership.address)
        self.core.tick(trio.current_time(), self._candidates())
        for ask in self.core.take_asks():
            nursery.start_soon(self._ask, ask.prober, ask.nonce)
        self._update()

    def _candidates(self) -> dict[bytes, str]:
        """Who may be asked, and where: alive members, then the seeds."""
        own = self._keys.node_id
        found = {
            view.node: view.addr
            for view in self._membership.members()
            if view.node != own and str(view.state) in LIVE_STATES and view.addr
        }
        for node, addr in self._seeds.items():
            found.setdefault(node, addr)
        found.pop(own, None)
        return found

    async def _ask(self, prober: bytes, nonce: bytes) -> None:
        address = self._candidates().get(prober)
        envelope = Envelope(self._keys.node_id, self._membership.address, DialRequest(nonce))
        taken = address is not None and await self._dial(prober, address, envelope)
        if taken:
            self.core.taken(prober)
            self.counters["requests_sent"] += 1
        else:
            self.core.unreachable_prober(prober)
            self.counters["probers_unreachable"] += 1

    async def _serve(self, requester: bytes, nonce: bytes) -> None:
        try:
            record = await self._record_soon(requester)
            if record is None:
                self.counters["requests_without_record"] += 1
                return
            # The requester's own signed record says where to dial: nothing else.
            answer = Envelope(self._keys.node_id, self._membership.address, DialBack(nonce))
            ok = await self._dial(requester, record.addresses.control, answer)
        finally:
            self._serving -= 1
        self.counters["dialed_back" if ok else "dial_back_failed"] += 1

    async def _record_soon(self, node: bytes) -> NodeRecord | None:
        """`node`'s record, waiting up to `RECORD_WAIT_S` for gossip to bring it."""
        with trio.move_on_after(RECORD_WAIT_S):
            while (record := self._record_of(node)) is None:
                await trio.sleep(TICK_S / 5)
            return record
        return None

    async def _dial(self, node: bytes, address: str, envelope: Envelope) -> bool:
        try:
            payload = encode_envelope(envelope)
        except EncodeError:
            self.counters["encode_error"] += 1
            return False
        return await dial_once(self._keys, node, address, payload, encrypted=self._encrypted)

    def _update(self) -> None:
        verdict = self.core.verdict()
        if verdict == self._verdict:
            return
        before, self._verdict = self._verdict, verdict
        text = reachability_text(verdict, self.core.address)
        (log.warning if verdict == "unreachable" else log.info)("reachability: %s", text)
        if self.reach != ("direct" if before == "direct" else "unknown"):
            self._on_change()
