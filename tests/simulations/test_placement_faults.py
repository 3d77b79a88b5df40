"""The faults a placement scenario schedules: crashes and restarts of
workers (and their SWIM cores), voter partitions, an isolated leader, and
workers cut off."""

from __future__ import annotations

import pytest

from consensus.placement import ModelFacts
from mesh.config import MembershipConfig
from mesh.coverage import CoverageMap
from simulations.cluster import NodeStatus
from simulations.placement_faults import Faults
from simulations.placement_membership import Membership
from simulations.placement_metrics import Availability
from simulations.placement_trace import Trace
from simulations.placement_workers import GB, Fleet, WorkerSpec
from simulations.raft_cluster import RaftCluster

MODELS = {"y": ModelFacts(32, GB // 2)}
VOTERS = 3


class Setup:
    """Three voters, a pinned worker and a spare one, the oracle or SWIM."""

    def __init__(self, *, swim: bool = False) -> None:
        self.raft = RaftCluster(VOTERS, 1)
        self.loop = self.raft.loop
        self.trace = Trace(self.loop, keep=True)
        specs = [WorkerSpec(24, ("y",), pinned="y"), WorkerSpec(24, ("y",))]
        self.fleet = Fleet(specs, MODELS, self.trace)
        config = MembershipConfig.lan() if swim else None
        self.membership = Membership(1, self.fleet, VOTERS, 2, self.loop, config=config)
        self.observed = 0
        self.availability = Availability(
            self.raft, VOTERS, MODELS, self._coverage, lambda _model: False
        )
        self.faults = Faults(
            self.raft, VOTERS, self.fleet, self.membership, self.availability, self.trace
        )

    def _coverage(self) -> CoverageMap:
        self.observed += 1
        return CoverageMap({}, {})

    def notes(self) -> list[str]:
        assert self.trace.lines is not None
        return [line.split(" ", 1)[1] for line in self.trace.lines]


def test_a_crash_and_a_restart_happen_at_their_times_and_are_observed() -> None:
    setup = Setup()
    setup.faults.crash(0, at=2.0)
    setup.faults.restart(0, at=5.0)
    setup.loop.run_until(3.0)
    worker = setup.fleet.workers[0]
    assert not worker.alive and worker.since == 2.0 and worker.serving is None
    assert setup.observed == 1  # chains observed after the crash
    setup.loop.run_until(6.0)
    assert worker.alive and worker.since == 5.0
    assert worker.serving == setup.fleet.pin("y")  # a pinned worker reloads its pin
    assert setup.observed == 2
    assert setup.notes() == ["crash 0", "load 0 y (0, 32)", "restart 0"]


def test_a_voter_partition_cuts_raft_from_its_start_to_its_heal() -> None:
    setup = Setup()
    setup.faults.partition_voters([[0], [1, 2]], at=1.0, heal=3.0)
    network = setup.raft.network
    setup.loop.run_until(0.5)
    assert network.can_reach(0, 1)
    setup.loop.run_until(2.0)
    assert not network.can_reach(0, 1) and network.can_reach(1, 2)
    setup.loop.run_until(3.5)
    assert network.can_reach(0, 1)


def test_isolating_the_leader_cuts_whoever_leads_then_and_nothing_if_nobody_does() -> None:
    setup = Setup()
    setup.faults.isolate_leader(at=0.0, heal=1.0)  # nobody leads at 0
    setup.raft.run_while(lambda: setup.raft.leader() is None, timeout=10.0)
    leader = setup.raft.leader()
    assert leader is not None
    at = setup.loop.now + 1.0
    setup.faults.isolate_leader(at=at, heal=at + 5.0)
    setup.loop.run_until(at + 0.1)
    assert setup.notes() == [f"isolate leader {leader}"]
    others = [v for v in range(VOTERS) if v != leader]
    assert not any(setup.raft.network.can_reach(leader, v) for v in others)
    assert setup.raft.network.can_reach(*others)


def test_cutting_workers_off_needs_swim() -> None:
    setup = Setup()
    with pytest.raises(ValueError, match="SWIM"):
        setup.faults.cut_off_workers([1], at=1.0, heal=2.0)
    with pytest.raises(ValueError, match="SWIM"):
        setup.faults.partition_voters([[0], [1, 2]], 1.0, 2.0, workers=[1])
    with pytest.raises(ValueError, match="SWIM"):
        setup.faults.isolate_leader(1.0, 2.0, workers=[1])


def test_under_swim_a_crash_crashes_the_workers_membership_core_too() -> None:
    setup = Setup(swim=True)
    swim = setup.membership.swim
    assert swim is not None
    member = setup.membership.members[setup.fleet.workers[1].node]
    setup.faults.crash(1, at=2.0)
    setup.faults.restart(1, at=4.0)
    setup.loop.run_until(3.0)
    assert swim.nodes[member].status == NodeStatus.CRASHED
    assert [d.worker for d in setup.membership.detections] == [1]
    setup.loop.run_until(5.0)
    assert swim.nodes[member].status == NodeStatus.UP


def test_under_swim_cut_off_workers_reach_nobody_until_the_heal() -> None:
    setup = Setup(swim=True)
    swim = setup.membership.swim
    assert swim is not None
    member = setup.membership.members[setup.fleet.workers[1].node]
    setup.faults.cut_off_workers([1], at=1.0, heal=2.0)
    setup.loop.run_until(1.5)
    assert not swim.network.can_reach(member, 0)
    assert swim.network.can_reach(0, 1)  # the voters stay together
    setup.loop.run_until(2.5)
    assert swim.network.can_reach(member, 0)
