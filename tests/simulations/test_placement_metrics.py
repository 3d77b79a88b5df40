"""Availability in a placement simulation: changes turned into spans, who
could commit, and which models had a complete chain, observed as they change."""

from __future__ import annotations

import pytest

from mesh.coverage import CoverageMap
from simulations.placement_metrics import Availability, since, spans
from simulations.raft_cluster import RaftCluster


def test_spans_run_to_the_next_change_drop_instants_and_merge_neighbours() -> None:
    changes = [(0.0, "a"), (1.0, "b"), (1.0, "c"), (3.0, "c"), (4.0, "a")]
    assert spans(changes, end=6.0) == [(0.0, 1.0, "a"), (1.0, 4.0, "c"), (4.0, 6.0, "a")]
    assert spans([], end=5.0) == []
    assert spans([(2.0, True)], end=2.0) == []  # held for no time


def test_since_is_rounded_and_none_when_either_end_is_missing() -> None:
    assert since(1.0, 3.5000000001) == 2.5
    assert since(None, 3.0) is None and since(1.0, None) is None


class Chains:
    """A stand-in for routing: a coverage map object per state, and which
    models are servable in it."""

    def __init__(self) -> None:
        self.map = CoverageMap({}, {})
        self.servable: set[str] = set()
        self.asked = 0

    def coverage(self) -> CoverageMap:
        return self.map

    def is_servable(self, model: str) -> bool:
        self.asked += 1
        return model in self.servable


def availability(voters: int = 3) -> tuple[Availability, RaftCluster, Chains]:
    raft = RaftCluster(voters, 1)
    chains = Chains()
    return Availability(raft, voters, ["y", "x"], chains.coverage, chains.is_servable), raft, chains


def test_chains_are_noted_only_when_coverage_changes_and_only_what_changed() -> None:
    seen, raft, chains = availability()
    seen.observe_chains()
    assert seen.chains == [(0.0, "x", False), (0.0, "y", False)]
    chains.servable.add("y")
    seen.observe_chains()  # the same coverage map: nothing recomputed
    assert chains.asked == 2 and len(seen.chains) == 2
    chains.map = CoverageMap({}, {})
    raft.run_until(5.0)
    seen.observe_chains()
    assert seen.chains[2:] == [(5.0, "y", True)]
    chains.servable.clear()
    chains.map = CoverageMap({}, {})
    raft.run_until(8.0)
    seen.observe_chains()
    assert seen.chain_spans("y") == [(0.0, 5.0, False), (5.0, 8.0, True)]
    assert seen.chain_spans("x") == [(0.0, 8.0, False)]


def test_incomplete_chain_time_counts_from_the_first_request() -> None:
    seen, raft, _ = availability()
    seen.chains = [(0.0, "y", False), (10.0, "y", True), (20.0, "y", False)]
    raft.run_until(30.0)
    assert seen.incomplete_chain_s("y", first_request_at=5.0) == pytest.approx(15.0)
    assert seen.incomplete_chain_s("y", first_request_at=None) is None


def test_a_leader_that_reaches_a_quorum_can_commit_and_is_noted_once() -> None:
    seen, raft, _ = availability()
    assert seen.committing_leader() is None
    raft.run_while(lambda: raft.leader() is None, timeout=10.0)
    leader = raft.leader()
    assert leader is not None and seen.committing_leader() == leader
    seen.observe_leader()
    seen.observe_leader()
    assert seen.leadership == [(0.0, None, 0), (raft.now, leader, raft.term(leader))]


def test_a_leader_cut_off_from_the_others_cannot_commit() -> None:
    seen, raft, _ = availability()
    raft.run_while(lambda: raft.leader() is None, timeout=10.0)
    leader = raft.leader()
    assert leader is not None
    others = [v for v in range(3) if v != leader]
    raft.network.schedule_partition([[leader], others], raft.now, raft.now + 100.0)
    raft.run_for(0.001)
    assert raft.leader() == leader  # it keeps its role until CheckQuorum steps it down
    assert seen.committing_leader() is None


def test_leaderless_time_counts_from_the_first_leader_and_changes_per_voter_and_term() -> None:
    seen, raft, _ = availability()
    seen.leadership = [(0.0, None, 0), (1.0, 0, 1), (4.0, None, 1), (4.5, 0, 1), (6.0, None, 1),
                       (7.0, 2, 2)]  # fmt: skip
    raft.run_until(10.0)
    assert seen.leadership_summary() == {
        "first_leader_at": 1.0,
        "leaderless_s": 1.5,
        "leader_changes": 1,  # voter 0 regaining its quorum in term 1 is no change
    }
    assert seen.leader_spans()[0] == (0.0, 1.0, None, 0)


def test_a_run_that_never_had_a_leader_was_leaderless_throughout() -> None:
    seen, raft, _ = availability()
    raft.run_until(3.0)
    assert seen.leadership_summary() == {
        "first_leader_at": None,
        "leaderless_s": 3.0,
        "leader_changes": 0,
    }


def test_a_partition_is_observed_when_it_starts_and_when_it_heals() -> None:
    seen, raft, _ = availability()
    raft.run_while(lambda: raft.leader() is None, timeout=10.0)
    seen.observe_leader()
    start = raft.now + 1.0
    raft.network.schedule_partition([[0], [1], [2]], start, start + 2.0)
    seen.observe_leader_at(start, start + 2.0)
    raft.run_until(start + 0.5)
    assert seen.leadership[-1][:2] == (start, None)  # no quorum anywhere
