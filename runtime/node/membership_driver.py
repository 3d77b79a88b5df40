"""The trio driver around the sans-IO membership core, and the control plane's one reader.

The membership core (`mesh.membership.Membership`) decides everything and
does no I/O; this driver's receive loop decodes each control-plane message
strictly (a bad one is counted and dropped), hands membership messages to the
core and signed Raft payloads to Raft, and its timer loop ticks the core at
its deadlines. Raft rides the same plane (`send_consensus`). All protocol
time is `trio.current_time()`.

The two loops in full: docs/design/node.md#the-membership-driver.
"""

from __future__ import annotations

import collections
import logging
import os
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import trio

from mesh import records
from mesh.config import MembershipConfig
from mesh.identity import Identity, curve_public_key, node_id_text, verify
from mesh.member_table import MemberStateName, state_name
from mesh.membership import Membership, MemberView
from mesh.messages import Consensus, DialBack, DialRequest, Envelope, consensus_signing_bytes
from mesh.newcomers import NewcomerLimit
from mesh.transport import Plane
from mesh.wire import DecodeError, EncodeError, decode_envelope, encode_envelope
from mesh.zap import HandshakeGate
from runtime.node.state_dir import StateDir

log = logging.getLogger("shardmesh.node")

RECENT_EVENTS: Final = 64
"""How many recent membership events the status document shows."""
LEAVE_GRACE_MAX_S: Final = 2.0
"""A leaving node gossips its leave for at most this long before it exits,
so SIGTERM always ends the process promptly..."""
LEAVE_GRACE_MIN_S: Final = 0.3
"""...and at least this long, so a fast gossip profile still sends it."""

ConsensusHandler = Callable[[bytes, bytes], None]
"""Raft's inbox: `(sender, payload)` of a consensus message whose signature holds."""
DialHandler = Callable[[bytes, DialRequest | DialBack], None]
"""The reachability driver's inbox: `(peer, message)` of a dial-back message."""


@dataclass
class _Wake:
    """A re-armable wake-up for the timer loop."""

    event: trio.Event = field(default_factory=trio.Event)

    def set(self) -> None:
        self.event.set()

    async def wait_until(self, deadline: float) -> None:
        with trio.move_on_at(deadline):
            await self.event.wait()
        self.event = trio.Event()


