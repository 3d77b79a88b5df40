"""Who may connect: the swarm's mode, its admitted members, and invitations.

A swarm is founded `open` (any key may be a member) or `private` (only keys
the ledger admitted, and the founder); every node keeps its planes'
handshake policy (`mesh.zap`) in step with the ledger, so a private swarm
refuses a stranger's key before it can say anything. Invitations
(`consensus.invitations`) are issued here by a voter, and a newcomer's
signed redemption is checked here before the leader commits its admission.

Why a node admits every key until it has the founding:
docs/design/node.md#access-open-and-private-swarms.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Final

import httpx
import trio

from consensus.commands import Admit, Found
from consensus.invitations import (
    NONCE_BYTES,
    Invitation,
    InvitationError,
    decode_invitation,
    issue_invitation,
    redemption_bytes,
)
from consensus.ledger import ApplyResult
from mesh.identity import Identity, curve_public_key, verify
from mesh.transport import Plane
from mesh.zap import HandshakeGate
from runtime.node.hostport import EndpointError, Seed, parse_seed
from runtime.node.raft_driver import RaftDriver

log = logging.getLogger("shardmesh.node")

REDEMPTION_CLOCK_SKEW_S: Final = 300.0
"""How far a redemption's own time may be from ours. It only stops a
captured redemption being replayed much later (and a replay can only admit
the same key again); machines' clocks are rarely minutes apart."""
JOIN_PATH: Final = "/v1/network/join"
REDEEM_TIMEOUT_S: Final = 30.0
"""The inviter forwards a redemption to the leader, which commits it: a
few round trips, seconds at most on a slow WAN."""
FOUND_RETRY_S: Final = 0.5
"""How often the founder checks whether its founding still needs committing."""
MAX_INVITATION_S: Final = 30 * 24 * 3600
"""The longest an invitation may stay redeemable: a forgotten token should
not open a private swarm forever."""


class AccessError(Exception):
    """A refused invitation or redemption; the message says why."""


async def redeem_invitation(identity: Identity, token: str) -> Seed:
    """Redeem `token` for this node's key at the inviter's API, before the
    node joins (a private swarm refuses its handshake until the admission
    commits); the seed to join through. `AccessError` says what went wrong."""
    try:
        invitation = decode_invitation(token)
        seed = parse_seed(invitation.seed)
    except (InvitationError, EndpointError) as exc:
        raise AccessError(f"--invite: {exc}") from None
    at = int(time.time())
    signature = identity.sign(redemption_bytes(invitation, identity.node_id, at))
    body = {
        "invitation": token.strip(),
        "node_id": identity.node_id.hex(),
        "at": at,
        "signature": signature.hex(),
    }
    url = invitation.api.rstrip("/") + JOIN_PATH
    try:
        async with httpx.AsyncClient(timeout=REDEEM_TIMEOUT_S) as client:
            reply = await client.post(url, json=body)
    except httpx.HTTPError as exc:
        message = f"--invite: the inviter at {invitation.api} did not answer: {exc}"
        raise AccessError(message) from None
    if reply.status_code != 200:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text[:200]
        raise AccessError(f"--invite: the swarm refused the invitation: {message}")
    log.info("invitation redeemed: admitted to the swarm %s", invitation.swarm.hex()[:12])
    return seed


