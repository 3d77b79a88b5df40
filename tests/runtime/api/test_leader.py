"""Where an admin call's command commits (`runtime.api.leader`), in process.

`Leader` is driven through a small Starlette app whose route proposes a
command with it: on a real one-voter Raft driver that leads (the reply says
where it committed, and a policy change the policy now in force), and on a
follower (tests/runtime/api/inprocess.py's `FollowerRaft`) that forwards to
a recording leader served on loopback. The forwarded request is checked
byte for byte: the same path and body, marked forwarded, signed by this
node for its operator or carrying the signer's own headers; and each way
there is no leader to reach is a 503 that says to retry.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from consensus.commands import Command, Eligible, SetPolicy
from consensus.settings import PlacementSettings, policy_json
from mesh.identity import Identity, node_id_text
from runtime.api.leader import FORWARDED_HEADER, Leader, LeaderNode
from runtime.node.signed_http import SIGNED_HEADERS, sign_request, verify_request
from tests.runtime.api.inprocess import FollowerRaft, error_of, leading_node

POLICY = "/v1/network/policy"
ELIGIBLE = "/v1/network/voters"
SIGNED = "/v1/network/demand"
"""A route whose caller signed the request (its signer is passed on)."""
JSON = {"content-type": "application/json"}


@dataclass
class Node:
    """What a `Leader` reads of its node: its Raft driver, its key, and
    where the other members' APIs are."""

    raft: Any
    identity: Identity = field(default_factory=Identity.generate)
    apis: dict[bytes, str] = field(default_factory=dict)

    def member_api(self, node: bytes) -> str | None:
        return self.apis.get(node)


def app_of(node: LeaderNode) -> Starlette:
    """Each route commits its command through `Leader(node)`: a policy
    change and an eligible voter from the operator, and a change signed by
    the caller (`SIGNED`), whose signer is checked and passed on."""
    leader = Leader(node)

    async def commit(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        command: Command
        signer = None
        if request.url.path == ELIGIBLE:
            command = Eligible(bytes.fromhex(body["node_id"]), time.time())
        else:
            command = SetPolicy(tuple(sorted(body.items())), time.time())
        if request.url.path == SIGNED:
            signer = verify_request(
                request.headers, "POST", SIGNED, await request.body(), time.time()
            )
        return await leader.commit(request, command, signer)

    return Starlette(
        routes=[Route(p, commit, methods=["POST"]) for p in (POLICY, ELIGIBLE, SIGNED)]
    )


@asynccontextmanager
async def client_of(node: LeaderNode) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app_of(node))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        yield client


class Recorder:
    """A leader on loopback that records each request and answers `reply`."""

    def __init__(self, reply: Response) -> None:
        self.reply = reply
        self.requests: list[tuple[str, dict[str, str], bytes]] = []

    async def handle(self, request: Request) -> Response:
        self.requests.append((request.url.path, dict(request.headers), await request.body()))
        return self.reply


@asynccontextmanager
async def served(recorder: Recorder) -> AsyncIterator[str]:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 0.5
    app: Any = Starlette(
        routes=[Route(p, recorder.handle, methods=["POST"]) for p in (POLICY, SIGNED)]
    )
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config, shutdown_trigger=shutdown.wait))
        try:
            yield binds[0]
        finally:
            shutdown.set()


async def test_the_leader_commits_here_and_says_where(tmp_path: Path) -> None:
    async with leading_node(tmp_path) as node, client_of(node) as client:
        answer = await client.post(POLICY, json={"max_copies": 2}, headers=JSON)
        assert answer.status_code == 200, answer.text
        reply = answer.json()
        assert reply.pop("policy") == policy_json(PlacementSettings(max_copies=2))
        assert reply.pop("settings") == {"max_copies": 2}
        assert reply == {
            "index": node.raft.ledger.applied_index,
            "term": node.raft.raft.term,
            "accepted": True,
            "reason": None,
            "detail": None,
            "leader": node_id_text(node.node_id),
        }
        # Any other command's reply is where it committed, without the policy;
        # one the ledger refuses says why.
        newcomer = {"node_id": Identity.generate().node_id.hex()}
        first = (await client.post(ELIGIBLE, json=newcomer, headers=JSON)).json()
        assert first["accepted"] and "policy" not in first and first["reason"] is None
        again = (await client.post(ELIGIBLE, json=newcomer, headers=JSON)).json()
        assert not again["accepted"] and again["reason"] and again["detail"]
        assert again["index"] == first["index"] + 1


