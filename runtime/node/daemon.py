"""The node daemon: the composition root that wires one node together.

Nothing here decides anything; each concern has its own driver, and this
module builds them, connects them, and runs them in one nursery:

* `MembershipDriver`: the SWIM core and the control plane's one reader (Raft
  payloads ride the same plane, signed by their sender);
* `RaftDriver`: the Raft core, persisting to `STATE_DIR/raft.sqlite3` before
  anything it sends;
* `Engine` (`runtime.inference.dispatch`): the data plane's one reader,
  serving this node's shard and carrying its own chats through chains;
* a `ShardSlot`: the one shard this node serves, the operator's pin if any;
* `Placement`: demand out, the leader's decisions in, managed shards loaded;
* with `shardmesh serve`, a `Provisioner`: the model folder into the store
  (its manifest a member's or built), capacity offered, one line when served;
* `ChatService` over a `SwarmView`, and the HTTP API (`runtime.api.app`).

SIGTERM or SIGINT makes the node leave gracefully: membership announces the
leave and keeps gossiping for a short bounded grace, then everything is
cancelled and the process exits 0.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import trio

from consensus.commands import Verdict
from consensus.config import ConsensusConfig
from consensus.storage import RaftStorage, StorageError
from mesh import records
from mesh.config import MembershipConfig
from mesh.identity import Identity, node_id_text
from mesh.transport import Plane
from runtime.inference.chat import ArtifactStore, ChatService
from runtime.inference.dispatch import Engine
from runtime.model.store import ModelStore
from runtime.node.access import AccessError, SwarmAccess, redeem_invitation
from runtime.node.admission import ShardSlot
from runtime.node.drain import drain, others_hold
from runtime.node.hostport import HostPort, parse_hostport
from runtime.node.ledger_follower import LedgerFollower
from runtime.node.membership_driver import MembershipDriver
from runtime.node.options import NodeOptions, NodeStartupError, Provision, open_node_planes
from runtime.node.placement_driver import Placement
from runtime.node.provision import Provisioner
from runtime.node.raft_driver import NotLeader, ProposalFailed, RaftDriver
from runtime.node.spot_check import Adjudicator, Evidence, SpotChecker, send_evidence
from runtime.node.state_dir import OPERATOR_TOKEN_FILE, StateDir
from runtime.node.status import StatusSources, status_document
from runtime.node.swarm_view import SwarmView

log = logging.getLogger("shardmesh.node")

RAFT_STORE: Final = "raft.sqlite3"
NOTICE_INTERVAL_S: Final = 0.5
"""The leader republishes its ledger notice at most this often: a commit
reaches members within a gossip spread plus this, and a burst of commits
is one record."""
LOAD_PUBLISH_S: Final = 5.0
"""A node republishes its open-session count (its load, on every member's
swarm page) at most this often when it changed: each republish is gossiped
to every member, and load changes with every request, so publishing each
change would make record traffic grow with the chat rate. Five seconds
keeps a busy node to one record per gossip spread or so, and a page that
refreshes every few seconds no more than one publish behind."""
TWIN_STARTUP_WINDOW_S: Final = {"lan": 30.0, "wan": 120.0, "local": 10.0}
"""Both processes holding one key learn of each other (each sees the other
sign an incarnation it never signed). One that learns it this soon after
it was up (planes bound, API serving), by profile, is the newcomer: it
stops with an error instead of fighting the running node for its id. One
up longer is the established node: it keeps refuting, as SWIM does, and
stays. The window must cover a join and a refutation's round trip on the profile's network,
on a loaded machine too (`local` is for one machine, where a busy CPU is
what delays them); two copies started within one window of each other
both stop."""


class Node:
    """One running node's components; `run()` serves until SIGTERM/SIGINT.

    Build it inside `trio.run` (`serve_node` does). The attributes set in
    `run` are what the HTTP API reads (`runtime.api.app.NodeAPI`).
    """

    def __init__(
        self, options: NodeOptions, state: StateDir, identity: Identity, raft_storage: RaftStorage
    ) -> None:
        self.options = options
        self.state = state
        self.identity = identity
        self.node_id: bytes = identity.node_id
        self.operator_token = state.operator_token()  # admin calls (runtime.api.auth)
        log.info(
            "operator token in %s (admin calls and `shardmesh policy --set` need it)",
            state.path / OPERATOR_TOKEN_FILE,
        )
        self.incarnation = state.next_incarnation()
        self.raft_storage = raft_storage
        self.started_at = time.time()  # wall clock: shown to humans only
        self.started_mono = trio.current_time()
        self.transport_drops: Counter[str] = Counter()
        self.local_drops: Counter[str] = Counter()  # the data plane's dispatch and hops
        self.addresses: dict[str, str] = {}
        self.store = ModelStore.scan(
            options.models, options.serve.model_dir if options.serve else None
        )
        self._http_shutdown = trio.Event()
        self._draining = False
        self._notice: records.LedgerNotice | None = None  # in our record: we lead
        self._published_sessions = 0
        self._load_published_at = -LOAD_PUBLISH_S  # time.monotonic() of the last publish
        self.ready_mono: float | None = None
        """When the node was up (trio's clock); None while it starts."""
        # Wired in run() once the planes are bound; nothing reads them before.
        self.membership: MembershipDriver
        self.raft: RaftDriver
        self.swarm: SwarmView
        self.engine: Engine
        self.slot: ShardSlot
        self.placement: Placement
        self.chat: ChatService
        self.access: SwarmAccess

    @property
    def fault_injection(self) -> bool:
        return self.options.fault_injection

    def _wire(self, control: Plane, data: Plane) -> None:
        options = self.options
        data_addr = options.advertised(data.address)
        self.membership = MembershipDriver(
            identity=self.identity,
            state=self.state,
            config=MembershipConfig.profile(options.profile),
            plane=control,
            address=options.advertised(control.address),
            incarnation=self.incarnation,
            on_consensus=lambda sender, payload: self.raft.deliver(sender, payload),
        )
        self.raft = RaftDriver(
            node_id=self.node_id,
            storage=self.raft_storage,
            config=ConsensusConfig.profile(options.profile),
            bootstrap=not options.joins,
            send=self.membership.send_consensus,
            members=self.membership.peer_states,
            rng=random.Random(int.from_bytes(os.urandom(16), "big")),
        )
        self.swarm = SwarmView(self.membership, lambda: self.raft.ledger)
        self.ledger_follower = LedgerFollower(
            node_id=self.node_id,
            seeds=[seed.node for seed in options.joins],
            in_configuration=self.raft.in_configuration,
            record=self.swarm.record,
            api_of=self.swarm.member_api,
            install=self.raft.follow,
            held=lambda: self.raft.ledger.applied_index,
        )
        self.raft.followed_leader = self.ledger_follower.leader
        self.engine = Engine(
            data, drops=self.local_drops, signer=self.identity, reply_address=data_addr
        )
        self.slot = ShardSlot(
            engine=self.engine, plane=data, drops=self.local_drops, publish=self.republish
        )
        self.placement = Placement(
            raft=self.raft,
            swarm=self.swarm,
            store=self.store,
            slot=self.slot,
            backend=options.backend,
            auto_join=options.auto_join,
            signer=self.identity,
            auto_join_recipe=options.recipe,
        )
        self.access = SwarmAccess(
            self.identity, self.raft, founding=None if options.joins else options.swarm
        )
        self.access.attach(control, data, newcomers=self.membership.newcomers)
        self.spot_checks = SpotChecker(
            swarm=self.swarm,
            pipeline=self.engine.pipeline,
            fraction=lambda: self.raft.ledger.policy().verify_fraction,
            report=self._report_evidence,
        )
        self.adjudicator = Adjudicator(
            swarm=self.swarm, pipeline=self.engine.pipeline, propose=self._commit_verdict
        )
        self.chat = ChatService(
            swarm=self.swarm,
            placement=self.placement,
            leader=self.raft.leader,
            pipeline=self.engine.pipeline,
            artifacts=ArtifactStore(self.state.path / "artifacts", self.store.by_digest),
            checks=self.spot_checks,
        )

    def _provisioner(self, wanted: Provision) -> Provisioner:
        """`shardmesh serve`'s steps (`runtime.node.provision`), on this node."""
        return Provisioner(
            wanted,
            swarm=self.swarm,
            joined=lambda: self.membership.join_status()["state"] == "joined",
            seeds=[seed.node for seed in self.options.joins],
            store=self.store,
            slot=self.slot,
            placement=self.placement,
            assigned=lambda: self.raft.ledger.assignment(self.node_id) is not None,
            republish=self.republish,
            api=lambda: self.addresses["api"],
            backend=self.options.backend,
            max_memory=self.options.max_memory,
        )

    async def _report_evidence(self, evidence: Evidence) -> bool:
        """Hand a spot check's evidence to the leader: queued here when
        this node leads, else posted to the leader's API, signed."""
        if self.raft.is_leader:
            return self.adjudicator.submit(evidence)
        leader = self.raft.leader()
        url = self.swarm.member_api(leader) if leader is not None else None
        return url is not None and await send_evidence(url, evidence, self.identity)

    async def _commit_verdict(self, verdict: Verdict) -> bool:
        try:
            committed = await self.raft.propose(verdict)
        except (NotLeader, ProposalFailed) as exc:
            log.warning("verdict not committed: %s", exc)
            return False
        return committed.accepted

    async def run(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the sockets, join, serve until SIGTERM/SIGINT, leave, return.

        The signal receiver is installed first, so a SIGTERM that arrives
        during start-up is not lost: it is handled as soon as the node is up.
        """
        options = self.options
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            if not options.encrypted:
                log.warning("--insecure-plaintext: the planes are NOT encrypted or authenticated")
            planes = open_node_planes(options, self.transport_drops, self.identity.plane_keys())
            async with planes as (control, data):
                self._wire(control, data)
                async with trio.open_nursery() as nursery:
                    api_url = await self._start_http(nursery)
                    self.addresses = {
                        "control": self.membership.address,
                        "data": options.advertised(data.address),
                        "api": api_url,
                    }
                    self.republish()
                    if options.joins:
                        self.membership.join([(seed.node, seed.at.zmq()) for seed in options.joins])
                    nursery.start_soon(self.membership.run)
                    nursery.start_soon(self.raft.run)
                    nursery.start_soon(self.ledger_follower.run)
                    nursery.start_soon(self._publish_changes)
                    nursery.start_soon(self.access.run)
                    nursery.start_soon(self._stop_if_identity_taken)
                    await nursery.start(self.engine.run)
                    if options.serve is not None:
                        nursery.start_soon(self.slot.start(options.serve).run)
                    nursery.start_soon(self.placement.run)
                    nursery.start_soon(self.chat.prepare)
                    nursery.start_soon(self.spot_checks.run)
                    nursery.start_soon(self.adjudicator.run)
                    if options.provision is not None:  # it offers capacity once stocked
                        nursery.start_soon(self._provisioner(options.provision).run)
                    elif options.serve is None and self.store.names():
                        # Placement can only give a node models from its
                        # store: without one there is no capacity to offer
                        # (and no reason to import a backend at all).
                        nursery.start_soon(
                            self.slot.offer_capacity, options.backend, options.max_memory
                        )
                    ready = {"node_id": node_id_text(self.node_id), "incarnation": self.incarnation}
                    self.state.write_ready({**ready, **self.addresses})
                    log.info(
                        "node %s up: control %s data %s api %s (incarnation %d, profile %s)",
                        node_id_text(self.node_id),
                        *self.addresses.values(),
                        self.incarnation,
                        options.profile,
                    )
                    log.info(
                        "others join this node with --join %s@%s",
                        node_id_text(self.node_id),
                        self.membership.address.removeprefix("tcp://"),
                    )
                    self.ready_mono = trio.current_time()
                    task_status.started(self)
                    async for signum in signals:
                        name = signal.Signals(signum).name
                        log.info("%s: stopping (signal again to stop at once)", name)
                        break
                    with trio.CancelScope() as draining:
                        nursery.start_soon(self._stop_at_once_on, signals, draining)
                        await drain(
                            self.engine.hop_server,
                            withdraw=self._withdraw,
                            replaceable=self._replaceable,
                        )
                    log.info("leaving the swarm")
                    await self.membership.leave()
                    self._http_shutdown.set()
                    nursery.cancel_scope.cancel()
        self.state.clear_ready()

    async def _stop_at_once_on(
        self, signals: AsyncIterator[int], draining: trio.CancelScope
    ) -> None:
        """A second SIGTERM or Ctrl-C during the drain: stop draining now."""
        async for signum in signals:
            log.info("%s again: stopping now", signal.Signals(signum).name)
            draining.cancel()
            return

    def _withdraw(self) -> None:
        """Take this node's capability out of its record: routes stop
        naming it (the drain's first step)."""
        self._draining = True
        self.republish()

    def _replaceable(self) -> bool:
        """Whether the swarm can serve this node's span without it."""
        admission = self.slot.admission
        assignment = admission.assignment() if admission else None
        if assignment is None:
            return False
        coverage = self.swarm.coverage()
        return others_hold(coverage, self.node_id, assignment.model, assignment.layers)

    async def _stop_if_identity_taken(self) -> None:
        """A copied state dir: stop the newcomer (see TWIN_STARTUP_WINDOW_S).
        It raises past the leave on purpose: a leave is a self-signed death
        of *this id*, which would take the running node down too."""
        await self.membership.twin_found.wait()
        window = TWIN_STARTUP_WINDOW_S[self.options.profile]
        if self.ready_mono is not None and trio.current_time() - self.ready_mono > window:
            return
        raise NodeStartupError(
            f"node {node_id_text(self.node_id)} is already alive at "
            f"{self.membership.core.twin_addr}: this state dir's key is in use by another "
            f"process (a copied state dir?); stop that node, or give this one its own "
            f"--state-dir"
        )

    async def _start_http(self, nursery: trio.Nursery) -> str:
        """Start the API server in `nursery`; its URL as peers should use it."""
        try:
            binds = await nursery.start(self._serve_http)
        except (OSError, BaseExceptionGroup) as exc:
            # hypercorn binds inside its own nurseries: the OSError may be grouped.
            bind_error: BaseException = exc
            if isinstance(exc, BaseExceptionGroup):
                oserrors, rest = exc.split(OSError)
                if oserrors is None or rest is not None:
                    raise
                bind_error = _first_leaf(oserrors)
            where = self.options.api_bind.text()
            raise NodeStartupError(f"cannot serve the API on {where}: {bind_error}") from exc
        bound = parse_hostport(binds[0].split("//", 1)[1]) if binds else self.options.api_bind
        if self.options.advertise:
            bound = HostPort(self.options.advertise, bound.port)
        return bound.http()

    async def _serve_http(self, *, task_status: trio.TaskStatus[list[str]]) -> None:
        from hypercorn.config import Config
        from hypercorn.trio import serve

        from runtime.api.app import create_app

        config = Config()
        config.bind = [self.options.api_bind.text()]
        config.accesslog = None
        # Through our logging config (one format, one stream), not a second handler.
        config.errorlog = logging.getLogger("hypercorn.error")
        config.graceful_timeout = 1.0
        config.keep_alive_timeout = 5.0
        # An ASGI app; hypercorn's stubs name a narrower type.
        app: Any = create_app(self, chats_per_client=self.options.max_chats_per_client)
        await serve(app, config, shutdown_trigger=self._http_shutdown.wait, task_status=task_status)

    def republish(self) -> None:
        """Re-sign and gossip our record: where to reach us and, once the
        doctor has run, our backend, assignment and capability."""
        admission = self.slot.admission
        record = records.NodeRecord(
            addresses=records.Addresses(**self.addresses),
            started_at=self.started_at,
            backend=self.slot.backend,
            assignment=admission.assignment() if admission else None,
            capability=admission.capability if admission and not self._draining else None,
            models=self.store.names(),
            # One assignment per node until multi-shard slots exist
            # (ADR-0026): a node pinned by its operator has no spare slot.
            spare=self.options.serve is None,
            ledger=self._notice,
            sessions=self.engine.sessions,
        )
        self._published_sessions = record.sessions
        self._load_published_at = time.monotonic()
        self.membership.publish_record(records.encode_record_body(record))

    async def _publish_changes(self) -> None:
        """Republish our record when what it says drifts from the node: the
        leader's ledger notice whenever it changes (taken out when this node
        stops leading), at most once per `NOTICE_INTERVAL_S`, since members
        outside Raft follow the ledger by it; the open-session count at most
        once per `LOAD_PUBLISH_S`."""
        while True:
            await trio.sleep(NOTICE_INTERVAL_S)
            notice = self.raft.notice()
            load_due = time.monotonic() - self._load_published_at >= LOAD_PUBLISH_S
            load_moved = self.engine.sessions != self._published_sessions
            if notice != self._notice or (load_due and load_moved):
                self._notice = notice
                self.republish()

    # --- what the HTTP API reads ---------------------------------------------------

    def member_api(self, node: bytes) -> str | None:
        return self.swarm.member_api(node)

    def artifact_path(self, digest: str) -> Path | None:
        """The local directory of the model whose manifest digest is `digest`."""
        return self.store.by_digest(digest)

    def status(self) -> dict[str, Any]:
        """The body of `GET /v1/network/status` (see DESIGN.md, Contracts)."""
        drops = self.transport_drops + self.local_drops  # named "control.", "data.", "engine."
        counters = {**self.membership.drops(), "raft": self.raft.drops}
        counters["placement"] = self.placement.drops  # demand refused: "placement.unknown_model"
        for source, counter in counters.items():
            drops += Counter({f"{source}.{reason}": n for reason, n in counter.items()})
        sources = StatusSources(
            profile=self.options.profile,
            addresses=self.addresses,
            started_at=self.started_at,
            started_mono=self.started_mono,
            membership=self.membership,
            swarm=self.swarm,
            raft=self.raft,
            engine=self.engine,
            slot=self.slot,
            placement=self.placement,
            store=self.store,
            chat=self.chat,
            spot_checks=self.spot_checks,
            adjudicator=self.adjudicator,
            drops=dict(sorted(drops.items())),
        )
        document = status_document(sources, trio.current_time())
        document["ledger_follower"] = self.ledger_follower.status()
        return document


async def serve_node(options: NodeOptions) -> None:
    """Run one node until SIGTERM/SIGINT (the body of `shardmesh node`).

    A start-up failure raised inside the node's nursery arrives wrapped in an
    exception group; it is unwrapped so the CLI can print one clear line.
    """
    with StateDir(options.state_dir) as state:
        identity = Identity.load_or_create(options.state_dir)
        if options.invite is not None:
            try:
                seed = await redeem_invitation(identity, options.invite)
            except AccessError as exc:
                raise NodeStartupError(str(exc)) from None
            options = replace(options, joins=(*options.joins, seed), invite=None)
        try:
            raft_storage = RaftStorage.open(options.state_dir / RAFT_STORE)
        except StorageError as exc:
            raise NodeStartupError(str(exc)) from None
        with raft_storage:
            node = Node(options, state, identity, raft_storage)
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
