"""The node daemon: the composition root that wires one node together.

Nothing here decides anything: each concern has its own driver (the
control side, the engine, the shard slot, placement, access, spot checks,
the chat service, the record publisher), and this module builds them,
connects them, serves the HTTP API (`runtime.api.app`, imported here alone)
and runs them in one nursery until SIGTERM or SIGINT, which drains the node
and leaves the swarm (`runtime.node.drain`); the process then exits 0.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import trio

from consensus.storage import RaftStorage, StorageError
from mesh.identity import Identity, node_id_text
from mesh.transport import Plane
from runtime.api.app import create_app
from runtime.inference.chat import ArtifactStore, ChatService
from runtime.inference.dispatch import Engine
from runtime.model.store import ModelStore
from runtime.node.access import AccessError, SwarmAccess, redeem_invitation
from runtime.node.admission import ShardSlot
from runtime.node.control import Control, wire_control
from runtime.node.direct_paths import NodeDirectPaths
from runtime.node.drain import span_replaceable, stop_on_signal
from runtime.node.http_server import start_http
from runtime.node.ledger_follower import LedgerFollower
from runtime.node.membership_driver import MembershipDriver
from runtime.node.options import NodeOptions, NodeStartupError, first_leaf, open_node_planes
from runtime.node.placement_driver import Placement
from runtime.node.provision import Provisioner
from runtime.node.raft_driver import RaftDriver
from runtime.node.reachability_driver import ReachabilityDriver
from runtime.node.record_publisher import RecordPublisher
from runtime.node.relays import NodeRelays
from runtime.node.state_dir import StateDir
from runtime.node.status import status_document
from runtime.node.swarm_view import SwarmView
from runtime.node.twin import stop_if_identity_taken
from runtime.node.verification import Verification

log = logging.getLogger("shardmesh.node")

RAFT_STORE: Final = "raft.sqlite3"
"""The Raft log and state, in the state dir: persisted before anything is sent."""


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
        self.profile = options.profile
        self.fault_injection = options.fault_injection  # serve POST /v1/debug/faults
        self.operator_token = state.operator_token()  # admin calls (runtime.api.auth); logged
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
        self.ready_mono: float | None = None
        """When the node was up (trio's clock); None while it starts."""
        # Wired in run() once the planes are bound; nothing reads them before.
        self.control: Control
        self.membership: MembershipDriver
        self.raft: RaftDriver
        self.swarm: SwarmView
        self.ledger_follower: LedgerFollower
        self.engine: Engine
        self.slot: ShardSlot
        self.placement: Placement
        self.chat: ChatService
        self.access: SwarmAccess
        self.records: RecordPublisher
        self.reachability: ReachabilityDriver
        self.relays: NodeRelays  # reached through relays behind NAT; offers one if not
        self.punches: NodeDirectPaths  # direct paths past NAT (the relays')

    def _wire(self, control: Plane, data: Plane) -> None:
        options = self.options
        control_side = self.control = wire_control(
            identity=self.identity,
            state=self.state,
            profile=options.profile,
            plane=control,
            address=options.advertised(control.address),
            incarnation=self.incarnation,
            storage=self.raft_storage,
            seeds=options.seed_addresses(),
            encrypted=options.encrypted,
            on_reach_change=self.republish,
        )
        self.membership, self.raft = control_side.membership, control_side.raft
        self.swarm, self.ledger_follower = control_side.swarm, control_side.follower
        self.reachability = control_side.reachability
        reply_address = options.advertised(data.address)
        self.engine = Engine(
            data, drops=self.local_drops, signer=self.identity, reply_address=reply_address
        )
        self.slot = ShardSlot(
            engine=self.engine, plane=data, drops=self.local_drops, publish=self.republish
        )
        self.records = RecordPublisher(
            publish=self.membership.publish_record,
            addresses=lambda: self.addresses,
            started_at=self.started_at,
            slot=self.slot,
            models=self.store.names,
            spare=options.serve is None,
            sessions=lambda: self.engine.sessions,
            notice=self.raft.notice,
            reach=lambda: self.reachability.reach,
            rtts=self.membership.core.rtts,
            relayed=lambda: self.relays.relayed(),
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
        verification = Verification(
            swarm=self.swarm, pipeline=self.engine.pipeline, raft=self.raft, signer=self.identity
        )
        self.spot_checks = verification.checks
        self.adjudicator = verification.adjudicator
        self.chat = ChatService(
            swarm=self.swarm,
            placement=self.placement,
            leader=self.raft.leader,
            pipeline=self.engine.pipeline,
            artifacts=ArtifactStore(self.state.path / "artifacts", self.store.by_digest),
            checks=self.spot_checks,
        )
        self.relays = NodeRelays(self, control, data)
        self.punches = self.relays.direct  # the API's punch route answers through it

    async def run(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the sockets, join, serve until SIGTERM/SIGINT, leave, return.

        The signal receiver is installed first, so a SIGTERM that arrives
        during start-up is not lost: it is handled as soon as the node is up.
        """
        options = self.options
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            planes = open_node_planes(options, self.transport_drops, self.identity.plane_keys())
            async with planes as (control, data):
                self._wire(control, data)
                async with trio.open_nursery() as nursery:
                    app = create_app(self, chats_per_client=options.max_chats_per_client)
                    api_url = await start_http(
                        nursery,
                        app,
                        bind=options.api_bind,
                        advertise=options.advertise,
                        shutdown=self._http_shutdown,
                    )
                    self.addresses = await self.relays.start(nursery, api_url)
                    self.republish()
                    if options.joins:
                        self.membership.join(options.seed_addresses())
                    await self._start_tasks(nursery)
                    self._announce_up()
                    task_status.started(self)
                    await stop_on_signal(
                        signals,
                        nursery,
                        lambda: self.engine.hop_server,
                        withdraw=self.records.withdraw,
                        replaceable=lambda: span_replaceable(
                            self.slot.admission, self.swarm.coverage, self.node_id
                        ),
                        leave=self.membership.leave,
                    )
                    self._http_shutdown.set()
                    nursery.cancel_scope.cancel()
        self.state.clear_ready()

    async def _start_tasks(self, nursery: trio.Nursery) -> None:
        """Every component's loop, the engine's started before the shards'."""
        options = self.options
        self.control.start(nursery)
        nursery.start_soon(self.records.run)
        nursery.start_soon(self.access.run)
        nursery.start_soon(
            stop_if_identity_taken, self.membership, options.profile, lambda: self.ready_mono
        )
        await nursery.start(self.engine.run)
        if options.serve is not None:
            nursery.start_soon(self.slot.start(options.serve).run)
        nursery.start_soon(self.placement.run)
        nursery.start_soon(self.chat.prepare)
        nursery.start_soon(self.spot_checks.run)
        nursery.start_soon(self.adjudicator.run)
        if options.provision is not None:  # `shardmesh serve`: it offers capacity once stocked
            provisioner = Provisioner(
                options.provision,
                swarm=self.swarm,
                joined=lambda: self.membership.join_status()["state"] == "joined",
                seeds=[seed.node for seed in options.joins],
                store=self.store,
                slot=self.slot,
                placement=self.placement,
                assigned=lambda: self.raft.ledger.assignment(self.node_id) is not None,
                republish=self.republish,
                api=lambda: self.addresses["api"],
                backend=options.backend,
                max_memory=options.max_memory,
            )
            nursery.start_soon(provisioner.run)
        elif options.serve is None and self.store.names():
            # Placement gives a node only models from its store: without one
            # there is no capacity to offer (nor reason to import a backend).
            nursery.start_soon(self.slot.offer_capacity, options.backend, options.max_memory)

    def _announce_up(self) -> None:
        """The ready file (what supervisors and tests wait on) and the log lines."""
        node = node_id_text(self.node_id)
        self.state.write_ready({"node_id": node, "incarnation": self.incarnation, **self.addresses})
        where = " ".join(f"{plane} {address}" for plane, address in self.addresses.items())
        profile = self.options.profile
        log.info(
            "node %s up: %s (incarnation %d, profile %s)", node, where, self.incarnation, profile
        )
        at = self.membership.address.removeprefix("tcp://")
        log.info("others join this node with --join %s@%s", node, at)
        self.ready_mono = trio.current_time()

    def republish(self) -> None:
        """Re-sign and gossip our record (`runtime.node.record_publisher`)."""
        self.records.republish()

    # --- what the HTTP API reads ---------------------------------------------------

    def member_api(self, node: bytes) -> str | None:
        return self.swarm.member_api(node)

    def artifact_path(self, digest: str) -> Path | None:
        """The local directory of the model whose manifest digest is `digest`."""
        return self.store.by_digest(digest)

    def status(self) -> dict[str, Any]:
        """The body of `GET /v1/network/status` (`runtime.node.status`)."""
        return status_document(self, trio.current_time())


async def serve_node(options: NodeOptions) -> None:
    """Run one node until SIGTERM/SIGINT (the body of `shardmesh node`). A
    start-up failure raised inside the node's nursery arrives wrapped in an
    exception group: it is unwrapped, so the CLI prints one clear line."""
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
                raise first_leaf(startup) from None
