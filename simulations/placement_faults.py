"""The faults a placement scenario schedules: worker crashes and restarts,
voter partitions, an isolated leader, and workers cut off.

Under the oracle a voter partition cuts Raft's network only; with SWIM it
splits the membership network too (`Membership.split`), and a crash or
restart is one in membership as well. Each fault notes itself in the trace
and has availability observe what it changed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from simulations.placement_membership import Membership
from simulations.placement_metrics import Availability
from simulations.placement_trace import Trace
from simulations.placement_workers import Fleet
from simulations.raft_cluster import RaftCluster

__all__ = ["Faults"]


class Faults:
    """Schedules faults on the workers, the voters and their networks."""

    def __init__(
        self,
        raft: RaftCluster,
        voters: int,
        fleet: Fleet,
        membership: Membership,
        availability: Availability,
        trace: Trace,
    ) -> None:
        self._raft, self._loop, self._voters = raft, raft.loop, voters
        self._fleet, self._membership = fleet, membership
        self._availability, self._trace = availability, trace

    def crash(self, worker: int, at: float) -> None:
        """Crash `worker` at `at` (with SWIM, its membership core too)."""
        self._loop.call_at(at, self._crash, worker)
        self._membership.crash(worker, at)

    def restart(self, worker: int, at: float) -> None:
        """Restart `worker` at `at` (with SWIM, a fresh core that rejoins)."""
        self._loop.call_at(at, self._restart, worker)
        self._membership.restart(worker, at)

    def partition_voters(
        self,
        groups: Sequence[Sequence[int]],
        at: float,
        heal: float,
        workers: Collection[int] = (),
    ) -> None:
        """Cut the voters into `groups` from `at` to `heal`. Under the oracle
        workers are unaffected; with SWIM the members' network splits too
        (`Membership.split`), `workers` on a side of their own."""
        self._membership.check_cut_off(workers)
        self._raft.network.schedule_partition(groups, at, heal)
        self._membership.split(groups, workers, at, heal)
        self._availability.observe_leader_at(at, heal)

    def isolate_leader(self, at: float, heal: float, workers: Collection[int] = ()) -> None:
        """Cut whichever voter leads at `at` off from the others until `heal`
        (nothing happens if none leads then): a scenario cannot know in
        advance which voter its election will pick. With SWIM, as
        `partition_voters`."""
        self._membership.check_cut_off(workers)

        def cut() -> None:
            leader = self._raft.leader()
            if leader is None:
                return
            others = [i for i in range(self._voters) if i != leader]
            now = self._loop.now
            self._trace.note(f"isolate leader {leader}")
            self._raft.network.schedule_partition([[leader], others], now, heal)
            self._membership.split([[leader], others], workers, now, heal)
            self._availability.observe_leader_at(now, heal)

        self._loop.call_at(at, cut)

    def cut_off_workers(self, workers: Collection[int], at: float, heal: float) -> None:
        """SWIM: cut `workers` off from the voters, the entries and the other
        workers from `at` to `heal`; the voters stay together."""
        self._membership.split([range(self._voters)], workers, at, heal)

    def _crash(self, index: int) -> None:
        self._membership.crashed(index)
        self._fleet.crash(index, self._loop.now)
        self._availability.observe_chains()

    def _restart(self, index: int) -> None:
        self._fleet.restart(index, self._loop.now)
        self._availability.observe_chains()
