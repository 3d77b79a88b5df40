"""Who may connect: redeeming an invitation over real HTTP (against a stand-in
door, and through a real node's door, Raft and ledger), the door's rate
budget, and the handshake policy."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
import trio

from consensus.commands import Found
from consensus.invitations import (
    NONCE_BYTES,
    decode_invitation,
    issue_invitation,
    redemption_bytes,
)
from mesh.identity import Identity, curve_public_key, verify
from runtime.node.access import (
    DEFAULT_VOTER_INVITATION_S,
    JOIN_PATH,
    MAX_VOTER_INVITATION_S,
    AccessError,
    RedemptionBusy,
    RedemptionLimit,
    SwarmAccess,
    redeem_invitation,
)
from runtime.node.hostport import HostPort
from runtime.node.http_server import start_http
from tests.runtime.api.inprocess import ApiNode, client_of, error_of, leading_node, served

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
        headers = [(b"retry-after", b"0")] if status == 429 else []
        await send({"type": "http.response.start", "status": status, "headers": headers})
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
        return 200, {"accepted": True}

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


async def test_a_rejected_admission_is_a_refusal_and_a_busy_door_is_asked_again() -> None:
    """A 200 carries the ledger's verdict: rejected is refused (it used to
    pass for admitted), admitted before (a restart) is fine. A 429 is
    asked again, freshly signed, until the newcomer's patience runs out."""
    inviter = Identity.generate()
    answers = [
        (429, {"error": {"message": "busy"}}),
        (200, {"accepted": False, "reason": "already_admitted", "detail": "a member"}),
        (200, {"accepted": False, "reason": "invitation_used", "detail": "ask for a new one"}),
        (429, {"error": {"message": "this node is redeeming too many"}}),
    ]
    asked: list[dict[str, Any]] = []

    def answer(body: dict[str, Any]) -> Reply:
        asked.append(body)
        return answers.pop(0)

    async def redeem(url: str) -> None:
        token = invitation_to(url, inviter)
        await redeem_invitation(Identity.generate(), token)  # busy, then a member already
        with pytest.raises(AccessError, match="invitation_used: ask for a new one"):
            await redeem_invitation(Identity.generate(), token)
        with pytest.raises(AccessError, match="too many"):
            await redeem_invitation(Identity.generate(), token, patience_s=0.0)

    await serving(answer, redeem)
    assert len(asked) == 4 and not answers


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


def test_a_voters_invitation_is_for_one_node_and_short_lived() -> None:
    me = Identity.generate()
    raft = Raft(Ledger(Founding(me.node_id, "private")))
    raft.raft = Voters(frozenset({me.node_id}))  # type: ignore[attr-defined]
    access = SwarmAccess(me, cast(Any, raft), founding=None)
    before = time.time()
    voter = access.invite(voter=True, expires_s=None, seed="s", api="http://x")
    assert voter.admits == 1
    assert before + DEFAULT_VOTER_INVITATION_S - 1 <= voter.expires_at <= time.time() + 3600
    batch = access.invite(voter=False, expires_s=60, uses=5, seed="s", api="http://x")
    assert batch.admits == 5 and not batch.voter
    with pytest.raises(AccessError, match="one node"):
        access.invite(voter=True, expires_s=60, uses=2, seed="s", api="http://x")
    with pytest.raises(AccessError, match="voter's invitation expires"):
        access.invite(voter=True, expires_s=MAX_VOTER_INVITATION_S + 1, seed="s", api="http://x")
    with pytest.raises(AccessError, match="uses must be"):
        access.invite(voter=False, expires_s=60, uses=0, seed="s", api="http://x")


