"""How a member outside the Raft configuration keeps its copy of the ledger.

Only trusted nodes replicate the placement ledger by Raft (`consensus.voters`);
every other member follows the leader's `mesh.records.LedgerNotice`, gossiped
in its signed record: a member whose copy is older than the newest notice of
a voter it trusts pulls the ledger from that voter (at once when the notice
names it, else at most every `LAZY_PULL_S`), and installs it only if the
voter's signed claim and the snapshot's digest check out. It trusts its
seeds first, then the voters each accepted claim names.

Why not replicate to everyone, whom to trust, and what a stranger can do:
docs/design/node.md#the-ledger-follower.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import httpx
import trio

from consensus.commands import LedgerError
from consensus.ledger import PlacementLedger, snapshot_digest
from mesh.identity import SIGNATURE_BYTES, Signer, node_id_from_text, node_id_text, verify
from mesh.records import LedgerNotice, NodeRecord

log = logging.getLogger("shardmesh.ledger")

LEDGER_PATH: Final = "/v1/network/ledger"
CLAIM_HEADER: Final = "x-shardmesh-ledger-claim"
SIGNATURE_HEADER: Final = "x-shardmesh-ledger-signature"
_DOMAIN: Final = b"shardmesh-ledger-v1\n"

POLL_S: Final = 0.5
"""How often the follower compares its copy with the notices it has heard.
Gossip takes seconds to spread a notice anyway; half a second adds little."""
MIN_PULL_INTERVAL_S: Final = 1.0
"""At most one pull per this long: a leader that commits every few
milliseconds does not turn into a pull per commit on every member."""
LAZY_PULL_S: Final = 10.0
"""A newer notice that does not name this node (its assignment did not
change) is pulled at most this often: members keep a fresh enough view
(policy, eligibility, others' shards) without a swarm of thousands pulling
the ledger on every commit, which demand reports make every few seconds."""
REFRESH_S: Final = 30.0
"""Pull from a trusted voter at least this often even with no newer notice:
the answer's claim names the current voters, so a member learns of a new
voter that leads before its predecessor's last notice reached it."""
MAX_BACKOFF_S: Final = 30.0
"""Longest wait after failed pulls (doubling from `MIN_PULL_INTERVAL_S`)."""
PULL_TIMEOUT_S: Final = 10.0
MAX_LEDGER_BYTES: Final = 64 * 1024 * 1024
"""A pulled ledger larger than this is refused before it is parsed."""


class ClaimRefused(Exception):
    """A pulled ledger that must not be installed; the message says why."""


@dataclass(frozen=True, slots=True)
class LedgerClaim:
    """What a node vouches for when it hands out its copy of the ledger."""

    term: int
    index: int
    digest: str
    voters: tuple[bytes, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "term": self.term,
            "index": self.index,
            "digest": self.digest,
            "voters": [node_id_text(v) for v in self.voters],
        }

    @classmethod
    def from_json(cls, value: object) -> LedgerClaim:
        if not isinstance(value, dict) or set(value) != {"term", "index", "digest", "voters"}:
            raise ClaimRefused("a ledger claim is {term, index, digest, voters}")
        term, index, digest, voters = (value[k] for k in ("term", "index", "digest", "voters"))
        if type(term) is not int or type(index) is not int or min(term, index) < 0:
            raise ClaimRefused("a ledger claim's term and index are non-negative integers")
        if type(digest) is not str or len(digest) != 64:
            raise ClaimRefused("a ledger claim's digest is a sha256 in hex")
        if not isinstance(voters, list):
            raise ClaimRefused("a ledger claim's voters are a list of node ids")
        try:
            ids = tuple(node_id_from_text(str(v)) for v in voters)
        except ValueError as exc:
            raise ClaimRefused(f"a ledger claim names a bad voter: {exc}") from None
        return cls(term, index, digest, ids)


def _signing_bytes(claim_text: str) -> bytes:
    return _DOMAIN + claim_text.encode()


def signed_headers(signer: Signer, claim: LedgerClaim) -> dict[str, str]:
    """The headers a node answers a pull with: its claim, and its signature
    over exactly that text (the puller verifies the bytes it received)."""
    text = json.dumps(claim.to_json(), sort_keys=True, separators=(",", ":"))
    return {CLAIM_HEADER: text, SIGNATURE_HEADER: signer.sign(_signing_bytes(text)).hex()}


def verify_pull(
    signer: bytes, headers: Mapping[str, str], body: bytes, *, trusted: Iterable[bytes]
) -> LedgerClaim:
    """The claim of a pull answered by `signer`, if it may be installed:
    `signer` is trusted, signed this claim, and `body` is the claimed
    ledger. `ClaimRefused` says what failed."""
    if signer not in set(trusted):
        raise ClaimRefused(f"{node_id_text(signer)[:12]} is not a voter this node trusts")
    text = headers.get(CLAIM_HEADER)
    try:
        signature = bytes.fromhex(headers.get(SIGNATURE_HEADER, ""))
    except ValueError:
        signature = b""
    if text is None or len(signature) != SIGNATURE_BYTES:
        raise ClaimRefused("the answer carries no signed claim")
    if not verify(signer, _signing_bytes(text), signature):
        raise ClaimRefused("the claim's signature does not verify")
    try:
        claim = LedgerClaim.from_json(json.loads(text))
    except ValueError as exc:
        raise ClaimRefused(f"the claim is not JSON: {exc}") from None
    if snapshot_digest(body) != claim.digest:
        raise ClaimRefused("the ledger is not the one the claim names (digest)")
    return claim


class LedgerFollower:
    """Keeps a non-member-of-Raft node's ledger copy current (module doc)."""

    def __init__(
        self,
        *,
        node_id: bytes,
        seeds: Iterable[bytes],
        in_configuration: Callable[[], bool],
        record: Callable[[bytes], NodeRecord | None],
        api_of: Callable[[bytes], str | None],
        install: Callable[[PlacementLedger], None],
        held: Callable[[], int],
    ) -> None:
        """`held()` is the applied index of the copy this node holds (the
        ledger's index only grows, whoever leads); `install` replaces it.
        `record` and `api_of` read the swarm view."""
        self.node_id = node_id
        self._seeds = tuple(seeds)
        self._in_configuration = in_configuration
        self._record = record
        self._api_of = api_of
        self._install = install
        self._held = held
        self.voters: tuple[bytes, ...] = ()
        """The voters of the last claim installed: whom to believe next."""
        self.pulls = 0
        self.refused: dict[str, int] = {}
        self.last_error: str | None = None
        self._backoff = MIN_PULL_INTERVAL_S
        self._last_pull_at: float | None = None

    @property
    def trusted(self) -> tuple[bytes, ...]:
        """Voters from the last installed claim, else the seeds."""
        return self.voters or self._seeds

    def _newest(self) -> tuple[bytes, LedgerNotice] | None:
        best: tuple[bytes, LedgerNotice] | None = None
        for node in self.trusted:
            record = self._record(node)
            notice = None if record is None else record.ledger
            if notice is None:
                continue
            if best is None or (notice.term, notice.index) > (best[1].term, best[1].index):
                best = (node, notice)
        return best

    def leader(self) -> bytes | None:
        """The trusted voter whose notice has the highest term: the leader,
        as far as this member can tell (None: no notice heard)."""
        newest = self._newest()
        return None if newest is None else newest[0]

    def caught_up(self) -> bool:
        """Whether the copy held is as new as the newest notice heard from a
        trusted voter (False until one is heard): what a node that chooses
        by the ledger, as auto-join does, waits for. A node that started in
        a fraction of a second otherwise chose on the empty ledger it began
        with, and took a span others already held."""
        newest = self._newest()
        return newest is not None and newest[1].index <= self._held()

    def newest_notice(self) -> tuple[bytes, LedgerNotice] | None:
        """The newest notice in a trusted voter's record that is newer than
        the copy held, with whom to pull from."""
        best = self._newest()
        if best is None or best[1].index <= self._held():
            return None
        return best

    def source(self, now: float) -> bytes | None:
        """Whom to pull from at `now`, or None. At once when the newest
        notice names this node (its assignment or quarantine changed); for
        any other newer notice after `LAZY_PULL_S`; with none after
        `REFRESH_S`."""
        since = None if self._last_pull_at is None else now - self._last_pull_at
        newest = self.newest_notice()
        if newest is not None:
            mine = node_id_text(self.node_id)
            held = self._held()
            urgent = any(node == mine and index > held for node, index in newest[1].changed)
            if urgent or since is None or since >= LAZY_PULL_S:
                return newest[0]
            return None
        if since is not None and since < REFRESH_S:
            return None
        return next((n for n in self.trusted if self._api_of(n)), None)

    async def run(self) -> None:
        """Until cancelled: pull whenever a trusted notice is newer."""
        while True:
            await trio.sleep(POLL_S)
            if self._in_configuration():
                continue  # Raft brings this node the ledger
            source = self.source(trio.current_time())
            if source is None:
                continue
            self.note_pull(trio.current_time())
            if await self.pull(source):
                self._backoff = MIN_PULL_INTERVAL_S
                await trio.sleep(MIN_PULL_INTERVAL_S)
            else:
                await trio.sleep(self._backoff)
                self._backoff = min(MAX_BACKOFF_S, self._backoff * 2)

    def note_pull(self, now: float) -> None:
        """A pull starts at `now` (the lazy and refresh periods count from it)."""
        self._last_pull_at = now

    async def pull(self, source: bytes) -> bool:
        """Fetch, check and install `source`'s ledger; False if refused or failed."""
        api = self._api_of(source)
        if api is None:
            return self._refuse("no_api", f"{node_id_text(source)[:12]} advertises no API")
        try:
            async with httpx.AsyncClient(timeout=PULL_TIMEOUT_S) as client:
                response = await client.get(api + LEDGER_PATH)
        except httpx.HTTPError as exc:
            return self._refuse("unreachable", f"{api}: {exc}")
        body = response.content
        if response.status_code != 200 or len(body) > MAX_LEDGER_BYTES:
            return self._refuse("bad_answer", f"{api}: HTTP {response.status_code}")
        self.pulls += 1
        try:
            claim = verify_pull(source, response.headers, body, trusted=self.trusted)
            if claim.index < self._held():
                raise ClaimRefused("the claim is older than the copy held")
            ledger = PlacementLedger.restore(body)
            if ledger.applied_index != claim.index:
                raise ClaimRefused("the ledger's index is not the claimed one")
        except (ClaimRefused, LedgerError) as exc:
            return self._refuse("refused", f"{node_id_text(source)[:12]}: {exc}")
        self._install(ledger)
        if claim.voters:
            self.voters = claim.voters
        self.last_error = None
        return True

    def _refuse(self, reason: str, detail: str) -> bool:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        if detail != self.last_error:
            log.warning("ledger pull: %s", detail)
        self.last_error = detail
        return False

    def status(self) -> dict[str, Any]:
        """The "ledger_follower" part of the status document."""
        return {
            "following": not self._in_configuration(),
            "trusted": [node_id_text(n) for n in self.trusted],
            "pulls": self.pulls,
            "refused": dict(sorted(self.refused.items())),
            "last_error": self.last_error,
        }
