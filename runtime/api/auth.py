"""Who may change the swarm over HTTP: this node's operator, or a node that signed.

Chat and every GET are public. A call that changes the swarm needs one of two
credentials: **the operator token** of the node asked (`STATE_DIR/operator.token`,
as `Authorization: Bearer TOKEN`, compared in constant time; missing or wrong:
401 with `WWW-Authenticate: Bearer`), or **a node's signature**
(`runtime.node.signed_http`), which a node sends when it passes an operator's
call on to the Raft leader or reports chat demand (bad or replayed: 403).
`authenticate` says who calls; `Gate` then says whether they may: a voter for
admin calls, the node being assigned for its own bootstrap, a live member for
demand and evidence. Demand is never an operator's to invent. Before any of
it, a Gate refuses a `Host` this node does not serve on (`421`,
`runtime.api.hosts`: DNS rebinding).
"""

from __future__ import annotations

import hmac
import time
from typing import Final, Protocol

from starlette.exceptions import HTTPException
from starlette.requests import Request

from mesh.identity import node_id_text
from mesh.member_table import LIVE_STATES
from runtime.api.hosts import host_refusal
from runtime.node.membership_driver import MembershipDriver
from runtime.node.raft_driver import RaftDriver
from runtime.node.signed_http import ReplayGuard, SignatureRefused, is_signed, verify_request

TOKEN_HINT: Final = (
    "it needs this node's operator token as Authorization: Bearer TOKEN "
    "(the node's STATE_DIR/operator.token; `shardmesh policy` reads it from "
    "SHARDMESH_TOKEN, --token-file or --state-dir)"
)


def unauthorized(message: str) -> HTTPException:
    return HTTPException(401, message, headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str) -> HTTPException:
    return HTTPException(403, message)


async def authenticate(
    request: Request, token: str, replays: ReplayGuard, *, operator: bool = True
) -> bytes | None:
    """Who makes this call: None for the holder of `token` (this node's
    operator), else the id of the node whose signature and timestamp check
    out, used for the first time (`replays`). 401 without a credential or
    with a wrong token; 403 for a bad signature. With `operator=False`
    (demand) only a signature counts."""
    header = request.headers.get("authorization")
    if operator and header is not None:
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            return None
        raise unauthorized(f"wrong operator token: {TOKEN_HINT}")
    if is_signed(request.headers):
        body = await request.body()
        try:
            return verify_request(
                request.headers, request.method, request.url.path, body, time.time(), replays
            )
        except SignatureRefused as exc:
            raise forbidden(f"refused a node-signed request: {exc}") from None
    if not operator:
        raise forbidden(
            f"{request.url.path} takes reports signed by a member of the swarm only "
            "(chat entries send their own demand)"
        )
    raise unauthorized(f"{request.method} {request.url.path} changes the swarm: {TOKEN_HINT}")


class GateNode(Protocol):
    """What a `Gate` reads of its node (`runtime.node.daemon.Node`)."""

    raft: RaftDriver
    membership: MembershipDriver

    @property
    def operator_token(self) -> str:
        """What this node's operator presents (`STATE_DIR/operator.token`)."""
        ...

    @property
    def addresses(self) -> dict[str, str]:
        """Where peers reach this node: control, data, api (empty until it serves)."""
        ...


class Gate:
    """One node's checks of who calls and whether they may, for its routes.

    It holds the node's `ReplayGuard`, shared by every route, so a signed
    request is accepted once whichever route it reaches. Each check either
    returns who called (None: this node's operator; else the signer's id) or
    raises the 401/403 the app turns into OpenAI's error shape."""

    def __init__(self, node: GateNode) -> None:
        self.node = node
        self.replays = ReplayGuard()

    def served_host(self, request: Request) -> None:
        """421 unless the request's `Host` is one this node serves on
        (`runtime.api.hosts`); every check below makes it first."""
        refusal = host_refusal(request.headers.get("host"), self.node.addresses)
        if refusal is not None:
            raise HTTPException(421, refusal)

    async def caller(self, request: Request, *, operator: bool = True) -> bytes | None:
        """`authenticate` against this node's token and replay guard, for a
        request that names this node (`served_host`)."""
        self.served_host(request)
        token = self.node.operator_token
        return await authenticate(request, token, self.replays, operator=operator)

    async def operator(self, request: Request, refusal: str) -> None:
        """403 (`refusal`) unless this node's own operator calls: for what
        no other node may ask for it (refound, invitations, fault injection)."""
        if await self.caller(request) is not None:
            raise forbidden(refusal)

    async def voter(self, request: Request) -> bytes | None:
        """The caller of an admin call, which must be the operator or a voter."""
        signer = await self.caller(request)
        self.voter_only(signer)
        return signer

    async def member(self, request: Request, refusal: str = "") -> bytes:
        """The live member that signed this report (demand, evidence); a
        403 for anyone else, with `refusal` appended to its message."""
        signer = await self.caller(request, operator=False)
        assert signer is not None  # operator=False: only a signature is accepted
        if not self.live_member(signer):
            raise forbidden(
                f"node {node_id_text(signer)[:12]} is not a live member of this swarm{refusal}"
            )
        return signer

    def live_member(self, signer: bytes) -> bool:
        member = self.node.membership.member(signer)
        return member is not None and member.state in LIVE_STATES

    def voter_only(self, signer: bytes | None, assignee: bytes | None = None) -> None:
        """403 unless the call is the operator's (None) or signed by a Raft
        voter of this node's current configuration (or by `assignee`, a
        live member asking for its own bootstrap assignment)."""
        if signer is None or signer in self.node.raft.raft.voters:
            return
        if signer == assignee and self.live_member(signer):
            return
        raise forbidden(
            f"node {node_id_text(signer)[:12]} signed this call, but only a Raft voter's "
            "forwarded admin calls are accepted"
            + (" (or a member's own bootstrap assignment)" if assignee is not None else "")
        )