@dataclass
class Voters:
    voters: frozenset[bytes]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_door_budgets_redemptions_per_source_and_in_all() -> None:
    clock = Clock()
    limit = RedemptionLimit(per_address=2, per_prefix=3, total=4, clock=clock)
    for source in ("10.0.0.1", "10.0.0.1", "10.0.0.2"):
        limit.check(source)  # checking takes nothing: only a genuine redemption is charged
        limit.take(source)
    with pytest.raises(RedemptionBusy, match="your network"):
        limit.check("10.0.0.1")
    with pytest.raises(RedemptionBusy, match="your network"):
        limit.check("10.0.0.3")  # its /24 spent its three
    limit.check("10.9.0.1")
    limit.take("10.9.0.1")
    with pytest.raises(RedemptionBusy, match="this node"):
        limit.check("10.8.0.1")  # a new network, but the node's four are spent
    clock.now += 60.0
    limit.check("10.0.0.1")


# --- through a real node's door, Raft and ledger --------------------------------------


async def _private(node: ApiNode) -> None:
    committed = await node.raft.propose(Found(node.node_id, "private", time.time()))
    assert committed.accepted


def _token(node: ApiNode, url: str, *, voter: bool = False, uses: int = 1) -> str:
    seed = f"{node.node_id.hex()}@127.0.0.1:7001"
    return node.access.invite(voter=voter, expires_s=None, uses=uses, seed=seed, api=url).token()


async def _redeemed(token: str, keys: list[Identity]) -> list[bool]:
    """Each key redeems `token` in turn: whether it was admitted."""
    admitted = []
    for key in keys:
        try:
            await redeem_invitation(key, token, patience_s=0.0)
            admitted.append(True)
        except AccessError as exc:
            assert "all the nodes it may" in str(exc), exc
            admitted.append(False)
    return admitted


async def test_a_member_invitation_redeemed_twice_admits_only_the_first(tmp_path: Path) -> None:
    async with leading_node(tmp_path) as node, served(node) as url:
        await _private(node)
        first, second = Identity.generate(), Identity.generate()
        assert await _redeemed(_token(node, url), [first, second]) == [True, False]
        assert set(node.raft.ledger.admitted_keys()) == {first.node_id}
        # The first node redeeming again (a restart with --invite) is fine.
        assert await _redeemed(_token(node, url), [first]) == [True]


async def test_a_voter_invitation_used_by_three_keys_makes_one_voter(tmp_path: Path) -> None:
    async with leading_node(tmp_path) as node, served(node) as url:
        await _private(node)
        keys = [Identity.generate() for _ in range(3)]
        assert await _redeemed(_token(node, url, voter=True), keys) == [True, False, False]
        assert node.raft.ledger.eligible_voters() == {node.node_id, keys[0].node_id}


async def test_an_invitation_for_three_admits_exactly_three(tmp_path: Path) -> None:
    async with leading_node(tmp_path) as node, served(node) as url:
        await _private(node)
        keys = [Identity.generate() for _ in range(4)]
        assert await _redeemed(_token(node, url, uses=3), keys) == [True, True, True, False]
        assert len(node.raft.ledger.admitted_keys()) == 3


async def test_a_door_over_its_budget_answers_429_and_admits_nothing(tmp_path: Path) -> None:
    async with leading_node(tmp_path) as node, served(node) as url:
        node.access = SwarmAccess(
            node.identity,
            node.raft,
            founding=None,
            redemptions=RedemptionLimit(per_address=2, per_prefix=2, total=2),
        )
        await _private(node)
        token = _token(node, url, uses=5)
        assert await _redeemed(token, [Identity.generate(), Identity.generate()]) == [True, True]
        with pytest.raises(AccessError, match="too many invitations redeemed from your network"):
            await redeem_invitation(Identity.generate(), token, patience_s=0.0)
        late, at = Identity.generate(), int(time.time())
        signed = late.sign(redemption_bytes(decode_invitation(token), late.node_id, at)).hex()
        body = {"invitation": token, "node_id": late.node_id.hex(), "at": at, "signature": signed}
        async with client_of(node) as client:
            busy = await client.post(JOIN_PATH, json=body)
        error_of(busy, 429, "busy")
        assert busy.headers["retry-after"] == "6"
        assert len(node.raft.ledger.admitted_keys()) == 2
