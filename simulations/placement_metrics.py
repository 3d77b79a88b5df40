"""Availability in a placement simulation, recorded as transitions.

Two records, each a list of changes rather than samples: `leadership`, the
voter that could commit (`committing_leader`) and the highest term, noted
whenever a voter's role or term changes, a voter crashes or restarts, or a
voter partition starts or heals; and `chains`, whether each model has a
complete chain (`servable`), noted whenever coverage's inputs change.
`Availability` turns them into the exact `leaderless_s`, `leader_changes`
and `incomplete_chain_s` of the metrics. Observing adds no traced event.
docs/simulation.md, "Placement availability", defines each figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from consensus.ledger import ApplyResult, PlacementLedger, changed_node
from mesh.coverage import CoverageMap
from simulations.raft_cluster import RaftCluster

__all__ = ["Availability", "since", "spans"]

State = TypeVar("State")


def spans(changes: Sequence[tuple[float, State]], end: float) -> list[tuple[float, float, State]]:
    """Changes (time, state) in time order as the spans each state held
    until the next change or `end`. A state that held for no time (two
    changes at one instant) is left out, and so neighbours that agree merge."""
    held: list[tuple[float, float, State]] = []
    for number, (start, state) in enumerate(changes):
        until = changes[number + 1][0] if number + 1 < len(changes) else end
        if until <= start:
            continue
        if held and held[-1][2] == state:
            start = held.pop()[0]
        held.append((start, until, state))
    return held


def since(start: float | None, end: float | None) -> float | None:
    """Seconds from `start` to `end`, to the microsecond; None if either is."""
    return None if start is None or end is None else round(end - start, 6)


class Availability:
    """Who could commit, and which models could be served, over time."""

    def __init__(
        self,
        raft: RaftCluster,
        voters: int,
        models: Iterable[str],
        coverage: Callable[[], CoverageMap],
        servable: Callable[[str], bool],
    ) -> None:
        self._raft, self._loop = raft, raft.loop
        self._voters = voters
        self._models = sorted(models)
        self._coverage, self._servable = coverage, servable
        self.leadership: list[tuple[float, int | None, int]] = [(0.0, None, 0)]
        """Every change of the committing leader or of the highest term:
        (time, voter or None, term); see `committing_leader`."""
        self.chains: list[tuple[float, str, bool]] = []
        """Every change of a model's complete chain: (time, model, complete)."""
        self._complete: dict[str, bool] = {}
        self._chains_seen: CoverageMap | None = None

    def committing_leader(self) -> int | None:
        """The voter that could commit now: the leader of the highest term
        among live voters (`RaftCluster.leader`) that reaches a quorum of live
        voters, itself included, both ways over the network as it stands. A
        leader cut off keeps its role until CheckQuorum steps it down, and
        pre-vote keeps the others' term until one can win, so role and term
        alone would hide the first election timeout of an outage."""
        leader = self._raft.leader()
        if leader is None:
            return None
        network, voters = self._raft.network, self._voters
        reached = sum(
            1
            for v in range(voters)
            if self._raft.is_up(v)
            and (v == leader or (network.can_reach(leader, v) and network.can_reach(v, leader)))
        )
        return leader if reached > voters // 2 else None

    def observe_leader(self) -> None:
        """Note a change of the committing leader or the highest term."""
        state = (self.committing_leader(), self._top_term())
        if state != self.leadership[-1][1:]:
            self.leadership.append((self._loop.now, *state))

    def _top_term(self) -> int:
        live = [i for i in range(self._voters) if self._raft.is_up(i)]
        return max((self._raft.term(i) for i in live), default=0)

    def observe_leader_at(self, start: float, heal: float) -> None:
        """Observe leadership when a voter partition starts and heals: the
        network switches at those instants (scheduled before these, so these
        run after it)."""
        self._loop.call_at(start, self.observe_leader)
        if math.isfinite(heal):
            self._loop.call_at(heal, self.observe_leader)

    def observe_chains(self) -> None:
        """Note each model whose complete chain came or went; nothing to do
        while coverage is the one last seen."""
        coverage = self._coverage()
        if coverage is self._chains_seen:
            return
        self._chains_seen = coverage
        for model in self._models:
            complete = self._servable(model)
            if self._complete.get(model) != complete:
                self._complete[model] = complete
                self.chains.append((self._loop.now, model, complete))

    def standing_changed(self, ledger: PlacementLedger, result: ApplyResult) -> None:
        """A verdict committed in `ledger`: a quarantine may have started, and
        it ends at a time no event marks, so observe chains then too."""
        self.observe_chains()
        node = changed_node(result)
        standing = None if node is None else ledger.quarantined(self._loop.now).get(node)
        if standing is not None and standing.until is not None:
            self._loop.call_at(standing.until, self.observe_chains)

    def leader_spans(self) -> list[tuple[float, float, int | None, int]]:
        """`leadership` as spans up to now: (start, end, voter or None, term)."""
        changes = [(at, (voter, term)) for at, voter, term in self.leadership]
        return [(start, end, *state) for start, end, state in spans(changes, self._loop.now)]

    def chain_spans(self, model: str) -> list[tuple[float, float, bool]]:
        """`chains` of `model` as spans up to now: (start, end, complete)."""
        return spans([(at, ok) for at, name, ok in self.chains if name == model], self._loop.now)

    def leadership_summary(self) -> dict[str, object]:
        """`leaderless_s`: seconds with no `committing_leader`, from the first
        one on (the bootstrap election is no outage; a run that never had
        one was leaderless throughout). `leader_changes`: leaders that could
        commit after the first, one per (voter, term), so a leader that loses
        and regains its quorum within its term is no change."""
        held = self.leader_spans()
        first = next((start for start, _, voter, _ in held if voter is not None), None)
        begin = 0.0 if first is None else first
        leaderless = sum((end - start for start, end, voter, _ in held
                          if voter is None and start >= begin), 0.0)  # fmt: skip
        leaders = {(voter, term) for _, _, voter, term in held if voter is not None}
        return {
            "first_leader_at": first,
            "leaderless_s": round(leaderless, 6),
            "leader_changes": max(0, len(leaders) - 1),
        }

    def incomplete_chain_s(self, model: str, first_request_at: float | None) -> float | None:
        """Seconds from `model`'s first request (before it, nobody is kept
        waiting) to now without a complete chain; None: never requested."""
        if first_request_at is None:
            return None
        held = self.chain_spans(model)
        return round(sum((end - max(start, first_request_at) for start, end, ok in held
                          if not ok and end > first_request_at), 0.0), 6)  # fmt: skip
