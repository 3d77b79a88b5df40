"""The node daemon: the trio driver around the sans-IO membership core.

The membership core (`mesh.membership.Membership`) decides everything and
does no I/O; this module feeds it. One nursery holds every task of a node:

* the control receive loop: decode each message (a bad one is counted by
  its reason and dropped, never raised), hand it to the core, send what the
  core wants sent, wake the timer;
* the timer loop: sleep until the core's next deadline (or until a message
  changed it), tick, send;
* the inference engine (`runtime.inference.dispatch`): the one reader of the data
  plane, serving this node's shard to other entries (once admitted) and
  carrying this node's own chat requests through chains of hops;
* admission (`runtime.node.admission`), when the node was given a shard: the
  doctor, then serving, then periodic re-checks that keep the signed
  capability report fresh;
* the Raft driver (`runtime.node.raft_driver`): consensus messages ride the
  same control plane as membership, each signed by its sender, and the
  driver persists to `STATE_DIR/raft.sqlite3` before anything it sends;
* the HTTP API (hypercorn's trio worker serving `runtime.api.app`).

All protocol time is `trio.current_time()`, a monotonic clock; wall-clock
time appears only in human-facing fields (`started_at`). SIGTERM or SIGINT
makes the node leave gracefully: the core announces the leave, the node keeps
its loops running for a short bounded grace so the announcement goes out,
then everything is cancelled and the process exits 0.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import zmq

from consensus.config import ConsensusConfig
from consensus.storage import RaftStorage, StorageError
from mesh import records
from mesh.config import MembershipConfig
from mesh.coverage import CoverageMap, build_coverage, coverage_to_json, excluded_to_json
from mesh.identity import Identity, node_id_text, verify
from mesh.membership import Membership
from mesh.messages import Consensus, Envelope, consensus_signing_bytes
from mesh.transport import Plane, open_planes
from mesh.wire import (
    MAX_CONTROL_MESSAGE_BYTES,
    DecodeError,
    EncodeError,
    decode_envelope,
    encode_envelope,
)
from runtime.inference.chat import ArtifactStore, ChatService
from runtime.inference.dispatch import Engine
from runtime.model.store import ModelStore
from runtime.node.admission import Admission, ServeOptions, probe_backend
from runtime.node.hostport import HostPort, parse_hostport
from runtime.node.placement_driver import Placement
from runtime.node.raft_driver import RaftDriver
from runtime.node.state_dir import StateDir

log = logging.getLogger("shardmesh.node")

PROFILES = ("lan", "wan", "local")

# How long a leaving node keeps gossiping its leave before it exits, at most.
LEAVE_GRACE_MAX_S = 2.0
LEAVE_GRACE_MIN_S = 0.3

# libzmq refuses a frame over the transport's limit by dropping the whole
# connection, before anything is read: nothing can count it. Setting that
# limit a little above the wire's decode cap means a frame just over the cap
# is read and refused by `mesh.wire` as `oversized` (counted, visible in the
# status API), while a grossly oversized one is still cut off by libzmq
# without ever being buffered. Memory per message stays bounded either way.
CONTROL_FRAME_HEADROOM = 64 * 1024
CONTROL_FRAME_LIMIT = MAX_CONTROL_MESSAGE_BYTES + CONTROL_FRAME_HEADROOM

# How many recent membership events the status API shows.
RECENT_EVENTS = 64

RAFT_STORE = "raft.sqlite3"


class NodeStartupError(Exception):
    """The node could not start (an address in use, a bad bind address)."""


@dataclass(frozen=True)
class NodeOptions:
    """Everything `shardmesh node` was asked to do."""

    listen: HostPort
    api: HostPort
    state_dir: Path
    joins: tuple[HostPort, ...] = ()
    profile: str = "lan"
    data_listen: HostPort | None = None
    advertise: str | None = None
    fault_injection: bool = False
    """Serve `POST /v1/debug/faults` (tests cut a node off the control
    plane with it). Off by default: it lets anyone who reaches the API
    partition the node."""
    serve: ServeOptions | None = None
    """The operator's pinned shard (`--model --layers --recipe`), if any."""
    models: Path | None = None
    """The local model store (`--models STORE`): what the placement leader
    may ask this node to load."""
    backend: str | None = None
    """`--backend` (default: the platform's) for managed shards and the
    capacity a model-less node offers."""
    auto_join: bool = False
    """`--auto-join`: take the placement's best gap as a bootstrap assignment."""

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; use one of {', '.join(PROFILES)}")
        if self.listen.is_wildcard and not self.advertise:
            raise ValueError(
                f"--listen {self.listen.text()} listens on every interface; peers need one "
                "address to reach this node: give --advertise HOST"
            )


