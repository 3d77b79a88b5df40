"""The swarm's own routes: status, coverage, models' files, placement, voters, access.

Every node serves them; `network_routes` lists them, grouped by concern in
small classes whose handlers are methods: `StatusRoutes` (status, coverage),
`FileRoutes` (a model's manifest and files, for a volunteer's copy),
`LedgerRoutes` (the signed ledger copy, voters, refound), `PlacementRoutes`
(demand, assignments), `PolicyRoutes`, `EvidenceRoutes` (spot checks),
`InvitationRoutes` (a private swarm's invitations and joins) and `FaultRoutes`
(`--fault-injection`, for tests) and `PunchRoutes` (a member asking for a
direct path past NAT); each class's docstring names its endpoints.
Reads are public; every POST but a join is checked by the node's one `Gate`
(`runtime.api.auth`: the operator, a voter, a member); what changes the
ledger commits through `Leader` (`runtime.api.leader`), forwarded when this
node follows.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Final, Protocol

import trio
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from consensus.commands import MAX_INT, MAX_TEXT, Eligible, LedgerError, RecordDemand, SetPolicy
from consensus.settings import PlacementSettings, policy_json, settings_error
from mesh.identity import NODE_ID_BYTES, node_id_from_text, node_id_text
from mesh.punch import ANSWER_INTERVAL_S, PunchError, PunchRequest
from mesh.records import RECIPES
from runtime.api.auth import Gate, GateNode, forbidden
from runtime.api.http import BadRequest, error_response, json_object
from runtime.api.leader import Leader, LeaderNode
from runtime.model.manifest import GOLDEN_FILE, MANIFEST_FILE, ManifestError, artifact_files
from runtime.model.store import ModelStore
from runtime.node.access import BUSY_RETRY_S, AccessError, RedemptionBusy, SwarmAccess
from runtime.node.direct_paths import MAX_PUNCH_BYTES, PUNCH_PATH, PunchRefused
from runtime.node.ledger_follower import LEDGER_PATH, LedgerClaim, LedgerFollower, signed_headers
from runtime.node.placement_driver import AlreadyAssigned, NodeQuarantined, Placement
from runtime.node.raft_driver import NotLeader, RefoundRefused
from runtime.node.spot_check import EVIDENCE_PATH, MAX_EVIDENCE_BYTES, Adjudicator, Evidence

log = logging.getLogger("shardmesh.api")

MAX_DEMAND_COUNT: Final = 1_000_000
"""One report's count; larger is a client bug, not demand."""


class Punches(Protocol):
    """Who answers a punch (`runtime.node.direct_paths.NodeDirectPaths`)."""

    async def answer(self, requester: bytes, request: PunchRequest) -> dict[str, Any]:
        """The meeting point; the connection follows. `PunchRefused` if not now."""
        ...


class NetworkNode(GateNode, LeaderNode, Protocol):
    """What the network routes need from a node (`runtime.node.daemon.Node`)."""

    placement: Placement
    store: ModelStore
    ledger_follower: LedgerFollower
    adjudicator: Adjudicator

    @property
    def punches(self) -> Punches:
        """Who answers a member's punch."""
        ...

    @property
    def access(self) -> SwarmAccess:
        """Who may connect: invitations and admissions."""
        ...

    @property
    def fault_injection(self) -> bool: ...
    def status(self) -> dict[str, Any]: ...
    def artifact_path(self, digest: str) -> Path | None: ...


class RouteGroup(Protocol):
    """A class of routes: `routes()` names each path, method and handler."""

    def routes(self) -> list[Route]: ...


def network_routes(node: NetworkNode) -> list[Route]:
    """The routes, served from `node`; one `Gate` (one replay guard) for all."""
    gate, leader = Gate(node), Leader(node)
    groups: list[RouteGroup] = [
        FileRoutes(node),
        StatusRoutes(node),
        PlacementRoutes(node, gate, leader),
        EvidenceRoutes(node, gate, leader),
        PolicyRoutes(node, gate, leader),
        FaultRoutes(node, gate),
        LedgerRoutes(node, gate, leader),
        InvitationRoutes(node, gate, leader),
        PunchRoutes(node, gate),
    ]
    return [route for group in groups for route in group.routes()]


