"""Who may connect: the swarm's mode, its admitted members, and invitations.

A swarm is founded `open` (any key may be a member) or `private` (only keys
the ledger admitted, and the founder); every node keeps its planes'
handshake policy (`mesh.zap`) in step with the ledger, so a private swarm
refuses a stranger's key before it can say anything. Invitations
(`consensus.invitations`) are issued here by a voter, and a newcomer's
signed redemption is checked here (within a rate budget per source and in
all, `RedemptionLimit`) before the leader commits its admission; the ledger
refuses one past the invitation's uses.

Why a node admits every key until it has the founding:
docs/design/node.md#access-open-and-private-swarms.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Final

import httpx
import trio

from consensus.commands import MAX_INVITATION_USES, Admit, Found
from consensus.invitations import (
    NONCE_BYTES,
    Invitation,
    InvitationError,
    decode_invitation,
    issue_invitation,
    redemption_bytes,
)
from consensus.ledger import REASON_ALREADY_ADMITTED, ApplyResult
from mesh.identity import Identity, curve_public_key, verify
from mesh.newcomers import NEWCOMER_WINDOW_S, NewcomerLimit
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
DEFAULT_INVITATION_S: Final = 24 * 3600
"""A member invitation's default life: a day to hand it over and use it."""
DEFAULT_VOTER_INVITATION_S: Final = 3600
"""A voter invitation's default life. Its holder gets a vote, and voters
are few (two voter keys of three took the swarm's majority, issue 30): an
hour is enough to hand it over and start the node in one sitting, and
leaves a leaked or forgotten one little time."""
MAX_VOTER_INVITATION_S: Final = 24 * 3600
"""The longest a voter invitation may stay redeemable (a member's:
`MAX_INVITATION_S`): longer than a day is a token nobody is watching."""
REDEMPTIONS_PER_ADDRESS: Final = 10
"""Redemptions one source address may have let through per
`NEWCOMER_WINDOW_S`. A node redeems once; a retry after a lost answer, or a
few nodes behind one NAT, fit. 200 redemptions in 0.9 s (measured, issue
30) would take twenty minutes."""
REDEMPTIONS_PER_PREFIX: Final = 30
"""The same for a /24 (IPv4) or /48 (IPv6): a rack set up together."""
REDEMPTIONS_PER_WINDOW: Final = 60
"""Redemptions this node lets through per window from everyone. Every
admission is a Raft commit, and a leaked many-use token is drained at most
one a second: time for an operator to see it in `status`."""
MAX_REDEEM_WAIT_S: Final = 300.0
"""How long a newcomer retries a redemption the door answered busy (429):
budgets refill within a window, so a batch started together gets in."""
BUSY_RETRY_S: Final = 6
"""What a busy door asks a newcomer to wait (its `Retry-After`, and the
newcomer's wait when a relay lost the header): one address's budget gets a
redemption back every `NEWCOMER_WINDOW_S / REDEMPTIONS_PER_ADDRESS` s."""
_EVERYONE: Final = "everyone"
"""The one source the total budget is kept under: `NewcomerLimit` takes a
name that is not an IP as its own address and prefix."""


class AccessError(Exception):
    """A refused invitation or redemption; the message says why."""


class RedemptionBusy(AccessError):
    """A redemption refused for now: its source, or this node, used its
    budget (`RedemptionLimit`); it may come back in `BUSY_RETRY_S`."""


