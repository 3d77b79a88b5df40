"""Who may change the swarm over HTTP: this node's operator, or a node that signed.

Chat and every GET are public. A call that changes the swarm (policy,
assignments, fault injection) needs one of two credentials:

* **the operator token** of the node asked (`STATE_DIR/operator.token`,
  `runtime.node.state_dir`), as `Authorization: Bearer TOKEN`, compared in
  constant time. Missing or wrong: 401 with `WWW-Authenticate: Bearer`.
* **a node's signature** (`runtime.node.signed_http`): what a node sends
  when it passes an operator's call on to the Raft leader, or reports its
  chat demand. `authenticate` checks the signature and its time (a bad one
  is a 403); the route then checks who signed (a voter, the node being
  assigned, a member), since only it knows what the call does.

Demand is never an operator's to invent: it comes only from members'
signed reports of the chat requests they received.
"""

from __future__ import annotations

import hmac
import time
from typing import Final

from starlette.exceptions import HTTPException
from starlette.requests import Request

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