class SwarmAccess:
    """The node's handshake policy, in step with the ledger; `attach` it to
    the planes, then every applied command may change it."""

    def __init__(self, identity: Identity, raft: RaftDriver, *, founding: str | None) -> None:
        """`founding`: the mode this node founds the swarm with (a node
        started without `--join`), None for a joiner."""
        self._identity = identity
        self._raft = raft
        self._founding = founding
        self._planes: list[Plane] = []
        self._allowed: frozenset[bytes] | None = None  # None: every key
        self._proposing = False
        raft.on_apply.append(self._on_apply)
        raft.on_replace.append(self._refresh)

    def attach(self, *planes: Plane, newcomers: HandshakeGate | None = None) -> None:
        """Put the handshake policy on `planes`, and the Sybil bound
        `newcomers` (one gate for all of them: `MembershipDriver.newcomers`,
        so a newcomer is charged once, by the profile's limits)."""
        self._planes = list(planes)
        self._refresh()
        for plane in planes:
            plane.admit(self._admits)
            plane.limit_newcomers(newcomers)

    def _admits(self, key: bytes) -> bool:
        """The planes' policy (called on libzmq's ZAP thread: it reads one
        frozenset the trio thread replaces whole, never mutates)."""
        allowed = self._allowed
        return allowed is None or key in allowed

    def _on_apply(self, result: ApplyResult) -> None:
        if isinstance(result.command, Found | Admit):
            self._refresh()

    def _refresh(self) -> None:
        ledger = self._raft.ledger
        swarm = ledger.founding
        if swarm is None or swarm.mode == "open":
            self._allowed = None
            return
        members = {swarm.swarm, self._identity.node_id, *ledger.admitted_keys()}
        keys = (curve_public_key(node) for node in members)
        self._allowed = frozenset(key for key in keys if key is not None)

    async def run(self) -> None:
        """Until cancelled: the founder commits the founding once it leads."""
        while self._founding is not None and self._raft.ledger.founding is None:
            await self.found_when_leading()
            await trio.sleep(FOUND_RETRY_S)

    async def found_when_leading(self) -> None:
        """The founder, once it leads with no founding in its ledger,
        commits it (retried by `run` until it sticks)."""
        if self._founding is None or self._proposing or self._raft.ledger.founding is not None:
            return
        if not self._raft.is_leader:
            return
        self._proposing = True
        try:
            await self._raft.propose(Found(self._identity.node_id, self._founding, time.time()))
            log.info("founded a %s swarm", self._founding)
        except Exception as exc:  # retried on the next round
            log.warning("could not commit the swarm's founding yet: %s", exc)
        finally:
            self._proposing = False

    def invite(self, *, voter: bool, expires_s: float, seed: str, api: str) -> Invitation:
        """A token this node signs; it must be a voter of a private swarm."""
        swarm = self._raft.ledger.founding
        if swarm is None or swarm.mode != "private":
            raise AccessError("this swarm is open: anyone may join it, no invitation needed")
        if self._identity.node_id not in self._raft.raft.voters:
            raise AccessError("only a voter signs invitations: ask a voter's operator")
        if not 0 < expires_s <= MAX_INVITATION_S:
            raise AccessError(f"expires must be between 1 s and {MAX_INVITATION_S} s")
        return issue_invitation(
            self._identity,
            swarm=swarm.swarm,
            voter=voter,
            expires_at=int(time.time() + expires_s),
            nonce=os.urandom(NONCE_BYTES),
            seed=seed,
            api=api,
        )

    def check_redemption(self, token: str, node: bytes, at: int, signature: bytes) -> Invitation:
        """The invitation a newcomer redeems for its key `node`, if the
        redemption is its own, recent, and the token admits to this swarm
        now; else `AccessError`. Every node that passes a redemption on
        checks it, and the leader checks it again against its voters."""
        try:
            invitation = decode_invitation(token)
        except InvitationError as exc:
            raise AccessError(str(exc)) from None
        if not verify(node, redemption_bytes(invitation, node, at), signature):
            raise AccessError("the redemption is not signed by the node it names")
        if abs(time.time() - at) > REDEMPTION_CLOCK_SKEW_S:
            raise AccessError("the redemption's time is too far from ours (check the clocks)")
        swarm = self._raft.ledger.founding
        if swarm is None or swarm.mode != "private":
            raise AccessError("this swarm is open: join it without an invitation")
        try:
            invitation.check(swarm=swarm.swarm, voters=self._raft.raft.voters, now=time.time())
        except InvitationError as exc:
            raise AccessError(str(exc)) from None
        return invitation