class RedemptionLimit:
    """How fast this node's door lets redemptions through to a commit: per
    source address and prefix (`mesh.newcomers.NewcomerLimit`), and in all.
    Only a redemption that passed every check is charged, so junk cannot
    spend honest newcomers' budget; once a budget is spent, a redemption is
    refused before any check. Not thread-safe: the API's trio thread only."""

    def __init__(
        self,
        *,
        per_address: int = REDEMPTIONS_PER_ADDRESS,
        per_prefix: int = REDEMPTIONS_PER_PREFIX,
        total: int = REDEMPTIONS_PER_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sources = NewcomerLimit(per_address, per_prefix, window=NEWCOMER_WINDOW_S)
        self._total = NewcomerLimit(total, total, window=NEWCOMER_WINDOW_S, max_tracked=1)
        self._clock = clock

    def check(self, source: str) -> None:
        """Raise `RedemptionBusy` if a redemption from `source` (an IP) would
        be over a budget now; takes nothing."""
        now = self._clock()
        if self._sources.refusal(source, now) is not None:
            raise RedemptionBusy("too many invitations redeemed from your network: try later")
        if self._total.refusal(_EVERYONE, now) is not None:
            raise RedemptionBusy("this node is redeeming too many invitations: try later")

    def take(self, source: str) -> None:
        """Charge one redemption from `source` (after `check`)."""
        now = self._clock()
        self._sources.admit(source, now)
        self._total.admit(_EVERYONE, now)


async def redeem_invitation(
    identity: Identity, token: str, *, patience_s: float = MAX_REDEEM_WAIT_S
) -> Seed:
    """Redeem `token` for this node's key at the inviter's API, before the
    node joins (a private swarm refuses its handshake until the admission
    commits); the seed to join through. A busy door (429) is asked again
    for up to `patience_s`. `AccessError` says what went wrong."""
    try:
        invitation = decode_invitation(token)
        seed = parse_seed(invitation.seed)
    except (InvitationError, EndpointError) as exc:
        raise AccessError(f"--invite: {exc}") from None
    url = invitation.api.rstrip("/") + JOIN_PATH
    deadline = trio.current_time() + patience_s
    try:
        async with httpx.AsyncClient(timeout=REDEEM_TIMEOUT_S) as client:
            while True:
                at = int(time.time())  # signed afresh: a retry must stay recent
                signature = identity.sign(redemption_bytes(invitation, identity.node_id, at))
                body = {
                    "invitation": token.strip(),
                    "node_id": identity.node_id.hex(),
                    "at": at,
                    "signature": signature.hex(),
                }
                reply = await client.post(url, json=body)
                wait = _retry_after(reply)
                if wait is None or trio.current_time() + wait > deadline:
                    break
                log.info("the inviter's door is busy: redeeming again in %.0f s", wait)
                await trio.sleep(wait)
    except httpx.HTTPError as exc:
        message = f"--invite: the inviter at {invitation.api} did not answer: {exc}"
        raise AccessError(message) from None
    refusal = _refusal(reply)
    if refusal is not None:
        raise AccessError(f"--invite: the swarm refused the invitation: {refusal}")
    log.info("invitation redeemed: admitted to the swarm %s", invitation.swarm.hex()[:12])
    return seed


def _retry_after(reply: httpx.Response) -> float | None:
    """How long a busy door (429) asks us to wait; None for any other answer."""
    if reply.status_code != 429:
        return None
    try:
        return min(float(reply.headers.get("retry-after", BUSY_RETRY_S)), NEWCOMER_WINDOW_S)
    except ValueError:
        return float(BUSY_RETRY_S)


def _refusal(reply: httpx.Response) -> str | None:
    """Why the swarm did not admit us, from the door's answer; None when it
    did, now or before (a node redeeming again after a restart). A 200 is
    the ledger's verdict: an admission it rejected is a refusal too."""
    try:
        answer = reply.json()
    except ValueError:
        return reply.text[:200] or f"HTTP {reply.status_code}"
    if reply.status_code == 200 and isinstance(answer, dict):
        if answer.get("accepted") or answer.get("reason") == REASON_ALREADY_ADMITTED:
            return None
        return f"{answer.get('reason')}: {answer.get('detail')}"
    try:
        return str(answer["error"]["message"])
    except (KeyError, TypeError):
        return reply.text[:200]


class SwarmAccess:
    """The node's handshake policy, in step with the ledger; `attach` it to
    the planes, then every applied command may change it."""

    def __init__(
        self,
        identity: Identity,
        raft: RaftDriver,
        *,
        founding: str | None,
        redemptions: RedemptionLimit | None = None,
    ) -> None:
        """`founding`: the mode this node founds the swarm with (a node
        started without `--join`), None for a joiner; `redemptions`: the
        door's rate budget (the default limits unless given)."""
        self._identity = identity
        self._raft = raft
        self._founding = founding
        self._redemptions = redemptions if redemptions is not None else RedemptionLimit()
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

    def invite(
        self, *, voter: bool, expires_s: float | None, uses: int = 1, seed: str, api: str
    ) -> Invitation:
        """A token this node signs for `uses` nodes, redeemable for
        `expires_s` (None: the role's default); this node must be a voter of
        a private swarm, and a voter's invitation is for one node, briefly."""
        swarm = self._raft.ledger.founding
        if swarm is None or swarm.mode != "private":
            raise AccessError("this swarm is open: anyone may join it, no invitation needed")
        if self._identity.node_id not in self._raft.raft.voters:
            raise AccessError("only a voter signs invitations: ask a voter's operator")
        if expires_s is None:
            expires_s = DEFAULT_VOTER_INVITATION_S if voter else DEFAULT_INVITATION_S
        longest = MAX_VOTER_INVITATION_S if voter else MAX_INVITATION_S
        if not 0 < expires_s <= longest:
            role = "a voter's invitation" if voter else "an invitation"
            raise AccessError(f"{role} expires between 1 s and {longest} s from now")
        if voter and uses != 1:
            raise AccessError("a voter's invitation lets one node in: ask for one each")
        if not 1 <= uses <= MAX_INVITATION_USES:
            raise AccessError(f"uses must be between 1 and {MAX_INVITATION_USES} nodes")
        return issue_invitation(
            self._identity,
            swarm=swarm.swarm,
            voter=voter,
            expires_at=int(time.time() + expires_s),
            nonce=os.urandom(NONCE_BYTES),
            seed=seed,
            api=api,
            uses=uses,
        )

    def admission(
        self, token: str, node: bytes, at: int, signature: bytes, *, source: str
    ) -> Admit:
        """The admission a newcomer's redemption asks the leader to commit:
        if `source` (its IP) and this node are within their budgets
        (`RedemptionLimit`), the redemption is signed by the key `node` it
        names, recent, the token admits to this swarm now, and the ledger
        would accept it (not used up, not a member's key); else
        `AccessError` (`RedemptionBusy` for a budget). Every node that
        passes a redemption on checks it, the leader again against its
        voters, and the committed ledger has the last word."""
        self._redemptions.check(source)
        invitation = self._redeemable(token, node, at, signature)
        admit = Admit(node, invitation.voter, invitation.digest(), time.time(), invitation.admits)
        refusal = self._raft.ledger.admission_refusal(admit)
        if refusal is not None and refusal[0] != REASON_ALREADY_ADMITTED:
            raise AccessError(refusal[1])  # already admitted: commits as a no-op, answered so
        self._redemptions.take(source)
        return admit

    def _redeemable(self, token: str, node: bytes, at: int, signature: bytes) -> Invitation:
        """The invitation a newcomer redeems for its key `node`, if the
        redemption is its own, recent, and the token admits to this swarm
        now; else `AccessError`."""
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
