"""Who may connect: redeeming an invitation over real HTTP, and the handshake policy."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import trio

from consensus.invitations import (
    NONCE_BYTES,
    decode_invitation,
    issue_invitation,
    redemption_bytes,
)
from mesh.identity import Identity, curve_public_key, verify
from runtime.node.access import JOIN_PATH, AccessError, SwarmAccess, redeem_invitation
from runtime.node.hostport import HostPort
from runtime.node.http_server import start_http

Reply = tuple[int, dict[str, Any]]


def invitation_to(api: str, inviter: Identity) -> str:
    return issue_invitation(
        inviter,
        swarm=inviter.node_id,
        voter=False,
        expires_at=int(time.time()) + 600,
        nonce=os.urandom(NONCE_BYTES),
        seed=f"{inviter.node_id.hex()}@127.0.0.1:7000",
        api=api,
    ).token()


async def serving(
    answer: Callable[[dict[str, Any]], Reply],
    run: Callable[[str], Awaitable[None]],
) -> None:
    """Run `run(url)` against an inviter API that answers `answer(body)`."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        assert scope["path"] == JOIN_PATH
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, reply = answer(json.loads(body))
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(reply).encode()})

    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await start_http(
            nursery, app, bind=HostPort("127.0.0.1", 0), advertise=None, shutdown=shutdown
        )
        try:
            await run(url)
        finally:
            shutdown.set()


async def test_a_redeemed_invitation_gives_the_seed_to_join() -> None:
    inviter, newcomer = Identity.generate(), Identity.generate()
    asked: list[dict[str, Any]] = []

    def admit(body: dict[str, Any]) -> Reply:
        asked.append(body)
        return 200, {"admitted": True}

    async def redeem(url: str) -> None:
        token = invitation_to(url, inviter)
        seed = await redeem_invitation(newcomer, token)
        assert seed.node == inviter.node_id and seed.at == HostPort("127.0.0.1", 7000)

    await serving(admit, redeem)
    (body,) = asked
    assert body["node_id"] == newcomer.node_id.hex()
    invitation = decode_invitation(body["invitation"])
    signed = redemption_bytes(invitation, newcomer.node_id, body["at"])
    assert verify(newcomer.node_id, signed, bytes.fromhex(body["signature"])), "its own key"


async def test_a_refusal_says_the_swarms_reason() -> None:
    inviter = Identity.generate()

    async def redeem(url: str) -> None:
        with pytest.raises(AccessError, match="refused the invitation: it expired"):
            await redeem_invitation(Identity.generate(), invitation_to(url, inviter))

    await serving(lambda _: (403, {"error": {"message": "it expired"}}), redeem)


async def test_a_bad_token_or_a_silent_inviter_is_one_clear_error() -> None:
    with pytest.raises(AccessError, match="--invite: not an invitation"):
        await redeem_invitation(Identity.generate(), "hello")
    inviter = Identity.generate()
    nobody = invitation_to("http://127.0.0.1:1", inviter)
    with pytest.raises(AccessError, match="did not answer"):
        await redeem_invitation(Identity.generate(), nobody)


@dataclass
class Founding:
    swarm: bytes
    mode: str


@dataclass
class Ledger:
    founding: Founding | None = None
    admitted: set[bytes] = field(default_factory=set)

    def admitted_keys(self) -> set[bytes]:
        return self.admitted


@dataclass
class Raft:
    ledger: Ledger
    on_apply: list[Any] = field(default_factory=list)
    on_replace: list[Any] = field(default_factory=list)


def test_the_handshake_policy_follows_the_ledger() -> None:
    me, founder, member, stranger = (Identity.generate() for _ in range(4))
    raft = Raft(Ledger())
    access = SwarmAccess(me, cast(Any, raft), founding=None)
    access.attach()
    key = curve_public_key
    assert access._admits(key(stranger.node_id) or b""), "no founding yet: every key"
    raft.ledger.founding = Founding(founder.node_id, "open")
    raft.on_replace[0]()
    assert access._admits(key(stranger.node_id) or b""), "an open swarm admits every key"
    raft.ledger.founding = Founding(founder.node_id, "private")
    raft.ledger.admitted = {member.node_id}
    raft.on_replace[0]()
    for allowed in (founder, member, me):
        assert access._admits(key(allowed.node_id) or b"")
    assert not access._admits(key(stranger.node_id) or b""), "a private swarm refuses strangers"


def test_only_a_private_swarms_voter_invites() -> None:
    me = Identity.generate()
    raft = Raft(Ledger(Founding(me.node_id, "open")))
    access = SwarmAccess(me, cast(Any, raft), founding=None)
    with pytest.raises(AccessError, match="open"):
        access.invite(voter=False, expires_s=60, seed="s", api="http://x")
