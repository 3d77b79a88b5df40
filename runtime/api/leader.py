"""An admin call's command committed on the Raft leader: proposed here, or forwarded once.

Any node accepts an admin call (policy, voters, assignments, demand, joins),
but only the leader proposes. `Leader.commit` proposes on this node when it
leads and answers with where the command committed; on a follower it passes
the request to the leader once. The operator token is this node's alone, so
an operator's call goes on signed by this node; a node's signed call goes
with its own signature; the leader checks who signed (`runtime.api.auth`).
A forwarded request is never forwarded again: the caller gets a 503 with
`Retry-After` and retries, instead of the request bouncing between nodes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Final, Protocol

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse

from consensus.commands import Command, SetPolicy
from consensus.settings import policy_json
from mesh.identity import Signer, node_id_text
from runtime.api.http import error_response
from runtime.node.raft_driver import NotLeader, ProposalFailed, RaftDriver
from runtime.node.signed_http import SIGNED_HEADERS, sign_request

FORWARDED_HEADER: Final = "x-shardmesh-forwarded-by"
"""Set on a request one node forwards to the leader. A forwarded request is
never forwarded again: if leadership moved meanwhile, the caller gets a 503
and retries, instead of the request bouncing between nodes. It only stops
loops: what the leader trusts is the request's signature."""
FORWARD_TIMEOUT_S: Final = 10.0
"""A forwarded proposal waits for its commit on the leader; this covers the
leader's own proposal timeout plus a round trip."""
RETRY_SOON: Final = {"Retry-After": "1"}


class LeaderNode(Protocol):
    """What a `Leader` reads of its node (`runtime.node.daemon.Node`)."""

    raft: RaftDriver

    @property
    def identity(self) -> Signer:
        """Signs what this node forwards to the leader."""
        ...

    def member_api(self, node: bytes) -> str | None: ...


class Leader:
    """Where one node's admin calls commit (see the module doc)."""

    def __init__(self, node: LeaderNode) -> None:
        self.node = node

    async def commit(
        self, request: Request, command: Command, signer: bytes | None
    ) -> JSONResponse:
        """Propose `command` here if we lead, else forward the request to
        the leader once; answer with where it committed. `signer` is who
        signed the request (None: this node's operator)."""
        raft = self.node.raft
        try:
            committed = await raft.propose(command)
        except NotLeader as exc:
            return await self.forward(request, exc, signer)
        except ProposalFailed as exc:
            return error_response(503, str(exc), code="proposal_failed", headers=RETRY_SOON)
        reply: dict[str, Any] = {
            "index": committed.index,
            "term": committed.term,
            "accepted": committed.accepted,
            "reason": committed.reason or None,
            "detail": committed.detail or None,
            "leader": node_id_text(raft.node_id),
        }
        if isinstance(command, SetPolicy):  # applied here: the swarm's policy from now on
            reply["policy"] = policy_json(raft.ledger.policy())
            reply["settings"] = raft.ledger.policy_settings()
        return JSONResponse(reply)

    async def forward(self, request: Request, exc: NotLeader, signer: bytes | None) -> JSONResponse:
        """Pass the request on to the leader `exc` names and relay its
        answer; a 503 when there is none, it is unknown or unreachable, or
        the request was forwarded to us already."""
        leader = exc.leader
        url = self.node.member_api(leader) if leader is not None else None
        if leader is None or url is None or request.headers.get(FORWARDED_HEADER):
            return error_response(
                503,
                str(exc),
                code="no_leader" if leader is None else "not_leader",
                headers=RETRY_SOON,
                leader=node_id_text(leader) if leader else None,
            )
        try:
            status, body = await self._post(request, url, signer)
        except (httpx.HTTPError, ValueError) as err:
            return error_response(
                503,
                f"the leader {node_id_text(leader)} did not answer: {err}",
                code="leader_unreachable",
                headers=RETRY_SOON,
            )
        return JSONResponse(body, status_code=status)

    async def _post(self, request: Request, url: str, signer: bytes | None) -> tuple[int, Any]:
        """The leader's status and JSON answer to the request, signed by this
        node for its operator (`signer` None), else with the signer's own headers."""
        content = await request.body()
        path = request.url.path
        signature: Mapping[str, str] = (
            sign_request(self.node.identity, "POST", path, content, time.time())
            if signer is None
            else {name: request.headers[name] for name in SIGNED_HEADERS}
        )
        async with httpx.AsyncClient(timeout=FORWARD_TIMEOUT_S) as client:
            reply = await client.post(
                url + path,
                content=content,
                headers={
                    "content-type": "application/json",
                    FORWARDED_HEADER: node_id_text(self.node.raft.node_id),
                    **signature,
                },
            )
        return reply.status_code, reply.json()