def membership_config(profile: str) -> MembershipConfig:
    """The `MembershipConfig` for a profile name."""
    return MembershipConfig.profile(profile)


def _advertised(address: str, advertise: str | None) -> str:
    """The address peers should use: the bound one, with the host replaced
    when the node listens on a wildcard."""
    if not advertise:
        return address
    bound = parse_hostport(address)
    return HostPort(advertise, bound.port).zmq()


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


class Node:
    """One running node: identity, membership core, sockets and counters.

    Build it inside `trio.run` (`serve_node` does); `run()` then serves
    until SIGTERM/SIGINT arrives (or the caller cancels it).
    """

    def __init__(
        self,
        options: NodeOptions,
        state: StateDir,
        identity: Identity,
        incarnation: int,
        raft_storage: RaftStorage,
    ) -> None:
        self.options = options
        self.state = state
        self.identity = identity
        self.node_id: bytes = identity.node_id
        self.config = membership_config(options.profile)
        self.consensus_config = ConsensusConfig.profile(options.profile)
        self.raft_storage = raft_storage
        self.start_incarnation = incarnation
        self.started_at = time.time()  # wall clock: shown to humans only
        self.started_mono = trio.current_time()
        self.transport_drops: Counter[str] = Counter()
        self.wire_drops: Counter[str] = Counter()
        self.local_drops: Counter[str] = Counter()
        self.recent_events: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=RECENT_EVENTS
        )
        self.addresses: dict[str, str] = {}
        # Set in run() once the planes are bound; nothing reads them before.
        self.membership: Membership
        self.raft: RaftDriver
        self.engine: Engine
        self.admission: Admission | None = None
        self.chat: ChatService
        self.placement: Placement
        self.offered_backend: records.BackendInfo | None = None  # model-less nodes
        self.store = ModelStore.scan(
            options.models, options.serve.model_dir if options.serve else None
        )
        self._control: Plane
        self._data: Plane
        self.leaving = False
        self.isolated = False  # fault injection: drop all control traffic
        self._wake = _Wake()
        self._http_shutdown = trio.Event()
        self._record_cache: dict[bytes, tuple[int, Any]] = {}

    # --- the core's I/O -------------------------------------------------------

    def _now(self) -> float:
        return trio.current_time()

    def _flush(self) -> None:
        """Persist, send, record events, wake the timer - after every step.

        Persist first: a raised incarnation (a refutation) or a new record
        seq is written to the state dir before any message carrying it
        leaves, so a crash right after can never make the next run reuse a
        number peers have seen. Then send what the core queued, log its
        events, and wake the timer loop, since the step may have moved the
        next deadline.
        """
        events = self.membership.take_events()
        for event in events:
            if event.kind == "record" and event.node == self.node_id:
                self.state.store_record_seq(event.incarnation)
        self.state.store_incarnation(self.membership.incarnation)
        encoded: dict[int, bytes] = {}
        for send in self.membership.take_sends():
            key = id(send.envelope)
            payload = encoded.get(key)
            if payload is None:
                try:
                    payload = encoded[key] = encode_envelope(send.envelope)
                except EncodeError as exc:
                    log.error("not sending a %s: %s", type(send.envelope.message).__name__, exc)
                    self.local_drops[f"encode_{exc.reason}"] += 1
                    continue
            self._send_control(send.addr, payload)
        for event in events:
            entry = {
                "kind": str(event.kind),
                "node_id": node_id_text(event.node),
                "incarnation": event.incarnation,
                "at": event.at,
            }
            self.recent_events.append(entry)
            if event.kind != "record":
                log.info(
                    "member %s %s (incarnation %d)",
                    entry["node_id"][:12],
                    entry["kind"],
                    event.incarnation,
                )
        self._wake.set()

    def _send_control(self, addr: str, payload: bytes) -> None:
        if self.isolated:
            self.local_drops["fault_isolated_out"] += 1
            return
        self._control.send(addr, [payload])

    def _send_consensus(self, to: bytes, payload: bytes) -> None:
        """Sign a Raft payload and send it to `to`'s control address (as
        membership knows it; a node membership has never heard of is
        unreachable for now, and Raft retries)."""
        view = self.membership.member(to)
        if view is None:
            self.local_drops["raft_no_address"] += 1
            return
        signature = self.identity.sign(consensus_signing_bytes(self.node_id, payload))
        envelope = Envelope(self.node_id, self.addresses["control"], Consensus(payload, signature))
        try:
            data = encode_envelope(envelope)
        except EncodeError as exc:
            self.local_drops[f"encode_{exc.reason}"] += 1
            return
        self._send_control(view.addr, data)

    def _receive_consensus(self, envelope: Envelope) -> None:
        message = envelope.message
        assert isinstance(message, Consensus)
        signed = consensus_signing_bytes(envelope.sender, message.payload)
        if not verify(envelope.sender, signed, message.signature):
            self.local_drops["raft_bad_signature"] += 1
            return
        self.raft.deliver(envelope.sender, message.payload)

    def _raft_members(self) -> list[tuple[bytes, Any, float]]:
        return [
            (view.node, str(view.state), view.state_since)
            for view in self.membership.members()
            if view.node != self.node_id
        ]

    def handle_payload(self, payload: bytes) -> None:
        """One control-plane message: decode strictly, step the core, flush.

        A message that fails to decode is counted under the decoder's reason.
        An exception from the core itself is a bug, but a peer must not be
        able to kill the node with it: it is logged with its traceback and
        counted as `internal_error` (tests assert that counter stays absent).
        """
        if self.isolated:
            self.local_drops["fault_isolated_in"] += 1
            return
        try:
            envelope = decode_envelope(payload)
        except DecodeError as exc:
            self.wire_drops[exc.reason] += 1
            return
        if isinstance(envelope.message, Consensus):
            self._receive_consensus(envelope)
            return
        try:
            self.membership.receive(envelope, self._now())
        except Exception:
            log.exception("membership core failed on a message; dropped")
            self.local_drops["internal_error"] += 1
        self._flush()

    # --- tasks ----------------------------------------------------------------

    async def _control_loop(self) -> None:
        while True:
            frames = await self._control.receive()
            if len(frames) != 1:
                self.local_drops["bad_frame_count"] += 1
                continue
            self.handle_payload(frames[0])

    async def _timer_loop(self) -> None:
        while True:
            deadline = self.membership.next_deadline()
            if self._now() >= deadline:
                self.membership.tick(self._now())
                self._flush()
                # Let other tasks run even if the core keeps a deadline in the past.
                await trio.lowlevel.checkpoint()
                continue
            await self._wake.wait_until(deadline)

    async def _serve_http(self, *, task_status: trio.TaskStatus[list[str]]) -> None:
        from hypercorn.config import Config
        from hypercorn.trio import serve

        from runtime.api.app import create_app

        config = Config()
        config.bind = [self.options.api.text()]
        config.accesslog = None
        # Through our logging config (one format, one stream), not a second handler.
        config.errorlog = logging.getLogger("hypercorn.error")
        config.graceful_timeout = 1.0
        config.keep_alive_timeout = 5.0
        await serve(
            create_app(self),
            config,
            shutdown_trigger=self._http_shutdown.wait,
            task_status=task_status,
        )

    def leave_grace(self) -> float:
        """How long to keep gossiping a leave: a few gossip rounds, bounded
        so SIGTERM always ends the process promptly."""
        return max(LEAVE_GRACE_MIN_S, min(LEAVE_GRACE_MAX_S, 3 * self.config.gossip_interval))

    # --- life cycle ---------------------------------------------------------

    @asynccontextmanager
    async def _planes(self) -> AsyncIterator[tuple[Plane, Plane]]:
        """The control and data planes; a bind failure becomes a
        NodeStartupError naming the addresses (errors after start-up pass)."""
        listen = self.options.listen.zmq()
        data_listen = (self.options.data_listen or HostPort(self.options.listen.host, 0)).zmq()
        entered = False
        try:
            async with open_planes(
                listen,
                data_listen,
                drops=self.transport_drops,
                control_max_message_bytes=CONTROL_FRAME_LIMIT,
            ) as planes:
                entered = True
                yield planes
        except zmq.ZMQError as exc:
            if entered:
                raise
            raise NodeStartupError(f"cannot listen on {listen} / {data_listen}: {exc}") from exc

    async def _start_http(self, nursery: trio.Nursery) -> str:
        """Start the API server in `nursery`; its URL as peers should use it."""
        try:
            binds = await nursery.start(self._serve_http)
        except (OSError, BaseExceptionGroup) as exc:
            # hypercorn binds inside its own nurseries: the OSError may be grouped.
            bind_error = exc
            if isinstance(exc, BaseExceptionGroup):
                oserrors, rest = exc.split(OSError)
                if oserrors is None or rest is not None:
                    raise
                bind_error = _first_leaf(oserrors)
            api = self.options.api.text()
            raise NodeStartupError(f"cannot serve the API on {api}: {bind_error}") from exc
        bound = parse_hostport(binds[0].split("//", 1)[1]) if binds else self.options.api
        if self.options.advertise:
            bound = HostPort(self.options.advertise, bound.port)
        return bound.http()

    def _new_membership(self, control_addr: str) -> Membership:
        return Membership(
            signer=self.identity,
            verifier=verify,
            addr=control_addr,
            config=self.config,
            rng=random.Random(int.from_bytes(os.urandom(16), "big")),
            now=self._now(),
            incarnation=self.start_incarnation,
            # Continue above the last record seq of any previous run, or peers
            # would drop our fresh record as a replay of the old one.
            record_seq=self.state.record_seq(),
            validate_record_body=records.validate_record_body,
        )

    async def run(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the sockets, join, serve until SIGTERM/SIGINT, leave, return.

        The signal receiver is installed first, so a SIGTERM that arrives
        during start-up is not lost: it is handled as soon as the node is up.
        """
        options = self.options
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with self._planes() as (control, data):
                self._control, self._data = control, data
                control_addr = _advertised(control.address, options.advertise)
                data_addr = _advertised(data.address, options.advertise)
                self.membership = self._new_membership(control_addr)
                self.raft = RaftDriver(
                    node_id=self.node_id,
                    storage=self.raft_storage,
                    config=self.consensus_config,
                    bootstrap=not options.joins,
                    send=self._send_consensus,
                    members=self._raft_members,
                    rng=random.Random(int.from_bytes(os.urandom(16), "big")),
                )
                self.engine = Engine(data, drops=self.local_drops, reply_address=data_addr)
                if options.serve is not None:
                    self.admission = Admission(
                        options.serve,
                        engine=self.engine,
                        plane=data,
                        drops=self.local_drops,
                        publish=self.republish,
                    )
                self.chat = ChatService(
                    self, ArtifactStore(self.state.path / "artifacts", _LocalModels(self))
                )
                self.placement = Placement(self)
                async with trio.open_nursery() as nursery:
                    api_url = await self._start_http(nursery)
                    self.addresses = {"control": control_addr, "data": data_addr, "api": api_url}
                    self.membership.publish_record(self.record_body(), self._now())
                    if options.joins:
                        self.membership.join([seed.zmq() for seed in options.joins], self._now())
                    nursery.start_soon(self._control_loop)
                    nursery.start_soon(self._timer_loop)
                    nursery.start_soon(self.raft.run)
                    await nursery.start(self.engine.run)
                    if self.admission is not None:
                        nursery.start_soon(self.admission.run)
                    nursery.start_soon(self.placement.run)
                    nursery.start_soon(self.chat.prepare)
                    if options.serve is None and self.store.names():
                        # Placement can only give a node models from its
                        # store: without one there is no capacity to offer
                        # (and no reason to import a backend at all).
                        nursery.start_soon(self._offer_capacity)
                    self._flush()
                    self.state.write_ready(
                        {
                            "node_id": node_id_text(self.node_id),
                            "incarnation": self.start_incarnation,
                            **self.addresses,
                        }
                    )
                    log.info(
                        "node %s up: control %s data %s api %s (incarnation %d, profile %s)",
                        node_id_text(self.node_id),
                        control_addr,
                        data_addr,
                        api_url,
                        self.start_incarnation,
                        options.profile,
                    )
                    task_status.started(self)
                    async for signum in signals:
                        log.info("%s: leaving the swarm", signal.Signals(signum).name)
                        break
                    await self.leave()
                    self._http_shutdown.set()
                    nursery.cancel_scope.cancel()
        self.state.clear_ready()

    async def leave(self) -> None:
        """Announce a graceful leave and keep the loops running for a short,
        bounded grace so the announcement reaches peers before the sockets
        close (they close with LINGER=0, dropping anything unsent)."""
        self.leaving = True
        self.membership.leave(self._now())
        self._flush()
        await trio.sleep(self.leave_grace())

    # --- views ----------------------------------------------------------------

    def record_body(self) -> bytes:
        """This node's signed-record body: where to reach it and, once the
        doctor has run, its backend, pinned assignment and capability."""
        admission = self.admission
        return records.encode_record_body(
            records.NodeRecord(
                addresses=records.Addresses(
                    control=self.addresses["control"],
                    data=self.addresses["data"],
                    api=self.addresses["api"],
                ),
                started_at=self.started_at,
                backend=admission.backend_info if admission else self.offered_backend,
                assignment=admission.assignment() if admission else None,
                capability=admission.capability if admission else None,
                models=self.store.names(),
                # One assignment per node until multi-shard slots exist
                # (ADR-0026): a node pinned by its operator has no spare slot.
                spare=self.options.serve is None,
            )
        )

    async def _offer_capacity(self) -> None:
        """Find out (in a thread: it imports the backend) what this
        model-less node can offer placement, then advertise it."""
        self.offered_backend = await trio.to_thread.run_sync(probe_backend, self.options.backend)
        if self.offered_backend is None:
            log.warning("backend %s is not installed: offering no capacity", self.options.backend)
        self.republish()

    def republish(self) -> None:
        """Re-sign and gossip our record (admission changed what it says)."""
        self.membership.publish_record(self.record_body(), self._now())
        self._flush()

    @property
    def data_plane(self) -> Plane:
        return self._data

    # --- what the chat service and the API read ------------------------------------

    def decoded_record(self, node: bytes) -> records.NodeRecord | None:
        return self._decoded_record(self.membership.record(node))

    def member_state(self, node: bytes) -> str | None:
        view = self.membership.member(node)
        return None if view is None else str(view.state)

    def coverage_map(self) -> CoverageMap:
        """Who serves what, now (capability validity is judged by wall clock:
        reports are compared across machines)."""
        views = self.membership.members()
        return build_coverage(
            ((v.node, str(v.state), self._decoded_record(v.record)) for v in views), time.time()
        )

    def assigned_models(self) -> set[str]:
        """Models some live member is assigned, admitted yet or not."""
        names = set()
        for view in self.membership.members():
            record = self._decoded_record(view.record)
            if str(view.state) in ("alive", "suspect") and record and record.assignment:
                names.add(record.assignment.model)
        return names

    def loading_nodes(self, model: str) -> list[str]:
        """Live members assigned `model` (by their record or by the ledger)
        whose capability for it is not admitted yet: loading, or in the doctor."""
        ledger = self.raft.ledger
        loading = []
        for view in self.membership.members():
            if str(view.state) not in ("alive", "suspect"):
                continue
            record = self._decoded_record(view.record)
            held = ledger.assignment(view.node)
            assigned = (held is not None and held.model == model) or (
                record is not None
                and record.assignment is not None
                and record.assignment.model == model
            )
            capability = record.capability if record is not None else None
            admitted = (
                capability is not None
                and capability.result == "admitted"
                and capability.model == model
            )
            if assigned and not admitted:
                loading.append(node_id_text(view.node))
        return loading

    def artifact_path(self, digest: str) -> Path | None:
        """The local directory of the model whose manifest digest is `digest`."""
        return self.store.by_digest(digest)

    def stored_models(self) -> set[str]:
        """Models some live member has in its store (placement could load them)."""
        names: set[str] = set()
        for view in self.membership.members():
            record = self._decoded_record(view.record)
            if str(view.state) in ("alive", "suspect") and record is not None:
                names.update(record.models)
        return names

    @property
    def fault_injection(self) -> bool:
        return self.options.fault_injection

    def member_api(self, node: bytes) -> str | None:
        """The HTTP API address `node` advertises in its record, if known."""
        record = self._decoded_record(self.membership.record(node))
        return None if record is None else record.addresses.api

    def drops(self) -> dict[str, int]:
        """Every drop counter of the node: transport, wire, core and driver."""
        total: Counter[str] = Counter()
        total.update(self.transport_drops)
        total.update(self.wire_drops)
        total.update(self.membership.drops)
        total.update(self.raft.drops)
        total.update(self.local_drops)
        return {reason: count for reason, count in sorted(total.items()) if count}

    def _decoded_record(self, record: Any) -> Any:
        """A member's record body decoded (cached per node and seq: the core
        validated it on arrival, so this only turns bytes into fields)."""
        if record is None:
            return None
        cached = self._record_cache.get(record.node)
        if cached is not None and cached[0] == record.seq:
            return cached[1]
        try:
            decoded = records.decode_record_body(record.body)
        except records.RecordError:
            decoded = None
        self._record_cache[record.node] = (record.seq, decoded)
        return decoded

    def status(self) -> dict[str, Any]:
        """The body of `GET /v1/network/status` (see DESIGN.md, Contracts)."""
        now = self._now()
        views = self.membership.members()
        decoded = {view.node: self._decoded_record(view.record) for view in views}
        # Forget cached records of members the core has forgotten.
        for node in self._record_cache.keys() - decoded.keys():
            del self._record_cache[node]
        members = []
        for view in views:
            record = decoded[view.node]
            record_json = None
            if view.record is not None:
                record_json = {"seq": view.record.seq}
                if record is None:
                    record_json["error"] = "undecodable"
                else:
                    record_json.update(records.record_to_json(record))
            members.append(
                {
                    "node_id": node_id_text(view.node),
                    "self": view.node == self.node_id,
                    "state": str(view.state),
                    "incarnation": view.incarnation,
                    "addr": view.addr,
                    "last_seen": None if view.node == self.node_id else _ago(now, view.last_seen),
                    "state_for": _ago(now, view.state_since),
                    "record": record_json,
                }
            )
        members.sort(key=lambda m: (not m["self"], m["node_id"]))
        coverage = self.coverage_map()
        return {
            "node_id": node_id_text(self.node_id),
            "incarnation": self.membership.incarnation,
            "profile": self.options.profile,
            "addresses": dict(self.addresses),
            "started_at": self.started_at,
            "uptime_s": round(now - self.started_mono, 3),
            "leaving": self.leaving,
            "health": self.membership.health,
            "members": members,
            **self.raft.status(),
            "coverage": coverage_to_json(coverage),
            "not_serving": excluded_to_json(coverage),
            "drops": self.drops(),
            "sessions": self.engine.sessions,
            "hop": self.engine.hop_stats,
            "chat": dict(self.chat.counters),
            "admission": None if self.admission is None else self.admission.to_json(),
            "placement": self.placement.to_json(),
            "store": list(self.store.names()),
            "events": [
                {
                    "kind": e["kind"],
                    "node_id": e["node_id"],
                    "incarnation": e["incarnation"],
                    "ago_s": _ago(now, e["at"]),
                }
                for e in self.recent_events
            ],
        }


class _LocalModels(dict[str, Path]):
    """The node's store as the chat service's digest -> directory lookup."""

    def __init__(self, node: Node) -> None:
        super().__init__()
        self._node = node

    def get(self, digest: str, default: Path | None = None) -> Path | None:  # type: ignore[override]
        return self._node.store.by_digest(digest) or default


def _ago(now: float, then: float | None) -> float | None:
    """Seconds from monotonic `then` to `now`, for humans (None stays None)."""
    return None if then is None else round(max(0.0, now - then), 3)


async def serve_node(options: NodeOptions) -> None:
    """Run one node until SIGTERM/SIGINT (the body of `shardmesh node`).

    A start-up failure raised inside the node's nursery arrives wrapped in an
    exception group; it is unwrapped so the CLI can print one clear line.
    """
    with StateDir(options.state_dir) as state:
        identity = Identity.load_or_create(options.state_dir)
        incarnation = state.next_incarnation()
        try:
            raft_storage = RaftStorage.open(options.state_dir / RAFT_STORE)
        except StorageError as exc:
            raise NodeStartupError(str(exc)) from None
        with raft_storage:
            node = Node(options, state, identity, incarnation, raft_storage)
            try:
                await node.run()
            except BaseExceptionGroup as group:
                startup, rest = group.split(NodeStartupError)
                if startup is None or rest is not None:
                    raise
                raise _first_leaf(startup) from None


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
