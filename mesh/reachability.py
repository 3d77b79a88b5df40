"""Reachability: can peers dial this node back at the address it advertises?

Modelled on libp2p's AutoNAT. A node asks a few distinct members
(`PROBERS`) to dial it back at the control address its own signed record
advertises; each answer is `ok` (a dial-back carrying our nonce arrived) or
`failed` (the prober took the request and nothing came back within
`ANSWER_WAIT_S`). The verdict is `direct` when enough answers agree that
it is reachable, `unreachable` (behind NAT or a firewall) when enough agree
that it is not, and `unknown` until then. Answers expire, so the check
repeats every `RECHECK_S`, and at once when the address changes.

A sans-IO core: `now` and a `random.Random` come in, requests go out as
`Ask`s from `take_asks`; the driver (`runtime/node/reachability_driver.py`)
does the dialling. State is bounded: at most `PROBERS` requests in flight
and `MAX_ANSWERS` answers kept.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal

Verdict = Literal["direct", "unreachable", "unknown"]
Answer = Literal["ok", "failed"]

PROBERS: Final = 3
"""Members asked per round, as AutoNAT asks a few servers: one prober could
lie or sit behind a firewall of its own; three distinct ones rarely all do."""
AGREEING: Final = 2
"""Answers that must agree for a verdict (fewer when the swarm has fewer
other members: a two-node swarm's one peer decides)."""
ANSWER_WAIT_S: Final = 5.0
"""How long a prober that took our request may take to dial back before
its silence counts as `failed`: a dial-back is a TCP connect and a CURVE
handshake (two round trips) with a short timeout on the prober's side
(`DIAL_TIMEOUT_S`), far under this even at 300 ms RTT."""
DIAL_TIMEOUT_S: Final = 2.0
"""The prober's (and the requester's) connect-and-handshake timeout: a
reachable address answers a SYN in one RTT; a NAT drops it silently."""
RECHECK_S: Final = 60.0
"""A verdict is re-checked this often (a router's port mapping or a
firewall can change under a running node), each answer kept twice as
long so the verdict does not flicker to `unknown` between rounds."""
ANSWER_TTL_S: Final = 2 * RECHECK_S
RETRY_S: Final = 5.0
"""While no verdict stands, a new round may start this soon (a prober that
could not be reached is no evidence, and a fresh member may answer)."""
MAX_ANSWERS: Final = 2 * PROBERS
"""Answers kept, newest first: two rounds' worth, bounding the state."""
MIN_ASK_INTERVAL_S: Final = 10.0
"""One prober is asked at most this often by one node: each request costs
it a fresh connection (the prober's `RequestLimit` enforces a bound)."""


@dataclass(frozen=True, slots=True)
class Ask:
    """Ask `prober` to dial us back; its dial-back must carry `nonce`."""

    prober: bytes
    nonce: bytes


@dataclass(slots=True)
class _Pending:
    nonce: bytes
    asked_at: float
    taken: bool = False
    """The prober accepted the request (the driver's connection to it
    completed): only then does its silence mean `failed`."""


class Reachability:
    """One node's reachability checks (see the module docstring)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self.address: str | None = None
        self._pending: dict[bytes, _Pending] = {}
        self._answers: OrderedDict[bytes, tuple[Answer, float]] = OrderedDict()
        self._asked_at: OrderedDict[bytes, float] = OrderedDict()
        self._round_at: float | None = None
        self._available = 0
        self._asks: list[Ask] = []

    # --- what the driver feeds in ----------------------------------------------

    def set_address(self, address: str) -> None:
        """Our advertised control address; a change forgets every answer
        (they were about the old one) and starts a new round at once."""
        if address == self.address:
            return
        self.address = address
        self._pending.clear()
        self._answers.clear()
        self._round_at = None  # the next tick starts a round

    def tick(self, now: float, candidates: Iterable[bytes]) -> None:
        """Expire silent requests and old answers; start a round when due,
        asking distinct `candidates` (alive members with a record; never
        ourselves) not asked within `MIN_ASK_INTERVAL_S`."""
        for prober, pending in list(self._pending.items()):
            if now - pending.asked_at >= ANSWER_WAIT_S:
                del self._pending[prober]
                if pending.taken:
                    self._record(prober, "failed", now)
        for prober, (_, at) in list(self._answers.items()):
            if now - at >= ANSWER_TTL_S:
                del self._answers[prober]
        if self.address is None or not self._due(now):
            return
        pool = sorted(set(candidates))
        fresh = [p for p in pool if p not in self._pending and self._may_ask(p, now)]
        wanted = PROBERS - len(self._pending)
        if not fresh or wanted <= 0:
            return
        # The swarm's size as this round found it: members joining between
        # rounds do not turn a verdict back into `unknown` (they are asked
        # in the next round).
        self._available = len(pool)
        self._round_at = now
        for prober in self._rng.sample(fresh, min(wanted, len(fresh))):
            ask = Ask(prober, self._rng.randbytes(16))
            self._pending[prober] = _Pending(ask.nonce, now)
            self._asked_at[prober] = now
            self._asked_at.move_to_end(prober)
            self._asks.append(ask)
        while len(self._asked_at) > 4 * MAX_ANSWERS:
            self._asked_at.popitem(last=False)

    def taken(self, prober: bytes) -> None:
        """Our request reached `prober` (the connection completed)."""
        pending = self._pending.get(prober)
        if pending is not None:
            pending.taken = True

    def unreachable_prober(self, prober: bytes) -> None:
        """We could not reach `prober` to ask: no evidence either way."""
        self._pending.pop(prober, None)

    def dialed_back(self, prober: bytes, nonce: bytes, now: float) -> bool:
        """A dial-back from `prober` arrived on our advertised address.
        Counts only when it carries the nonce we gave `prober`."""
        pending = self._pending.get(prober)
        if pending is None or pending.nonce != nonce:
            return False
        del self._pending[prober]
        self._record(prober, "ok", now)
        return True

    # --- what the driver reads ---------------------------------------------------

    def take_asks(self) -> list[Ask]:
        asks, self._asks = self._asks, []
        return asks

    def verdict(self) -> Verdict:
        """`direct` or `unreachable` once `AGREEING` answers (fewer in a
        smaller swarm) say so and outnumber the others; else `unknown`."""
        oks = sum(1 for answer, _ in self._answers.values() if answer == "ok")
        fails = len(self._answers) - oks
        needed = max(1, min(AGREEING, self._available))
        if oks >= needed and oks > fails:
            return "direct"
        if fails >= needed and fails > oks:
            return "unreachable"
        return "unknown"

    def answers(self) -> dict[str, int]:
        """How many current answers say each thing (for the status page)."""
        oks = sum(1 for answer, _ in self._answers.values() if answer == "ok")
        return {"ok": oks, "failed": len(self._answers) - oks, "pending": len(self._pending)}

    # --- inside ------------------------------------------------------------------

    def _record(self, prober: bytes, answer: Answer, now: float) -> None:
        self._answers.pop(prober, None)
        self._answers[prober] = (answer, now)
        while len(self._answers) > MAX_ANSWERS:
            self._answers.popitem(last=False)

    def _due(self, now: float) -> bool:
        if self._round_at is None:
            return True
        wait = RETRY_S if self.verdict() == "unknown" else RECHECK_S
        return now - self._round_at >= wait

    def _may_ask(self, prober: bytes, now: float) -> bool:
        at = self._asked_at.get(prober)
        return at is None or now - at >= MIN_ASK_INTERVAL_S


SERVE_INTERVAL_S: Final = MIN_ASK_INTERVAL_S / 2
"""A prober serves one requester at most this often: half the requester's
own spacing, so an honest requester whose two requests met different
delays on the way is never refused."""


class RequestLimit:
    """The prober's side: at most one dial-back per requester every
    `SERVE_INTERVAL_S`, and at most `max_requesters` remembered (the
    oldest forgotten: a flood of new ids only evicts)."""

    def __init__(self, max_requesters: int = 1024) -> None:
        self._served: OrderedDict[bytes, float] = OrderedDict()
        self._max = max_requesters

    def allow(self, requester: bytes, now: float) -> bool:
        at = self._served.get(requester)
        if at is not None and now - at < SERVE_INTERVAL_S:
            return False
        self._served.pop(requester, None)
        self._served[requester] = now
        while len(self._served) > self._max:
            self._served.popitem(last=False)
        return True