class MembershipDriver:
    """Membership and the control plane for one node; `run` in its nursery."""

    def __init__(
        self,
        *,
        identity: Identity,
        state: StateDir,
        config: MembershipConfig,
        plane: Plane,
        address: str,
        incarnation: int,
        on_consensus: ConsensusHandler,
    ) -> None:
        """`address` is the control address peers use (the advertised one);
        `on_consensus` is Raft's inbox."""
        self.identity = identity
        self.node_id = identity.node_id
        self.config = config
        self.address = address
        self.wire_drops: Counter[str] = Counter()
        self.local_drops: Counter[str] = Counter()
        self.recent_events: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=RECENT_EVENTS
        )
        self._on_consensus = on_consensus
        self.on_dial: DialHandler | None = None
        """Set by `runtime.node.reachability_driver.ReachabilityDriver`."""
        self._state = state
        self._plane = plane
        self._isolated = False
        self._leaving = False
        self._seeds: list[str] = []
        self.twin_found = trio.Event()
        """Set when another live process turns out to hold this node's key
        (`Membership.twin_addr`); the daemon decides whether to stop."""
        self._join_logged = 0
        self._wake = _Wake()
        self.newcomers = HandshakeGate(
            NewcomerLimit(config.newcomers_per_address, config.newcomers_per_prefix)
        )
        """The planes' Sybil bound (`SwarmAccess.attach` puts it on both):
        new keys per source address and prefix, as the profile says. Every
        member the core learns is vouched for here, so members reconnecting
        (after our restart, or an idle disconnect) are never charged."""
        self.core = Membership(
            signer=identity,
            verifier=verify,
            addr=address,
            config=config,
            rng=random.Random(int.from_bytes(os.urandom(16), "big")),
            now=trio.current_time(),
            incarnation=incarnation,
            # Continue above the last record seq of any previous run, or peers
            # would drop our fresh record as a replay of the old one.
            record_seq=state.record_seq(),
            validate_record_body=records.validate_record_body,
        )

    # --- what others read -------------------------------------------------------

    @property
    def isolated(self) -> bool:
        """Fault injection: all control traffic is dropped, both ways."""
        return self._isolated

    @property
    def leaving(self) -> bool:
        return self._leaving

    def isolate(self, cut: bool) -> None:
        """Cut this node off the control plane (tests), or restore it."""
        self._isolated = cut

    def members(self) -> list[MemberView]:
        return self.core.members()

    def member(self, node: bytes) -> MemberView | None:
        return self.core.member(node)

    def member_state(self, node: bytes) -> tuple[MemberStateName, float] | None:
        """(state, since) of `node` (None: not a member this node knows)."""
        view = self.core.member(node)
        return None if view is None else (state_name(view.state), view.state_since)

    def peer_states(self) -> list[tuple[bytes, MemberStateName, float]]:
        """(node, state, since) of every other member: what Raft's voter
        management reads."""
        return [
            (view.node, state_name(view.state), view.state_since)
            for view in self.core.members()
            if view.node != self.node_id
        ]

    def drops(self) -> dict[str, Counter[str]]:
        """Drop counters by source: the decoder (`wire`), the core
        (`membership`) and this driver (`node`)."""
        return {"wire": self.wire_drops, "membership": self.core.drops, "node": self.local_drops}

    # --- what the node asks of it -----------------------------------------------

    def join(self, seeds: Sequence[tuple[bytes, str]]) -> None:
        """Join through `(node id, control address)` seeds."""
        self._seeds = [
            f"{node_id_text(node)}@{addr.removeprefix('tcp://')}" for node, addr in seeds
        ]
        self.core.join(list(seeds), trio.current_time())
        self.flush()

    @property
    def twin_addr(self) -> str | None:
        """Where the other process holding this node's key was seen (see `twin_found`)."""
        return self.core.twin_addr

    def join_status(self) -> dict[str, Any]:
        """What `/v1/network/status` says about joining: the seeds, whether
        one answered, how many attempts, and in words."""
        joined, attempts = self.core.joining
        if not self._seeds:
            state = "founded"
        elif joined:
            state = "joined"
        else:
            state = "no peer reached"
        return {"state": state, "seeds": self._seeds, "attempts": attempts}

    def set_address(self, address: str) -> None:
        """Peers reach us at `address` from now (`Membership.set_address`)."""
        self.address = address
        self.core.set_address(address, trio.current_time())
        self.flush()

    def publish_record(self, body: bytes) -> None:
        """Re-sign and gossip this node's record body."""
        self.core.publish_record(body, trio.current_time())
        self.flush()

    async def leave(self) -> None:
        """Announce a graceful leave and keep the loops running for a short,
        bounded grace so the announcement reaches peers before the sockets
        close (they close with LINGER=0, dropping anything unsent)."""
        self._leaving = True
        self.core.leave(trio.current_time())
        self.flush()
        await trio.sleep(self.leave_grace())

    def leave_grace(self) -> float:
        """A few gossip rounds, bounded."""
        return max(LEAVE_GRACE_MIN_S, min(LEAVE_GRACE_MAX_S, 3 * self.config.gossip_interval))

    def send_consensus(self, to: bytes, payload: bytes) -> None:
        """Sign a Raft payload and send it to `to`'s control address (as
        membership knows it; a node membership has never heard of is
        unreachable for now, and Raft retries)."""
        view = self.core.member(to)
        if view is None:
            self.local_drops["raft_no_address"] += 1
            return
        signature = self.identity.sign(consensus_signing_bytes(self.node_id, payload))
        envelope = Envelope(self.node_id, self.address, Consensus(payload, signature))
        try:
            data = encode_envelope(envelope)
        except EncodeError as exc:
            self.local_drops[f"encode_{exc.reason}"] += 1
            return
        self._send(view.addr, to, data)

    # --- the core's I/O -----------------------------------------------------------

    def flush(self) -> None:
        """Persist, send, record events, wake the timer - after every step.

        Persist first: a raised incarnation (a refutation) or a new record
        seq is written to the state dir before any message carrying it
        leaves, so a crash right after can never make the next run reuse a
        number peers have seen. Then send what the core queued, log its
        events, and wake the timer loop, since the step may have moved the
        next deadline.
        """
        self._log_join_attempts()
        events = self.core.take_events()
        for event in events:
            if event.kind == "record" and event.node == self.node_id:
                self._state.store_record_seq(event.incarnation)
            elif event.kind == "joined":
                member_key = curve_public_key(event.node)
                if member_key is not None:
                    self.newcomers.vouch(member_key)
        self._state.store_incarnation(self.core.incarnation)
        encoded: dict[int, bytes] = {}
        for send in self.core.take_sends():
            key = id(send.envelope)
            payload = encoded.get(key)
            if payload is None:
                try:
                    payload = encoded[key] = encode_envelope(send.envelope)
                except EncodeError as exc:
                    log.error("not sending a %s: %s", type(send.envelope.message).__name__, exc)
                    self.local_drops[f"encode_{exc.reason}"] += 1
                    continue
            self._send(send.addr, send.node, payload)
        for event in events:
            entry: dict[str, Any] = {
                "kind": str(event.kind),
                "node_id": node_id_text(event.node),
                "incarnation": event.incarnation,
                "at": event.at,
            }
            self.recent_events.append(entry)
            if event.kind == "twin":
                log.error(
                    "node %s is also alive at %s: another process uses this node's key "
                    "(a copied state dir?)",
                    entry["node_id"][:12],
                    self.core.twin_addr,
                )
                self.twin_found.set()
            if event.kind != "record":
                log.info(
                    "member %s %s (incarnation %d)",
                    entry["node_id"][:12],
                    entry["kind"],
                    event.incarnation,
                )
        self._wake.set()

    def _log_join_attempts(self) -> None:
        """One warning per join attempt after the first that no seed answered
        (each names the seeds and what to check), then one line when a seed
        does: a node joined to a wrong address otherwise runs alone, silently."""
        joined, attempts = self.core.joining
        if joined and self._join_logged:
            log.info("joined the swarm after %d attempts", attempts)
            self._join_logged = 0
        elif not joined and attempts > 1 and attempts != self._join_logged:
            self._join_logged = attempts
            log.warning(
                "no peer reached: %d join attempts got no answer from %s; check each "
                "seed's address and port, and that its id is the one the node printed at "
                "start (a wrong id fails the encrypted handshake); trying again",
                attempts - 1,
                ", ".join(self._seeds),
            )

    def _send(self, addr: str, node: bytes, payload: bytes) -> None:
        if self._isolated:
            self.local_drops["fault_isolated_out"] += 1
            return
        self._plane.send(addr, [payload], peer=node)

    def handle_payload(self, peer: bytes, payload: bytes) -> None:
        """One control-plane message from node `peer` (authenticated by the
        plane): decode strictly, check the sender, step the core, flush.

        A message that fails to decode is counted under the decoder's reason;
        one whose envelope names another sender than its peer (a member
        speaking as another node) as `sender_not_peer`.
        An exception from the core itself is a bug, but a peer must not be
        able to kill the node with it: it is logged with its traceback and
        counted as `internal_error` (tests assert that counter stays absent).
        """
        if self._isolated:
            self.local_drops["fault_isolated_in"] += 1
            return
        try:
            envelope = decode_envelope(payload)
        except DecodeError as exc:
            self.wire_drops[exc.reason] += 1
            return
        if envelope.sender != peer:
            self.local_drops["sender_not_peer"] += 1
            return
        if isinstance(envelope.message, Consensus):
            self._receive_consensus(envelope.sender, envelope.message)
            return
        if isinstance(envelope.message, DialRequest | DialBack):
            if self.on_dial is None:
                self.local_drops["dial_unhandled"] += 1
            else:
                self.on_dial(peer, envelope.message)
            return
        try:
            self.core.receive(envelope, trio.current_time())
        except Exception:
            log.exception("membership core failed on a message; dropped")
            self.local_drops["internal_error"] += 1
        self.flush()

    def _receive_consensus(self, sender: bytes, message: Consensus) -> None:
        signed = consensus_signing_bytes(sender, message.payload)
        if not verify(sender, signed, message.signature):
            self.local_drops["raft_bad_signature"] += 1
            return
        self._on_consensus(sender, message.payload)

    # --- tasks ------------------------------------------------------------------------

    async def run(self) -> None:
        """The receive and timer loops, until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_loop)
            nursery.start_soon(self._timer_loop)

    async def _receive_loop(self) -> None:
        while True:
            peer, frames = await self._plane.receive()
            if len(frames) != 1:
                self.local_drops["bad_frame_count"] += 1
                continue
            self.handle_payload(peer, frames[0])

    async def _timer_loop(self) -> None:
        while True:
            deadline = self.core.next_deadline()
            now = trio.current_time()
            if now >= deadline:
                self.core.tick(now)
                self.flush()
                # Let other tasks run even if the core keeps a deadline in the past.
                await trio.lowlevel.checkpoint()
                continue
            await self._wake.wait_until(deadline)
