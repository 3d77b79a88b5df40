"""The swarm's own routes: status, coverage, models' files, placement and its policy.

* `GET /v1/network/status`, `GET /v1/network/coverage[?model=M]`;
* `POST /v1/network/demand` records chat demand in the placement ledger:
  any node accepts it and forwards it to the Raft leader;
* `GET /v1/network/policy` shows the swarm's placement policy settings;
  `POST /v1/network/policy` (knob -> value) commits new settings for the
  whole swarm, forwarded to the leader like demand;
* `POST /v1/network/assign` (the best gap for a joining node) and
  `POST /v1/nodes/assign` (a bootstrap assignment, committed);
* `GET /v1/network/artifacts/{digest}/{file}` and
  `GET /v1/network/models/{name}/manifest`: the manifest, config and
  tokenizer files of a model this node holds, for entries that lack them
  (they verify every file against the digest), and its golden activations,
  for a volunteer's copy of the model (`shardmesh serve`: it checks them
  against the manifest's digest of them);
* with `--fault-injection`, `POST /v1/debug/faults` cuts the node off the
  control plane (tests);
* `GET /v1/network/ledger`: this node's copy of the placement ledger and a
  claim about it that it signs, for members outside Raft;
* `GET /v1/network/voters` (who votes, who may) and `POST /v1/network/voters`
  (an operator makes a node eligible to vote, committed in the ledger;
  forwarded to the leader like policy);
* `POST /v1/network/refound` (this node's operator only, never forwarded):
  make this node the only voter when the voters are gone for good;
* `POST /v1/network/invitations` (a voter's operator: an invitation to a
  private swarm) and `POST /v1/network/join` (a newcomer redeems one; the
  body is signed by the newcomer's key, so it needs no credential, and is
  forwarded to the leader, which commits the admission).

Every POST but demand needs the node's operator token, or a node's
signature (`runtime.api.auth`): a node that forwards an operator's call to
the leader signs it, and the leader accepts it only from a Raft voter (or,
for `/v1/nodes/assign`, from the node being assigned). Demand is accepted
only signed by a current member: the chat entry that counted it, or the
node that forwards that report (which relays the entry's signature).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Protocol

import httpx
import trio
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from consensus.ledger import MAX_TEXT, Admit, Command, Eligible, RecordDemand, SetPolicy
from consensus.settings import PlacementSettings, policy_json, settings_error
from mesh.identity import NODE_ID_BYTES, Signer, node_id_from_text, node_id_text
from mesh.member_table import LIVE_STATES
from mesh.records import RECIPES
from runtime.api.auth import authenticate, forbidden
from runtime.api.http import BadRequest, error_response, json_object
from runtime.model.manifest import GOLDEN_FILE, MANIFEST_FILE, ManifestError, artifact_files
from runtime.model.store import ModelStore
from runtime.node.access import AccessError, SwarmAccess
from runtime.node.ledger_follower import (
    LEDGER_PATH,
    LedgerClaim,
    LedgerFollower,
    signed_headers,
)
from runtime.node.membership_driver import MembershipDriver
from runtime.node.placement_driver import AlreadyAssigned, NodeQuarantined, Placement
from runtime.node.raft_driver import NotLeader, ProposalFailed, RaftDriver, RefoundRefused
from runtime.node.signed_http import SIGNED_HEADERS, ReplayGuard, sign_request
from runtime.node.spot_check import EVIDENCE_PATH, MAX_EVIDENCE_BYTES, Adjudicator, Evidence

log = logging.getLogger("shardmesh.api")

FORWARDED_HEADER: Final = "x-shardmesh-forwarded-by"
"""Set on a request one node forwards to the leader. A forwarded request is
never forwarded again: if leadership moved meanwhile, the caller gets a 503
and retries, instead of the request bouncing between nodes. It only stops
loops: what the leader trusts is the request's signature."""
FORWARD_TIMEOUT_S: Final = 10.0
"""A forwarded proposal waits for its commit on the leader; this covers the
leader's own proposal timeout plus a round trip."""
DEFAULT_INVITATION_S: Final = 24 * 3600
"""An invitation's default life: a day to hand it over and use it."""
MAX_DEMAND_COUNT: Final = 1_000_000
"""One report's count; larger is a client bug, not demand."""


