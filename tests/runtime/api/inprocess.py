"""A node for the API's in-process tests: real parts where they are cheap.

`ApiNode` has a real one-voter Raft driver (sqlite on disk, fast ticks: it
leads within a few tens of milliseconds), its real ledger, placement,
swarm access, ledger follower, adjudicator and model store. Only what needs
other processes is narrow: `Members` stands in for the membership driver
(the members a gate reads, fault injection), and `FollowerRaft` for a Raft
driver that follows a leader elsewhere. `chat_service` is a real chat entry
of such a node (no chain behind it). The app is driven through httpx's ASGI
transport in the test's own trio run, or served by hypercorn on loopback
where one node must reach another over HTTP.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import httpx
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from consensus.commands import Command
from consensus.config import ConsensusConfig
from consensus.ledger import PlacementLedger
from consensus.storage import RaftStorage
from mesh.identity import Identity, node_id_text
from mesh.member_table import MemberState
from mesh.membership import MemberView
from runtime.api.http import BadRequest, bad_request, http_error, server_error
from runtime.api.network import NetworkNode, network_routes
from runtime.inference.chain import Pipeline
from runtime.inference.chat import ArtifactStore, ChatService
from runtime.model.store import ModelStore
from runtime.node.access import SwarmAccess
from runtime.node.admission import ShardSlot
from runtime.node.direct_paths import NodeDirectPaths, Reach
from runtime.node.ledger_follower import LedgerFollower
from runtime.node.membership_driver import MembershipDriver
from runtime.node.placement_driver import Placement
from runtime.node.raft_driver import Committed, NotLeader, ProposalFailed, RaftDriver
from runtime.node.signed_http import sign_request
from runtime.node.spot_check import Adjudicator
from runtime.node.swarm_view import SwarmView
from tests.runtime.node.test_direct_paths import NoSwarm

TOKEN = "operator-token-of-the-node-under-test"
BEARER = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
JSON = {"content-type": "application/json"}
FAST = replace(ConsensusConfig.local(), tick_s=0.003, proposal_timeout_s=5.0)
"""A one-voter cluster elects itself after 10-20 ticks: milliseconds here."""


class Members:
    """The membership driver as the routes read it: who is a member, in
    which state, and the control plane's fault-injection switch."""

    def __init__(self, node_id: bytes) -> None:
        self.node_id = node_id
        self.views: dict[bytes, MemberView] = {}
        self.isolated = False

    def add(self, node: bytes, state: MemberState = MemberState.ALIVE) -> None:
        self.views[node] = MemberView(node, "tcp://127.0.0.1:1", 1, state, 0.0, None, None)

    def member(self, node: bytes) -> MemberView | None:
        return self.views.get(node)

    def members(self) -> list[MemberView]:
        return list(self.views.values())

    def isolate(self, cut: bool) -> None:
        self.isolated = cut


@dataclass
class _Core:
    """The Raft core as a gate reads it: the voters of its configuration."""

    voters: frozenset[bytes]


class FollowerRaft:
    """A Raft driver that follows `leader` (None: knows of none), with an
    empty ledger replica: every proposal is `NotLeader`, or `ProposalFailed`
    when `failing`."""

    def __init__(self, node_id: bytes, leader: bytes | None, *, failing: bool = False) -> None:
        self.node_id = node_id
        self._leader = leader
        self._failing = failing
        self.raft = _Core(frozenset() if leader is None else frozenset({leader}))
        self.is_leader = False
        self.ledger = PlacementLedger()

    def leader(self) -> bytes | None:
        return self._leader

    async def propose(self, command: Command, timeout: float | None = None) -> Committed:
        if self._failing:
            raise ProposalFailed("no commit in time")
        raise NotLeader(self._leader)


def unplaced_punches() -> NodeDirectPaths:
    """Direct paths of a node whose public address is unknown."""
    return NodeDirectPaths(Identity.generate(), NoSwarm(), {}, {}, lambda: Reach("unknown", None))