class StatusRoutes:
    """`GET /v1/network/status` (the status document) and
    `GET /v1/network/coverage[?model=M]` (its coverage, for one model or all)."""

    def __init__(self, node: NetworkNode) -> None:
        self.node = node

    def routes(self) -> list[Route]:
        return [
            Route("/v1/network/status", self.status, methods=["GET"]),
            Route("/v1/network/coverage", self.coverage, methods=["GET"]),
        ]

    async def status(self, request: Request) -> JSONResponse:
        return JSONResponse(self.node.status())

    async def coverage(self, request: Request) -> JSONResponse:
        coverage = self.node.status()["coverage"]
        model = request.query_params.get("model")
        if model is None:
            return JSONResponse(coverage)
        if model not in coverage:
            return error_response(
                404,
                f"no node reports an admitted capability for model {model!r}",
                code="model_not_found",
                param="model",
            )
        return JSONResponse({model: coverage[model]})


class FileRoutes:
    """A model's files for a volunteer's copy (`shardmesh serve`), which
    verifies each against the manifest's digests:
    `GET /v1/network/models/{name}/manifest` by the model's name, and
    `GET /v1/network/artifacts/{digest}/{name}` by its manifest digest (the
    manifest, config and tokenizer files, and the golden activations)."""

    def __init__(self, node: NetworkNode) -> None:
        self.node = node

    def routes(self) -> list[Route]:
        return [
            Route("/v1/network/artifacts/{digest}/{name}", self.artifact, methods=["GET"]),
            Route("/v1/network/models/{name}/manifest", self.manifest, methods=["GET"]),
        ]

    async def manifest(self, request: Request) -> Response:
        stored = self.node.store.get(request.path_params["name"])
        if stored is None:
            return error_response(404, "this node's store has no such model", code="not_found")
        return FileResponse(stored.path / MANIFEST_FILE, media_type="application/json")

    async def artifact(self, request: Request) -> Response:
        digest = request.path_params["digest"]
        name = request.path_params["name"]
        directory = self.node.artifact_path(digest)
        if directory is None:
            return error_response(404, f"this node holds no model with digest {digest}")
        if name == "manifest":
            name = MANIFEST_FILE
        elif name != GOLDEN_FILE:
            try:
                allowed = await trio.to_thread.run_sync(artifact_files, directory)
            except ManifestError as exc:
                return error_response(500, str(exc))
            if name not in allowed:
                return error_response(404, f"{name!r} is not a shareable file of this model")
        return FileResponse(directory / name, media_type="application/octet-stream")


class PlacementRoutes:
    """Demand and assignments. `POST /v1/network/demand` records chat demand,
    only from a live member's signed report (the entry that counted it, or a
    node relaying its signature); `POST /v1/network/assign` suggests the best
    gap for a joining node; `POST /v1/nodes/assign` commits a bootstrap
    assignment (a voter's call, or a live member's for itself)."""

    def __init__(self, node: NetworkNode, gate: Gate, leader: Leader) -> None:
        self.node = node
        self.gate = gate
        self.leader = leader

    def routes(self) -> list[Route]:
        return [
            Route("/v1/network/demand", self.demand, methods=["POST"]),
            Route("/v1/network/assign", self.suggest, methods=["POST"]),
            Route("/v1/nodes/assign", self.assign, methods=["POST"]),
        ]

    async def demand(self, request: Request) -> JSONResponse:
        signer = await self.gate.member(request, "; only members report demand")
        command = demand_command(await json_object(request))
        placement = self.node.placement
        if self.node.raft.is_leader and (refused := placement.demand_refusal(command.model)):
            return error_response(404, refused, code="model_not_found", param="model")
        return await self.leader.commit(request, command, signer)

    async def suggest(self, request: Request) -> JSONResponse:
        """Bootstrap: the best gap for a joining node, by its memory and store."""
        await self.gate.voter(request)
        body = await json_object(request)
        memory = body.get("memory_bytes")
        if type(memory) is not int or memory < 0:
            raise BadRequest("memory_bytes must be a non-negative integer", "memory_bytes")
        models = body.get("models")
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise BadRequest("models must be an array of model names", "models")
        gap = self.node.placement.suggest(memory, models)
        if gap is None:
            return error_response(
                404, "no gap of these models fits this node; stay spare", code="no_gap"
            )
        return JSONResponse(
            {
                "model": gap.model,
                "layers": list(gap.layers),
                "recipe": gap.recipe,
                "demand_per_min": gap.demand_per_min,
            }
        )

    async def assign(self, request: Request) -> JSONResponse:
        """An operator (or `--auto-join`) assigns a node on its first join."""
        signer = await self.gate.caller(request)
        fields = bootstrap_fields(await json_object(request))
        self.gate.voter_only(signer, assignee=fields[0])
        try:
            command = self.node.placement.bootstrap_command(*fields)
        except AlreadyAssigned as exc:
            return error_response(409, str(exc), code="already_assigned", param="node_id")
        except NodeQuarantined as exc:
            return error_response(409, str(exc), code="quarantined", param="node_id")
        except LedgerError as exc:  # the ledger's own checks of what the body asked for
            raise BadRequest(str(exc)) from None
        return await self.leader.commit(request, command, signer)