async def test_without_a_leader_to_reach_the_call_is_a_503_to_retry() -> None:
    known = Identity.generate().node_id
    cases = [
        (Node(FollowerRaft(b"\x01" * 32, None)), "no_leader", None),
        (Node(FollowerRaft(b"\x01" * 32, known)), "not_leader", known),  # its API unknown
        (Node(FollowerRaft(b"\x01" * 32, None, failing=True)), "proposal_failed", None),
    ]
    for node, code, leader in cases:
        async with client_of(node) as client:
            answer = await client.post(POLICY, json={"max_copies": 2}, headers=JSON)
        error = error_of(answer, 503, code)
        assert answer.headers["retry-after"] == "1"
        if code != "proposal_failed":
            assert error["leader"] == (node_id_text(leader) if leader else None)


async def test_the_operators_call_goes_on_once_signed_by_this_node() -> None:
    recorder = Recorder(JSONResponse({"accepted": True, "index": 9}, status_code=202))
    async with served(recorder) as url:
        leader = Identity.generate().node_id
        node = Node(FollowerRaft(Identity.generate().node_id, leader), apis={leader: url})
        node.raft.node_id = node.identity.node_id
        body = b'{"max_copies": 2}'
        async with client_of(node) as client:
            answer = await client.post(POLICY, content=body, headers=JSON)
            assert answer.status_code == 202 and answer.json() == {"accepted": True, "index": 9}
            # A request forwarded to us already is not forwarded again.
            again = await client.post(POLICY, content=body, headers={**JSON, FORWARDED_HEADER: "x"})
            assert error_of(again, 503, "not_leader")["leader"] == node_id_text(leader)
    ((path, headers, sent),) = recorder.requests
    assert path == POLICY and sent == body
    assert headers[FORWARDED_HEADER] == node_id_text(node.identity.node_id)
    assert headers["content-type"] == "application/json"
    assert verify_request(headers, "POST", POLICY, sent, time.time()) == node.identity.node_id


async def test_a_signed_call_goes_on_with_its_signers_own_signature() -> None:
    recorder = Recorder(JSONResponse({"accepted": True}))
    member = Identity.generate()
    async with served(recorder) as url:
        leader = Identity.generate().node_id
        node = Node(FollowerRaft(Identity.generate().node_id, leader), apis={leader: url})
        body = b'{"max_copies": 3}'
        signature = sign_request(member, "POST", SIGNED, body, time.time())
        async with client_of(node) as client:
            answer = await client.post(SIGNED, content=body, headers={**JSON, **signature})
        assert answer.status_code == 200, answer.text
    ((_, headers, sent),) = recorder.requests
    assert {name: headers[name] for name in SIGNED_HEADERS} == signature
    assert verify_request(headers, "POST", SIGNED, sent, time.time()) == member.node_id


async def test_a_leader_that_does_not_answer_json_is_a_503() -> None:
    leader = Identity.generate().node_id
    recorder = Recorder(PlainTextResponse("not json"))
    async with served(recorder) as url:
        node = Node(FollowerRaft(b"\x02" * 32, leader), apis={leader: url})
        async with client_of(node) as client:
            answer = await client.post(POLICY, json={"max_copies": 2}, headers=JSON)
    error = error_of(answer, 503, "leader_unreachable")
    assert node_id_text(leader) in error["message"]
    with trio.socket.socket() as sock:  # nothing listens here
        await sock.bind(("127.0.0.1", 0))
        node.apis = {leader: f"http://127.0.0.1:{sock.getsockname()[1]}"}
        async with client_of(node) as client:
            answer = await client.post(POLICY, json={"max_copies": 2}, headers=JSON)
    assert node_id_text(leader) in error_of(answer, 503, "leader_unreachable")["message"]