@dataclass
class ApiNode:
    """What `network_routes` reads of a node (`NetworkNode`), built from real parts."""

    identity: Identity
    raft: RaftDriver
    membership: MembershipDriver
    placement: Placement
    store: ModelStore
    ledger_follower: LedgerFollower
    adjudicator: Adjudicator
    access: SwarmAccess
    members: Members
    punches: NodeDirectPaths = field(default_factory=lambda: unplaced_punches())
    """Real, for a node that does not know its public address yet: it
    refuses every punch (429)."""
    operator_token: str = TOKEN
    fault_injection: bool = False
    addresses: dict[str, str] = field(
        default_factory=lambda: {
            "control": "tcp://127.0.0.1:7001",
            "data": "tcp://127.0.0.1:7002",
            "api": "http://127.0.0.1:7003",
        }
    )
    apis: dict[bytes, str] = field(default_factory=dict)
    """`member_api`: where each other node's API is."""
    coverage: dict[str, Any] = field(default_factory=dict)
    chat: Any = None
    """What `runtime.api.app.create_app` serves chat from, where a test needs it."""
    _signed_at: float = 0.0

    @property
    def node_id(self) -> bytes:
        return self.identity.node_id

    def status(self) -> dict[str, Any]:
        return {"node_id": node_id_text(self.node_id), "coverage": self.coverage}

    def member_api(self, node: bytes) -> str | None:
        return self.apis.get(node)

    def artifact_path(self, digest: str) -> Path | None:
        return self.store.by_digest(digest)

    def signed(self, path: str, body: bytes, key: Identity | None = None) -> dict[str, str]:
        """Headers of a POST of `body` to `path` signed by `key` (this node's
        own by default). Each is signed a millisecond after the last at
        least: the same request signed twice in one millisecond would be the
        same signature, which a gate accepts once."""
        signer = key if key is not None else self.identity
        self._signed_at = max(time.time(), self._signed_at + 0.001)
        return {**JSON, **sign_request(signer, "POST", path, body, self._signed_at)}


def make_node(
    raft: RaftDriver, identity: Identity, store: ModelStore | None = None, **kwargs: Any
) -> ApiNode:
    """An `ApiNode` around `raft` (which signs nothing itself: `identity` does)."""
    members = Members(identity.node_id)
    membership = cast(MembershipDriver, members)
    swarm = SwarmView(membership, lambda: raft.ledger)
    store = store if store is not None else ModelStore({})
    placement = Placement(
        raft=raft,
        swarm=swarm,
        store=store,
        slot=cast(ShardSlot, None),  # read only by the placement loops, never started here
        backend=None,
        auto_join=False,
        signer=identity,
    )
    follower = LedgerFollower(
        node_id=identity.node_id,
        seeds=(),
        in_configuration=raft.in_configuration,
        record=swarm.record,
        api_of=swarm.member_api,
        install=lambda ledger: None,
        held=lambda: raft.ledger.applied_index,
    )

    async def propose(verdict: Any) -> bool:
        return False

    adjudicator = Adjudicator(swarm=swarm, pipeline=cast(Any, None), propose=propose)
    access = SwarmAccess(identity, raft, founding=None)
    return ApiNode(
        identity, raft, membership, placement, store, follower, adjudicator, access, members,
        **kwargs,
    )  # fmt: skip


def chat_service(node: ApiNode, cache_dir: Path) -> ChatService:
    """A real `ChatService` of `node`: its swarm view, placement and store,
    with no pipeline (never reached: no model of this node's swarm is served)."""
    return ChatService(
        swarm=SwarmView(node.membership, lambda: node.raft.ledger),
        placement=node.placement,
        leader=node.raft.leader,
        pipeline=cast(Pipeline, None),
        artifacts=ArtifactStore(cache_dir, node.store.by_digest),
    )


@asynccontextmanager
async def leading_node(
    tmp_path: Path, store: ModelStore | None = None, **kwargs: Any
) -> AsyncIterator[ApiNode]:
    """An `ApiNode` whose one-voter Raft driver runs and leads."""
    identity = Identity.generate()
    with RaftStorage.open(tmp_path / f"raft-{identity.node_id.hex()[:8]}.sqlite3") as storage:
        raft = RaftDriver(
            node_id=identity.node_id,
            storage=storage,
            config=FAST,
            bootstrap=True,
            send=lambda to, payload: None,
            members=lambda: (),
            rng=random.Random(0),
        )
        node = make_node(raft, identity, store, **kwargs)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(raft.run)
            with trio.fail_after(10):
                while not raft.is_leader:
                    await trio.sleep(0.005)
            yield node
            nursery.cancel_scope.cancel()


def app_of(node: NetworkNode) -> Starlette:
    """The network routes of `node` with the app's own exception handlers
    (`runtime.api.app.create_app` adds chat, metrics and the page)."""
    return Starlette(
        routes=network_routes(node),
        exception_handlers={
            BadRequest: bad_request,
            HTTPException: http_error,
            Exception: server_error,
        },
    )


def client_of(node: NetworkNode) -> httpx.AsyncClient:
    """A client of `node`'s routes, in this trio run (no sockets)."""
    transport = httpx.ASGITransport(app=app_of(node), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://localhost")


@asynccontextmanager
async def served(node: NetworkNode) -> AsyncIterator[str]:
    """`node`'s routes served by hypercorn on loopback; their URL."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 0.5
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        app: Any = app_of(node)
        binds = await nursery.start(partial(serve, app, config, shutdown_trigger=shutdown.wait))
        try:
            yield binds[0]
        finally:
            shutdown.set()


def error_of(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The OpenAI-shaped error of `response`, which must have `status` (and `code`)."""
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error


def body_of(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value).encode()