class PolicyRoutes:
    """`GET /v1/network/policy` shows the swarm's placement settings;
    `POST` (knob -> value, a voter's call) commits new ones for the whole
    swarm."""

    def __init__(self, node: NetworkNode, gate: Gate, leader: Leader) -> None:
        self.node = node
        self.gate = gate
        self.leader = leader

    def routes(self) -> list[Route]:
        return [Route("/v1/network/policy", self.policy, methods=["GET", "POST"])]

    async def policy(self, request: Request) -> JSONResponse:
        """One route for both methods, so a wrong one's 405 names both."""
        return await self.change(request) if request.method == "POST" else self.show()

    def show(self) -> JSONResponse:
        ledger = self.node.raft.ledger
        return JSONResponse(
            {"policy": policy_json(ledger.policy()), "settings": ledger.policy_settings()}
        )

    async def change(self, request: Request) -> JSONResponse:
        signer = await self.gate.voter(request)
        command = policy_command(await json_object(request), self.node.raft.ledger.policy())
        return await self.leader.commit(request, command, signer)


class EvidenceRoutes:
    """`POST /v1/network/evidence`: a member's spot check caught a hop
    (`runtime.node.spot_check`). The leader queues the evidence for its own
    recomputation and commits the verdict; a follower passes it on."""

    def __init__(self, node: NetworkNode, gate: Gate, leader: Leader) -> None:
        self.node = node
        self.gate = gate
        self.leader = leader

    def routes(self) -> list[Route]:
        return [Route(EVIDENCE_PATH, self.evidence, methods=["POST"])]

    async def evidence(self, request: Request) -> JSONResponse:
        signer = await self.gate.member(request)
        try:
            evidence = Evidence.from_json(await json_object(request, MAX_EVIDENCE_BYTES))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if evidence.reporter != signer:
            raise forbidden("evidence is accepted only from the entry that reports it")
        raft = self.node.raft
        if not raft.is_leader:
            return await self.leader.forward(request, NotLeader(raft.leader()), signer)
        if not self.node.adjudicator.submit(evidence):
            return error_response(
                429, "too much evidence is waiting", code="busy", headers={"Retry-After": "5"}
            )
        return JSONResponse({"queued": True, "digest": evidence.digest().hex()}, status_code=202)


class PunchRoutes:
    """`POST /v1/network/punch`: a live member asks this node to meet it on
    a direct path (`runtime.node.direct_paths`); the answer is where, and
    the connection follows at once. 429 while this node answers enough."""

    def __init__(self, node: NetworkNode, gate: Gate) -> None:
        self.node = node
        self.gate = gate

    def routes(self) -> list[Route]:
        return [Route(PUNCH_PATH, self.punch, methods=["POST"])]

    async def punch(self, request: Request) -> JSONResponse:
        signer = await self.gate.member(request)
        try:
            asked = PunchRequest.from_json(await json_object(request, MAX_PUNCH_BYTES))
            return JSONResponse(await self.node.punches.answer(signer, asked))
        except PunchError as exc:
            raise BadRequest(str(exc)) from None
        except PunchRefused as exc:
            retry = {"Retry-After": str(int(ANSWER_INTERVAL_S))}
            return error_response(429, f"no punch now: {exc}", code="busy", headers=retry)


