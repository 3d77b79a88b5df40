"""The chat-demand workload of a placement simulation: Poisson arrivals,
each request routed and served or not, and demand flushed to the leader."""

from __future__ import annotations

import random

import pytest

from consensus.commands import RecordDemand, decode_command
from consensus.ledger import PlacementLedger
from consensus.log import EntryKind
from consensus.placement import ModelFacts
from mesh.records import Assignment
from simulations.placement_invariants import Invariants
from simulations.placement_membership import Membership
from simulations.placement_routing import ENTRIES, Routing
from simulations.placement_spot_checks import SpotChecks
from simulations.placement_trace import Trace
from simulations.placement_workers import GB, Fleet, WorkerSpec
from simulations.placement_workload import DEMAND_FLUSH_S, ModelStats, Workload
from simulations.raft_cluster import RaftCluster

MODELS = {"y": ModelFacts(32, GB // 2), "x": ModelFacts(32, GB // 2)}
SHARD = Assignment("y", (0, 32), "bf16", "managed", True, 1)


class Setup:
    """One voter, one worker (serving y when told), entries that never check."""

    def __init__(self, seed: int = 1) -> None:
        self.raft = RaftCluster(1, seed)
        self.loop = self.raft.loop
        self.demand: list[RecordDemand] = []
        self.raft.on_commit = lambda _voter, entry: self._committed(entry.kind, entry.data)
        trace = Trace(self.loop)
        self.fleet = Fleet([WorkerSpec(24, ("y",))], MODELS, trace)
        membership = Membership(seed, self.fleet, 1, ENTRIES, self.loop)
        ledger = PlacementLedger()
        self.routing = Routing(
            seed, self.fleet, membership, MODELS, self.loop, lambda: ledger.quarantined(0.0)
        )
        serving = random.Random(seed)
        self.spot_checks = SpotChecks(
            self.raft, self.fleet, self.routing, Invariants(self.loop), trace,
            rng=serving, verify_fraction=0.0, ledger=lambda: ledger, swim=False,
        )  # fmt: skip
        self.workload = Workload(
            self.raft, MODELS, self.routing, self.spot_checks,
            arrivals=random.Random(seed + 1), serving=serving, swim=False,
        )  # fmt: skip

    def _committed(self, kind: EntryKind, data: bytes) -> None:
        if kind == EntryKind.COMMAND:
            command = decode_command(data)
            if isinstance(command, RecordDemand):
                self.demand.append(command)

    def serve_y(self) -> None:
        worker = self.fleet.workers[0]
        worker.serving, worker.verdict, worker.ready_at = SHARD, "admitted", 0.0


def test_a_rate_must_be_positive_and_the_model_known() -> None:
    workload = Setup().workload
    with pytest.raises(ValueError, match="unknown model"):
        workload.schedule("z", 10, 0, 10)
    with pytest.raises(ValueError, match="rate"):
        workload.schedule("y", 0, 0, 10)


def test_arrivals_are_poisson_at_the_rate_within_the_window_and_replay() -> None:
    runs = []
    for _ in range(2):
        setup = Setup()
        setup.workload.schedule("y", 60, start=100.0, stop=1_100.0)
        setup.raft.run_until(1_200.0)
        runs.append(setup.workload.requests)
    times = [at for at, _, _ in runs[0]]
    assert 900 <= len(times) <= 1_100  # 1,000 expected; sd ~32
    assert min(times) > 100.0 and max(times) < 1_100.0
    assert runs[0] == runs[1]


def test_a_request_with_no_route_counts_as_demand_but_is_not_served() -> None:
    setup = Setup()
    setup.workload.schedule("y", 600, start=0.0, stop=1.0)
    setup.raft.run_until(1.0)
    stats = setup.workload.stats["y"]
    assert stats.requests == len(setup.workload.requests) > 0
    assert stats.served == 0 and stats.first_served_at is None
    assert not any(served for _, _, served in setup.workload.requests)


def test_a_routed_request_is_served_over_the_route() -> None:
    setup = Setup()
    setup.serve_y()
    setup.workload.schedule("y", 600, start=0.0, stop=1.0)
    setup.raft.run_until(1.0)
    stats = setup.workload.stats["y"]
    assert stats.served == stats.requests > 0
    assert stats.first_served_at == stats.first_request_at
    assert len(setup.spot_checks.answers) == stats.served


def test_demand_is_flushed_to_the_leader_in_batches_and_counted_once() -> None:
    setup = Setup()
    setup.raft.run_while(lambda: setup.raft.leader() is None, timeout=10.0)
    start = setup.loop.now
    setup.workload.schedule("y", 600, start=start, stop=start + 3.0)
    setup.workload.schedule("x", 120, start=start, stop=start + 3.0)
    setup.loop.call_later(DEMAND_FLUSH_S, setup.workload.flush)
    setup.raft.run_until(start + 5.0)
    flushed = {model: sum(d.count for d in setup.demand if d.model == model) for model in MODELS}
    counted = {model: setup.workload.stats[model].requests for model in MODELS}
    assert flushed == counted and counted["y"] > counted["x"] > 0


def test_only_the_first_managed_assignment_is_noted() -> None:
    setup = Setup()
    setup.raft.run_until(2.0)
    setup.workload.assigned("y")
    setup.raft.run_until(3.0)
    setup.workload.assigned("y")
    assert setup.workload.stats["y"].first_assigned_at == 2.0


def test_a_models_figures_measure_from_its_first_request() -> None:
    stats = ModelStats(4, 3, first_request_at=1.0, first_assigned_at=1.5, first_served_at=20.25)
    assert stats.summary() == {
        "requests": 4,
        "served": 3,
        "served_fraction": 0.75,
        "first_request_at": 1.0,
        "request_to_assigned_s": 0.5,
        "request_to_served_s": 19.25,
    }
    assert ModelStats().summary()["served_fraction"] is None