class NetworkNode(Protocol):
    """What the network routes need from a node (`runtime.node.daemon.Node`)."""

    raft: RaftDriver
    membership: MembershipDriver
    placement: Placement
    store: ModelStore
    ledger_follower: LedgerFollower
    adjudicator: Adjudicator

    @property
    def identity(self) -> Signer:
        """Signs what this node forwards to the leader."""
        ...

    @property
    def operator_token(self) -> str:
        """What this node's operator presents (`STATE_DIR/operator.token`)."""
        ...

    @property
    def access(self) -> SwarmAccess:
        """Who may connect: invitations and admissions."""
        ...

    @property
    def addresses(self) -> dict[str, str]:
        """Where peers reach this node: control, data, api."""
        ...

    @property
    def fault_injection(self) -> bool: ...
    def status(self) -> dict[str, Any]: ...
    def member_api(self, node: bytes) -> str | None: ...
    def artifact_path(self, digest: str) -> Path | None: ...


def network_routes(node: NetworkNode) -> list[Route]:
    """The routes, served from `node`."""
    replays = ReplayGuard()  # each node-signed request is accepted once

    async def caller(request: Request, *, operator: bool = True) -> bytes | None:
        return await authenticate(request, node.operator_token, replays, operator=operator)

    def live_member(signer: bytes) -> bool:
        member = node.membership.member(signer)
        return member is not None and member.state in LIVE_STATES

    def voter_only(signer: bytes | None, assignee: bytes | None = None) -> None:
        """403 unless the call is the operator's (None) or signed by a Raft
        voter of this node's current configuration (or by `assignee`, a
        live member asking for its own bootstrap assignment)."""
        if signer is None or signer in node.raft.raft.voters:
            return
        if signer == assignee and live_member(signer):
            return
        raise forbidden(
            f"node {node_id_text(signer)[:12]} signed this call, but only a Raft voter's "
            "forwarded admin calls are accepted"
            + (" (or a member's own bootstrap assignment)" if assignee is not None else "")
        )

    async def network_assign(request: Request) -> JSONResponse:
        """Bootstrap: the best gap for a joining node, by its memory and store."""
        voter_only(await caller(request))
        body = await json_object(request)
        memory = body.get("memory_bytes")
        if type(memory) is not int or memory < 0:
            raise BadRequest("memory_bytes must be a non-negative integer", "memory_bytes")
        models = body.get("models")
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise BadRequest("models must be an array of model names", "models")
        gap = node.placement.suggest(memory, models)
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

    async def nodes_assign(request: Request) -> JSONResponse:
        """An operator (or `--auto-join`) assigns a node on its first join."""
        signer = await caller(request)
        fields = _bootstrap_fields(await json_object(request))
        voter_only(signer, assignee=fields[0])
        try:
            command = node.placement.bootstrap_command(*fields)
        except AlreadyAssigned as exc:
            return error_response(409, str(exc), code="already_assigned", param="node_id")
        except NodeQuarantined as exc:
            return error_response(409, str(exc), code="quarantined", param="node_id")
        return await commit(request, command, signer)

    async def model_manifest(request: Request) -> Response:
        stored = node.store.get(request.path_params["name"])
        if stored is None:
            return error_response(404, "this node's store has no such model", code="not_found")
        return FileResponse(stored.path / MANIFEST_FILE, media_type="application/json")

    async def artifact(request: Request) -> Response:
        digest = request.path_params["digest"]
        name = request.path_params["name"]
        directory = node.artifact_path(digest)
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

    async def commit(request: Request, command: Command, signer: bytes | None) -> JSONResponse:
        """Propose `command` here if we lead, else forward the request to
        the leader once; answer with where it committed. `signer` is who
        signed the request (None: this node's operator)."""
        try:
            committed = await node.raft.propose(command)
        except NotLeader as exc:
            return await forward_to_leader(request, exc, signer)
        except ProposalFailed as exc:
            return error_response(
                503, str(exc), code="proposal_failed", headers={"Retry-After": "1"}
            )
        reply: dict[str, Any] = {
            "index": committed.index,
            "term": committed.term,
            "accepted": committed.accepted,
            "reason": committed.reason or None,
            "detail": committed.detail or None,
            "leader": node_id_text(node.raft.node_id),
        }
        if isinstance(command, SetPolicy):  # applied here: the swarm's policy from now on
            reply["policy"] = policy_json(node.raft.ledger.policy())
            reply["settings"] = node.raft.ledger.policy_settings()
        return JSONResponse(reply)

    async def forward_to_leader(
        request: Request, exc: NotLeader, signer: bytes | None
    ) -> JSONResponse:
        """Pass the request on to the leader. The operator's token is this
        node's alone, so it is not sent: an operator's call goes signed by
        this node; a node's signed call goes with its own signature."""
        leader = exc.leader
        url = node.member_api(leader) if leader is not None else None
        if leader is None or url is None or request.headers.get(FORWARDED_HEADER):
            return error_response(
                503,
                str(exc),
                code="no_leader" if leader is None else "not_leader",
                headers={"Retry-After": "1"},
                leader=node_id_text(leader) if leader else None,
            )
        content = await request.body()
        path = request.url.path
        signature: Mapping[str, str] = (
            sign_request(node.identity, "POST", path, content, time.time())
            if signer is None
            else {name: request.headers[name] for name in SIGNED_HEADERS}
        )
        try:
            async with httpx.AsyncClient(timeout=FORWARD_TIMEOUT_S) as client:
                reply = await client.post(
                    url + path,
                    content=content,
                    headers={
                        "content-type": "application/json",
                        FORWARDED_HEADER: node_id_text(node.raft.node_id),
                        **signature,
                    },
                )
            body = reply.json()
        except (httpx.HTTPError, ValueError) as err:
            return error_response(
                503,
                f"the leader {node_id_text(leader)} did not answer: {err}",
                code="leader_unreachable",
                headers={"Retry-After": "1"},
            )
        return JSONResponse(body, status_code=reply.status_code)

    async def network_demand(request: Request) -> JSONResponse:
        signer = await caller(request, operator=False)
        assert signer is not None  # operator=False: only a signature is accepted
        if not live_member(signer):
            raise forbidden(
                f"node {node_id_text(signer)[:12]} is not a live member of this swarm; "
                "only members report demand"
            )
        command = _demand_command(await json_object(request))
        if node.raft.is_leader and (refused := node.placement.demand_refusal(command.model)):
            return error_response(404, refused, code="model_not_found", param="model")
        return await commit(request, command, signer)

    async def network_evidence(request: Request) -> JSONResponse:
        """A member's spot check caught a hop (`runtime.node.spot_check`):
        the leader queues the evidence for its own recomputation and
        commits the verdict; a follower passes it on to the leader."""
        signer = await caller(request, operator=False)
        assert signer is not None  # operator=False: only a signature is accepted
        if not live_member(signer):
            raise forbidden(f"node {node_id_text(signer)[:12]} is not a live member of this swarm")
        try:
            evidence = Evidence.from_json(await json_object(request, MAX_EVIDENCE_BYTES))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if evidence.reporter != signer:
            raise forbidden("evidence is accepted only from the entry that reports it")
        if not node.raft.is_leader:
            return await forward_to_leader(request, NotLeader(node.raft.leader()), signer)
        if not node.adjudicator.submit(evidence):
            return error_response(
                429, "too much evidence is waiting", code="busy", headers={"Retry-After": "5"}
            )
        return JSONResponse({"queued": True, "digest": evidence.digest().hex()}, status_code=202)

    async def network_policy(request: Request) -> JSONResponse:
        ledger = node.raft.ledger
        if request.method == "GET":
            return JSONResponse(
                {"policy": policy_json(ledger.policy()), "settings": ledger.policy_settings()}
            )
        signer = await caller(request)
        voter_only(signer)
        command = _policy_command(await json_object(request), ledger.policy())
        return await commit(request, command, signer)

    async def network_ledger(request: Request) -> Response:
        """This node's copy of the ledger, with a claim it signs: how
        members outside Raft follow it (`runtime.node.ledger_follower`)."""
        raft = node.raft
        voters = (
            tuple(sorted(raft.raft.voters))
            if raft.in_configuration()
            else node.ledger_follower.voters
        )
        snapshot, digest = raft.ledger_snapshot()
        claim = LedgerClaim(raft.raft.term, raft.ledger.applied_index, digest, voters)
        return Response(
            snapshot,
            media_type="application/cbor",
            headers=signed_headers(node.identity, claim),
        )

    async def network_voters(request: Request) -> JSONResponse:
        """Who votes and who may; a POST makes one more node eligible."""
        if request.method == "GET":
            return JSONResponse(node.raft.voters_view())
        signer = await caller(request)
        voter_only(signer)
        body = await json_object(request)
        try:
            eligible = node_id_from_text(str(body.get("node_id")))
        except ValueError as exc:
            raise BadRequest(f"node_id: {exc}", "node_id") from None
        return await commit(request, Eligible(eligible, time.time()), signer)

    async def network_refound(request: Request) -> JSONResponse:
        """Make this node the only voter (`RaftDriver.refound`); its own
        operator's call only, since it can lose committed entries."""
        if await caller(request) is not None:
            raise forbidden("a refound is for this node's operator only")
        await json_object(request)  # JSON only, like every POST; no fields
        try:
            index = await node.raft.refound()
        except RefoundRefused as exc:
            return error_response(409, str(exc), code="cannot_refound")
        return JSONResponse(
            {"index": index, "term": node.raft.raft.term, **node.raft.voters_view()}
        )

    async def debug_faults(request: Request) -> JSONResponse:
        if await caller(request) is not None:
            raise forbidden("fault injection is for this node's operator only")
        if not node.fault_injection:
            return error_response(404, "fault injection is off (start with --fault-injection)")
        isolate = (await json_object(request)).get("isolate")
        if type(isolate) is not bool:
            raise BadRequest("isolate must be true or false", "isolate")
        node.membership.isolate(isolate)
        log.warning("fault injection: control plane %s", "cut" if isolate else "restored")
        return JSONResponse({"isolated": node.membership.isolated})

    async def network_invitations(request: Request) -> JSONResponse:
        """An invitation to this private swarm, signed by this node (a voter)."""
        if await caller(request) is not None:
            raise forbidden("invitations are for this node's operator only")
        body = await json_object(request)
        voter = body.get("voter", False)
        expires_s = body.get("expires_s", DEFAULT_INVITATION_S)
        if type(voter) is not bool:
            raise BadRequest("voter must be true or false", "voter")
        if type(expires_s) not in (int, float):
            raise BadRequest("expires_s must be a number of seconds", "expires_s")
        control = node.addresses["control"].removeprefix("tcp://")
        try:
            invitation = node.access.invite(
                voter=voter,
                expires_s=expires_s,
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
                "expires_at": invitation.expires_at,
            }
        )

    async def network_join(request: Request) -> JSONResponse:
        """A newcomer redeems an invitation for its own key. Checked here,
        then at the leader (against its voters) before it commits."""
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
        try:
            invitation = node.access.check_redemption(token, newcomer, at, signed)
        except AccessError as exc:
            return error_response(403, str(exc), code="invitation_refused")
        admit = Admit(newcomer, invitation.voter, invitation.digest(), time.time())
        return await commit(request, admit, None)

    async def network_status(request: Request) -> JSONResponse:
        return JSONResponse(node.status())

    async def network_coverage(request: Request) -> JSONResponse:
        coverage = node.status()["coverage"]
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

    return [
        Route("/v1/network/artifacts/{digest}/{name}", artifact, methods=["GET"]),
        Route("/v1/network/models/{name}/manifest", model_manifest, methods=["GET"]),
        Route("/v1/network/status", network_status, methods=["GET"]),
        Route("/v1/network/coverage", network_coverage, methods=["GET"]),
        Route("/v1/network/demand", network_demand, methods=["POST"]),
        Route(EVIDENCE_PATH, network_evidence, methods=["POST"]),
        Route("/v1/network/policy", network_policy, methods=["GET", "POST"]),
        Route("/v1/network/assign", network_assign, methods=["POST"]),
        Route("/v1/nodes/assign", nodes_assign, methods=["POST"]),
        Route("/v1/debug/faults", debug_faults, methods=["POST"]),
        Route(LEDGER_PATH, network_ledger, methods=["GET"]),
        Route("/v1/network/voters", network_voters, methods=["GET", "POST"]),
        Route("/v1/network/refound", network_refound, methods=["POST"]),
        Route("/v1/network/invitations", network_invitations, methods=["POST"]),
        Route("/v1/network/join", network_join, methods=["POST"]),
    ]


def _bootstrap_fields(body: dict[str, Any]) -> tuple[bytes, str, tuple[int, int], str]:
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
        or not 0 <= layers[0] < layers[1]
    ):
        raise BadRequest("layers must be [a, b] with 0 <= a < b", "layers")
    recipe = body.get("recipe", "fp32")
    if recipe not in RECIPES:
        raise BadRequest(f"recipe must be one of {sorted(RECIPES)}", "recipe")
    return node_id, model, (layers[0], layers[1]), recipe


def _demand_command(body: dict[str, Any]) -> RecordDemand:
    model = body.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_TEXT:
        raise BadRequest(f"model must be a non-empty string of <= {MAX_TEXT} chars", "model")
    count = body.get("count", 1)
    if type(count) is not int or not 1 <= count <= MAX_DEMAND_COUNT:
        raise BadRequest(f"count must be an integer in [1, {MAX_DEMAND_COUNT}]", "count")
    return RecordDemand(model=model, count=count, at=time.time())


def _policy_command(body: dict[str, Any], current: PlacementSettings) -> SetPolicy:
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