class LedgerRoutes:
    """The ledger and who votes on it. `GET /v1/network/ledger`: this node's
    copy with a claim it signs, for members outside Raft
    (`runtime.node.ledger_follower`); `GET /v1/network/voters` (who votes,
    who may) and `POST` (a voter's call: one more node eligible, committed);
    `POST /v1/network/refound`: make this node the only voter when the voters
    are gone for good (this node's operator only, never forwarded)."""

    def __init__(self, node: NetworkNode, gate: Gate, leader: Leader) -> None:
        self.node = node
        self.gate = gate
        self.leader = leader

    def routes(self) -> list[Route]:
        return [
            Route(LEDGER_PATH, self.ledger, methods=["GET"]),
            Route("/v1/network/voters", self.voters, methods=["GET", "POST"]),
            Route("/v1/network/refound", self.refound, methods=["POST"]),
        ]

    async def ledger(self, request: Request) -> Response:
        raft = self.node.raft
        voters = (
            tuple(sorted(raft.raft.voters))
            if raft.in_configuration()
            else self.node.ledger_follower.voters
        )
        snapshot, digest = raft.ledger_snapshot()
        claim = LedgerClaim(raft.raft.term, raft.ledger.applied_index, digest, voters)
        return Response(
            snapshot,
            media_type="application/cbor",
            headers=signed_headers(self.node.identity, claim),
        )

    async def voters(self, request: Request) -> JSONResponse:
        """One route for both methods, so a wrong one's 405 names both."""
        if request.method != "POST":
            return JSONResponse(self.node.raft.voters_view())
        signer = await self.gate.voter(request)
        body = await json_object(request)
        try:
            eligible = node_id_from_text(str(body.get("node_id")))
        except ValueError as exc:
            raise BadRequest(f"node_id: {exc}", "node_id") from None
        return await self.leader.commit(request, Eligible(eligible, time.time()), signer)

    async def refound(self, request: Request) -> JSONResponse:
        """Make this node the only voter (`RaftDriver.refound`); its own
        operator's call only, since it can lose committed entries."""
        await self.gate.operator(request, "a refound is for this node's operator only")
        await json_object(request)  # JSON only, like every POST; no fields
        raft = self.node.raft
        try:
            index = await raft.refound()
        except RefoundRefused as exc:
            return error_response(409, str(exc), code="cannot_refound")
        return JSONResponse({"index": index, "term": raft.raft.term, **raft.voters_view()})


class InvitationRoutes:
    """A private swarm's door. `POST /v1/network/invitations` (a voter's
    operator) issues an invitation this node signs; `POST /v1/network/join`
    redeems one for a newcomer's key: its body is signed by that key, so it
    needs no credential, and it is checked here, then at the leader (against
    its voters), which commits the admission."""

    def __init__(self, node: NetworkNode, gate: Gate, leader: Leader) -> None:
        self.node = node
        self.gate = gate
        self.leader = leader

    def routes(self) -> list[Route]:
        return [
            Route("/v1/network/invitations", self.invite, methods=["POST"]),
            Route("/v1/network/join", self.join, methods=["POST"]),
        ]

    async def invite(self, request: Request) -> JSONResponse:
        await self.gate.operator(request, "invitations are for this node's operator only")
        body = await json_object(request)
        voter = body.get("voter", False)
        expires_s = body.get("expires_s")  # None: the role's default (SwarmAccess.invite)
        uses = body.get("uses", 1)
        if type(voter) is not bool:
            raise BadRequest("voter must be true or false", "voter")
        if expires_s is not None and type(expires_s) not in (int, float):
            raise BadRequest("expires_s must be a number of seconds", "expires_s")
        if type(uses) is not int:
            raise BadRequest("uses must be a whole number of nodes", "uses")
        node = self.node
        control = node.addresses["control"].removeprefix("tcp://")
        try:
            invitation = node.access.invite(
                voter=voter,
                expires_s=expires_s,
                uses=uses,
                seed=f"{node_id_text(node.raft.node_id)}@{control}",
                api=node.addresses["api"],
            )
        except AccessError as exc:
            return error_response(409, str(exc), code="cannot_invite")
        return JSONResponse(
            {
                "invitation": invitation.token(),
                "swarm": node_id_text(invitation.swarm),
                "voter": invitation.voter,
                "uses": invitation.admits,
                "expires_at": invitation.expires_at,
            }
        )

    async def join(self, request: Request) -> JSONResponse:
        self.gate.served_host(request)  # no credential, but it changes the swarm
        body = await json_object(request)
        token, node_text, at, signature = (
            body.get(k) for k in ("invitation", "node_id", "at", "signature")
        )
        if type(token) is not str or type(at) is not int:
            raise BadRequest("a redemption is {invitation, node_id, at, signature}", "invitation")
        try:
            newcomer = node_id_from_text(str(node_text))
            signed = bytes.fromhex(str(signature))
        except ValueError as exc:
            raise BadRequest(str(exc), "node_id") from None
        source = request.client.host if request.client else ""
        try:
            admit = self.node.access.admission(token, newcomer, at, signed, source=source)
        except RedemptionBusy as exc:
            retry = {"Retry-After": str(BUSY_RETRY_S)}
            return error_response(429, str(exc), code="busy", headers=retry)
        except AccessError as exc:
            return error_response(403, str(exc), code="invitation_refused")
        return await self.leader.commit(request, admit, None)


