"""Liars and spot checks in a placement simulation (`runtime.node.spot_check`).

A served request takes `STEPS_PER_REQUEST` decode steps and is correct
unless some hop lies on some step. The entry checks a `verify_fraction` of
finished requests by a replay; the first lie names the accused, and when
another node serves the accused's exact span the entry distrusts it at
once and the leader, after one more replay, commits a guilty verdict
through Raft, which quarantines it. `SpotChecks` runs that and reports
what liars cost (docs/simulation.md, "Liars and spot checks"; the model's
limits: docs/design/placement-simulation.md).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from consensus.commands import Verdict, encode_command
from consensus.ledger import PlacementLedger
from mesh.coverage import ModelCoverage
from mesh.routes import Route, RouteHop
from simulations.placement_invariants import Invariants
from simulations.placement_metrics import since
from simulations.placement_routing import Entry, Routing
from simulations.placement_trace import Trace
from simulations.placement_workers import Fleet
from simulations.raft_cluster import RaftCluster

__all__ = [
    "CHECK_OUTCOMES",
    "DISTRUST_S",
    "REPLAY_S",
    "STEPS_PER_REQUEST",
    "Check",
    "LiarStats",
    "SpotChecks",
    "replicated",
]

STEPS_PER_REQUEST: Final = 32
"""Decode steps of one simulated answer. Shorter than a typical chat answer
(~200 tokens: `consensus.settings`); it sets how likely a hop lying on a
fraction r of steps spoils an answer, 1 - (1 - r)**32: 27% at r = 1%."""
REPLAY_S: Final = 1.0
"""One replay of a finished request: a prefill of its history (prompt and
`STEPS_PER_REQUEST` tokens) through a chain of volunteer nodes, WAN hops
included. A prefill costs a few percent of the decode steps it replays
(`consensus.settings.PlacementSettings.verify_fraction`), so a second
covers it and the round trips. The entry's check takes one, the leader's
judgement one more: a lie is quarantined about two replays and a Raft
commit after the answer it spoiled ends."""
DISTRUST_S: Final = 600.0
"""How long an entry avoids a node its own check caught, before any verdict
(runtime.node.spot_check.DISTRUST_S)."""
CHECK_OUTCOMES: Final = ("checked", "clean", "caught", "unchecked", "chain_gone", "not_judged")
"""What became of the spot checks, counted in the metrics: `checked`, the
finished requests an entry picked (a `verify_fraction` of those served);
of these, `clean` (no hop lied), `caught` (a lie, replayed on another node
of the liar's span: evidence for the leader), `unchecked` (a lie, but no
other node serves the liar's span, so no independent replay), `chain_gone`
(a hop left coverage before the replay, as a quarantined liar does: the
runtime finds no variant to replay in); and of the caught, `not_judged`
(no leader, or none could propose, or no other node left to recompute on)."""


@dataclass
class LiarStats:
    """What one lying worker did: its first lie, the requests routed
    through it, and the answers it spoiled."""

    first_lie_at: float | None = None
    routed: list[tuple[float, float]] = field(default_factory=list)
    """When each request routed through it started and ended."""
    wrong: int = 0


@dataclass(frozen=True)
class Check:
    """A finished request an entry replays: which, over what route, and
    the hop of its first lie (None: a correct answer)."""

    number: int
    model: str
    entry: Entry
    route: Route
    lie: int | None


def replicated(variant: ModelCoverage, hop: RouteHop) -> bool:
    """Another node of `variant` serves exactly `hop`'s span: a replay of the
    span there is independent of the hop."""
    return any(n.layers == hop.layers and n.node_id != hop.node_id for n in variant.nodes)


class SpotChecks:
    """Served answers, the entries' checks of them, and the leader's verdicts."""

    def __init__(
        self,
        raft: RaftCluster,
        fleet: Fleet,
        routing: Routing,
        invariants: Invariants,
        trace: Trace,
        *,
        rng: random.Random,
        verify_fraction: float,
        ledger: Callable[[], PlacementLedger],
        swim: bool,
    ) -> None:
        self._raft, self._loop = raft, raft.loop
        self._fleet, self._routing, self._invariants, self._trace = (
            fleet,
            routing,
            invariants,
            trace,
        )
        self._rng, self._verify_fraction = rng, verify_fraction
        self._ledger, self._swim = ledger, swim
        self.answers: list[tuple[float, bool]] = []
        """Every served request: (time, correct)."""
        self.checks: Counter[str] = Counter()
        """Spot checks by outcome (`CHECK_OUTCOMES`)."""
        self.liars = {
            i: LiarStats() for i, w in enumerate(fleet.workers) if w.spec.lies is not None
        }
        self.quarantined_at: dict[int, float] = {}
        """Worker -> when the first guilty verdict against it committed."""

    def serve(self, model: str, entry: Entry, route: Route) -> None:
        """Run the answer over `route`: note whether a hop lied, and have the
        entry check it with the policy's `verify_fraction`."""
        now = self._loop.now
        self._invariants.routed(route.node_ids, self._ledger().quarantined(now))
        lie = self._first_lie(route)
        done = now + STEPS_PER_REQUEST * route.cost_s
        self.answers.append((now, lie is None))
        for node in route.node_ids:
            liar = self.liars.get(self._fleet.index[node])
            if liar is not None:
                liar.routed.append((now, done))
        if lie is not None:
            hop, at = lie
            liar = self.liars[self._fleet.index[route.hops[hop].node_id]]
            liar.wrong += 1
            if liar.first_lie_at is None or at < liar.first_lie_at:
                liar.first_lie_at = at
        if self._rng.random() < self._verify_fraction:
            self.checks["checked"] += 1
            check = Check(len(self.answers), model, entry, route, None if lie is None else lie[0])
            self._loop.call_at(done + REPLAY_S, self._spot_check, check)

    def _first_lie(self, route: Route) -> tuple[int, float] | None:
        """The first lie in the answer (hop index, time): the earliest step,
        then the earliest hop, as the first diverging commitment names it.
        Step k runs k estimated step times (`route.cost_s`) after the start."""
        liars = []
        for hop, node in enumerate(route.node_ids):
            lies = self._fleet.workers[self._fleet.index[node]].spec.lies
            if lies is not None:
                liars.append((hop, lies))
        if not liars:
            return None
        for step in range(STEPS_PER_REQUEST):
            at = self._loop.now + step * route.cost_s
            for hop, lies in liars:
                if at >= lies.from_s and self._rng.random() < lies.rate:
                    return hop, at
        return None

    def _spot_check(self, check: Check) -> None:
        """The entry's replay has run: act on the first lie, when another node
        of the liar's span replayed it (see `CHECK_OUTCOMES`)."""
        variant = self._routing.coverage(check.entry.member).best(check.model)
        serving = set() if variant is None else {n.node_id for n in variant.nodes}
        if variant is None or not serving.issuperset(check.route.node_ids):
            self.checks["chain_gone"] += 1
            return
        if check.lie is None:
            self.checks["clean"] += 1
            return
        accused = check.route.hops[check.lie]
        worker = self._fleet.index[accused.node_id]
        if not replicated(variant, accused):
            self.checks["unchecked"] += 1
            self._trace.note(f"unchecked lie of {worker}")
            return
        self.checks["caught"] += 1
        check.entry.distrusted[accused.node_id] = self._loop.now + DISTRUST_S
        self._trace.note(f"caught {worker}")
        self._loop.call_later(REPLAY_S, self._judge, check)

    def _judge(self, check: Check) -> None:
        """The leader's recomputation has run, on another node of the
        accused's span: it finds the accused's step wrong (the check did),
        and the leader proposes a guilty verdict."""
        assert check.lie is not None
        accused = check.route.hops[check.lie]
        leader = self._raft.leader()
        observer = None if not self._swim or leader is None else leader
        variant = self._routing.coverage(observer).best(check.model)
        if leader is None or variant is None or not replicated(variant, accused):
            self.checks["not_judged"] += 1
            return
        evidence = hashlib.sha256(f"evidence for answer {check.number}".encode()).digest()
        now = self._loop.now
        verdict = Verdict(accused.node_id, check.entry.node, evidence, guilty=True, at=now)
        if self._raft.propose(encode_command(verdict), on=leader) is None:
            self.checks["not_judged"] += 1

    def convicted(self, verdict: Verdict) -> None:
        """A guilty verdict committed: its accused is quarantined from now."""
        self.quarantined_at.setdefault(self._fleet.index[verdict.accused], self._loop.now)

    def summary(self) -> dict[str, object]:
        """What the spot checks caught and what the clients got (see
        `CHECK_OUTCOMES` and docs/simulation.md, "Liars and spot checks")."""
        wrong = sum(not correct for _, correct in self.answers)
        served = len(self.answers)
        workers = self._fleet.workers
        honest = [i for i in self.quarantined_at if workers[i].spec.lies is None]
        return {
            "served_correct_fraction": (served - wrong) / served if served else None,
            "wrong_answers": wrong,
            **{outcome: self.checks[outcome] for outcome in CHECK_OUTCOMES},
            "false_quarantines": len(honest),
            "liars": [self._liar_report(i, stats) for i, stats in sorted(self.liars.items())],
        }

    def _liar_report(self, index: int, stats: LiarStats) -> dict[str, object]:
        """One liar's story. `detection_s` runs from its first lie to the
        commit of its quarantine; `requests_until_quarantine` counts the
        requests routed through it that were still running at its first lie
        or started after it, before its quarantine (before the run's end,
        when it was never quarantined). None: it never lied."""
        lies = self._fleet.workers[index].spec.lies
        assert lies is not None
        until = self.quarantined_at.get(index)
        first = stats.first_lie_at
        served = None
        if first is not None:
            before = math.inf if until is None else until
            served = sum(1 for start, end in stats.routed if end >= first and start < before)
        return {
            "worker": index,
            "rate": lies.rate,
            "from_s": lies.from_s,
            "first_lie_at": stats.first_lie_at,
            "quarantined_at": until,
            "detection_s": since(stats.first_lie_at, until),
            "requests_until_quarantine": served,
            "wrong_answers": stats.wrong,
        }
