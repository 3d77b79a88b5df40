"""Liars and spot checks in a placement simulation: where an answer's first
lie falls, what each check concludes, the leader's verdict, and what the
liars cost in the metrics."""

from __future__ import annotations

import random

import pytest

from consensus.commands import Verdict, decode_command
from consensus.ledger import PlacementLedger
from consensus.log import EntryKind
from consensus.placement import ModelFacts
from mesh.records import Assignment
from mesh.routes import Route, RouteHop
from simulations.placement_invariants import Invariants
from simulations.placement_membership import Membership
from simulations.placement_routing import ENTRIES, Routing
from simulations.placement_spot_checks import (
    DISTRUST_S,
    REPLAY_S,
    STEPS_PER_REQUEST,
    SpotChecks,
    replicated,
)
from simulations.placement_trace import Trace
from simulations.placement_workers import GB, Fleet, Lies, WorkerSpec
from simulations.raft_cluster import RaftCluster

MODELS = {"y": ModelFacts(32, GB // 2)}
SHARD = Assignment("y", (0, 32), "bf16", "managed", True, 1)


class Setup:
    """One voter that leads, workers serving all of y, entries checking
    every answer (`verify_fraction` 1 unless told)."""

    def __init__(self, *specs: WorkerSpec, verify_fraction: float = 1.0, voters: int = 1) -> None:
        self.raft = RaftCluster(voters, 1)
        self.committed: list[object] = []
        self.raft.on_commit = lambda _voter, entry: self.committed.append(
            decode_command(entry.data) if entry.kind == EntryKind.COMMAND else None
        )
        self.loop = self.raft.loop
        self.trace = Trace(self.loop, keep=True)
        self.fleet = Fleet(specs, MODELS, self.trace)
        membership = Membership(1, self.fleet, voters, ENTRIES, self.loop)
        self.ledger = PlacementLedger()
        quarantined = lambda: self.ledger.quarantined(self.loop.now)  # noqa: E731
        self.routing = Routing(1, self.fleet, membership, MODELS, self.loop, quarantined)
        self.invariants = Invariants(self.loop)
        self.checks = SpotChecks(
            self.raft, self.fleet, self.routing, self.invariants, self.trace,
            rng=random.Random(7), verify_fraction=verify_fraction,
            ledger=lambda: self.ledger, swim=False,
        )  # fmt: skip
        for worker in self.fleet.workers:
            worker.serving, worker.verdict, worker.ready_at = SHARD, "admitted", 0.0
        self.raft.run_while(lambda: self.raft.leader() is None, timeout=10.0)

    def route_through(self, worker: int) -> Route:
        """A route of the first entry through `worker` alone."""
        node = self.fleet.workers[worker].node
        others = frozenset(w.node for w in self.fleet.workers if w.node != node)
        entry = self.routing.entries[0]
        inputs = entry.inputs(self.loop.now)
        route = self.routing.route("y", type(inputs)(entry.node, entry.latency_s, avoid=others))
        assert route is not None and route.node_ids == (node,)
        return route

    def serve(self, worker: int) -> Route:
        route = self.route_through(worker)
        self.checks.serve("y", self.routing.entries[0], route)
        return route


def liar(rate: float = 1.0, from_s: float = 0.0) -> WorkerSpec:
    return WorkerSpec(24, ("y",), lies=Lies(rate, from_s))


HONEST = WorkerSpec(24, ("y",))


def test_replicated_means_another_node_serves_exactly_the_span() -> None:
    hop = RouteHop(b"a" * 32, (0, 16))
    nodes = [RouteHop(b"a" * 32, (0, 16)), RouteHop(b"b" * 32, (0, 32))]
    variant = type("Variant", (), {"nodes": nodes})()  # a ModelCoverage's nodes
    assert not replicated(variant, hop)  # type: ignore[arg-type]
    nodes.append(RouteHop(b"c" * 32, (0, 16)))
    assert replicated(variant, hop)  # type: ignore[arg-type]


def test_an_honest_answer_is_correct_and_its_check_clean() -> None:
    setup = Setup(HONEST, HONEST)
    setup.serve(0)
    assert setup.checks.answers == [(setup.loop.now, True)]
    setup.raft.run_for(STEPS_PER_REQUEST * 1.0 + REPLAY_S + 1)
    assert setup.checks.checks == {"checked": 1, "clean": 1}


def test_a_lie_on_a_replicated_span_is_caught_distrusted_and_judged_guilty() -> None:
    setup = Setup(liar(), HONEST)
    started = setup.loop.now
    route = setup.serve(0)
    stats = setup.checks.liars[0]
    assert setup.checks.answers == [(started, False)]
    assert stats.wrong == 1 and stats.first_lie_at == started  # the first step lied
    assert stats.routed == [(started, started + STEPS_PER_REQUEST * route.cost_s)]
    done = started + STEPS_PER_REQUEST * route.cost_s
    setup.raft.run_until(done + REPLAY_S + 0.001)
    assert setup.checks.checks["caught"] == 1
    entry = setup.routing.entries[0]
    assert entry.distrusted[setup.fleet.workers[0].node] == pytest.approx(
        done + REPLAY_S + DISTRUST_S
    )
    assert setup.trace.lines is not None and setup.trace.lines[-1].endswith("caught 0")
    setup.raft.run_for(REPLAY_S + 1.0)
    (verdict,) = [c for c in setup.committed if isinstance(c, Verdict)]
    assert verdict.guilty and verdict.accused == setup.fleet.workers[0].node
    assert verdict.reporter == entry.node
    assert "not_judged" not in setup.checks.checks


def test_a_lie_nobody_else_can_replay_is_unchecked() -> None:
    setup = Setup(liar())
    setup.serve(0)
    setup.raft.run_for(STEPS_PER_REQUEST * 1.0 + REPLAY_S + 1)
    assert setup.checks.checks == {"checked": 1, "unchecked": 1}
    assert setup.trace.lines is not None and setup.trace.lines[-1].endswith("unchecked lie of 0")


def test_a_chain_gone_before_the_replay_is_counted_so() -> None:
    setup = Setup(liar(), HONEST)
    setup.serve(0)
    setup.fleet.crash(0, setup.loop.now)
    setup.raft.run_for(STEPS_PER_REQUEST * 1.0 + REPLAY_S + 1)
    assert setup.checks.checks == {"checked": 1, "chain_gone": 1}


def test_a_caught_lie_with_no_leader_to_judge_it_is_not_judged() -> None:
    setup = Setup(liar(), HONEST, voters=3)
    route = setup.serve(0)
    for voter in range(3):
        setup.raft.crash(voter)
    setup.raft.run_for(STEPS_PER_REQUEST * route.cost_s + 2 * REPLAY_S + 1)
    assert setup.checks.checks == {"checked": 1, "caught": 1, "not_judged": 1}


def test_no_lie_before_from_s_and_the_first_one_at_the_first_step_after() -> None:
    setup = Setup(liar(from_s=1_000.0), HONEST)
    route = setup.serve(0)  # the whole answer runs long before 1,000 s
    assert setup.loop.now + STEPS_PER_REQUEST * route.cost_s < 1_000.0
    assert setup.checks.answers[-1][1] is True and setup.checks.liars[0].wrong == 0
    setup.raft.run_until(1_000.0 - route.cost_s / 2)
    setup.serve(0)
    first = setup.checks.liars[0].first_lie_at
    assert first is not None and 1_000.0 <= first < 1_000.0 + route.cost_s


def test_unpicked_answers_are_not_checked() -> None:
    setup = Setup(liar(), HONEST, verify_fraction=0.0)
    setup.serve(0)
    setup.raft.run_for(STEPS_PER_REQUEST * 1.0 + REPLAY_S + 1)
    assert setup.checks.checks == {}


def test_the_summary_counts_wrong_answers_false_quarantines_and_each_liar() -> None:
    setup = Setup(liar(), HONEST, HONEST)
    setup.serve(0)
    setup.serve(1)
    caught_at = setup.loop.now
    verdict = Verdict(setup.fleet.workers[0].node, b"e" * 32, b"x" * 32, guilty=True, at=0.0)
    setup.checks.convicted(verdict)
    setup.checks.convicted(verdict)  # the first verdict counts
    setup.checks.convicted(Verdict(setup.fleet.workers[2].node, b"e" * 32, b"x" * 32,
                                   guilty=True, at=0.0))  # fmt: skip
    summary = setup.checks.summary()
    assert summary["served_correct_fraction"] == 0.5 and summary["wrong_answers"] == 1
    assert summary["checked"] == 2 and summary["false_quarantines"] == 1
    (report,) = summary["liars"]  # type: ignore[misc]
    assert report == {
        "worker": 0,
        "rate": 1.0,
        "from_s": 0.0,
        "first_lie_at": caught_at,
        "quarantined_at": caught_at,
        "detection_s": 0.0,
        "requests_until_quarantine": 0,  # it started at the quarantine's instant
        "wrong_answers": 1,
    }