class FaultRoutes:
    """`POST /v1/debug/faults` (`--fault-injection`, this node's operator
    only): cut this node off the control plane, or restore it (tests)."""

    def __init__(self, node: NetworkNode, gate: Gate) -> None:
        self.node = node
        self.gate = gate

    def routes(self) -> list[Route]:
        return [Route("/v1/debug/faults", self.faults, methods=["POST"])]

    async def faults(self, request: Request) -> JSONResponse:
        await self.gate.operator(request, "fault injection is for this node's operator only")
        if not self.node.fault_injection:
            return error_response(404, "fault injection is off (start with --fault-injection)")
        isolate = (await json_object(request)).get("isolate")
        if type(isolate) is not bool:
            raise BadRequest("isolate must be true or false", "isolate")
        membership = self.node.membership
        membership.isolate(isolate)
        log.warning("fault injection: control plane %s", "cut" if isolate else "restored")
        return JSONResponse({"isolated": membership.isolated})


def bootstrap_fields(body: dict[str, Any]) -> tuple[bytes, str, tuple[int, int], str]:
    """(node, model, layers, recipe) of a `POST /v1/nodes/assign` body."""
    try:
        node_id = bytes.fromhex(body.get("node_id", ""))
    except (TypeError, ValueError):
        node_id = b""
    if len(node_id) != NODE_ID_BYTES:
        raise BadRequest("node_id must be a node's 64-hex-digit id", "node_id")
    model = body.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_TEXT:
        raise BadRequest(f"model must be a non-empty string of <= {MAX_TEXT} chars", "model")
    layers = body.get("layers")
    if (
        not isinstance(layers, list)
        or len(layers) != 2
        or not all(type(x) is int for x in layers)
        or not 0 <= layers[0] < layers[1] <= MAX_INT
    ):
        raise BadRequest(f"layers must be [a, b] with 0 <= a < b <= {MAX_INT}", "layers")
    recipe = body.get("recipe", "fp32")
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise BadRequest(f"recipe must be one of {sorted(RECIPES)}", "recipe")
    return node_id, model, (layers[0], layers[1]), recipe


def demand_command(body: dict[str, Any]) -> RecordDemand:
    """The RecordDemand of a `POST /v1/network/demand` body."""
    model = body.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_TEXT:
        raise BadRequest(f"model must be a non-empty string of <= {MAX_TEXT} chars", "model")
    count = body.get("count", 1)
    if type(count) is not int or not 1 <= count <= MAX_DEMAND_COUNT:
        raise BadRequest(f"count must be an integer in [1, {MAX_DEMAND_COUNT}]", "count")
    return RecordDemand(model=model, count=count, at=time.time())


def policy_command(body: dict[str, Any], current: PlacementSettings) -> SetPolicy:
    """The SetPolicy of a `POST /v1/network/policy` body: each knob checked
    alone (a 400 naming it), then all of them with the settings in force."""
    if not body:
        raise BadRequest('name at least one setting, e.g. {"idle_release_s": 600}')
    for name, value in body.items():
        error = settings_error({name: value}, PlacementSettings())
        if error is not None:
            raise BadRequest(error, name)
    error = settings_error(body, current)
    if error is not None:
        raise BadRequest(f"with the settings in force: {error}")
    return SetPolicy(tuple(sorted(body.items())), time.time())
