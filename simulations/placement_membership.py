"""What a placement simulation's voters and entries know of who is alive.

Two kinds: the oracle (a voter sees a crashed worker as dead `detect_s`
after the crash, entries see the truth) or real SWIM, a `MembershipCluster`
on its own network in the same virtual time whose members are the voters
(numbered as in Raft), the workers, then the entries. `Membership` answers
"what does voter v believe of worker w", builds the leader's node views
from it, splits the membership network with a voter partition, and records
when the leader's own core saw each crash (docs/simulation.md, "Placement
over real membership").
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Final

from consensus.ledger import PlacementLedger
from consensus.placement import Announced, CapabilityState, NodeView
from mesh.config import MembershipConfig
from mesh.member_table import GONE_STATES, LIVE_STATES, MemberStateName, state_name
from simulations.cluster import MembershipCluster
from simulations.loop import EventLoop
from simulations.network import NetworkConfig
from simulations.placement_metrics import since
from simulations.placement_workers import GB, Fleet, Worker
from simulations.seeds import derive_seed

__all__ = ["DETECT_S", "Detection", "Membership"]

DETECT_S: Final = 10.0
"""Crash to "dead" at the leader: the LAN profile's median at 1,000 nodes."""


@dataclass
class Detection:
    """One worker crash under SWIM, and when the leader's own membership
    core declared the worker dead (None: not before it restarted or the
    run ended)."""

    worker: int
    crashed_at: float
    leader_dead_at: float | None = None


class Membership:
    """The oracle, or the real SWIM cores of voters, workers and entries."""

    def __init__(
        self,
        seed: int,
        fleet: Fleet,
        voters: int,
        entries: int,
        loop: EventLoop,
        *,
        detect_s: float = DETECT_S,
        config: MembershipConfig | None = None,
        network: NetworkConfig | None = None,
        keep_trace: bool = False,
    ) -> None:
        self.detect_s = detect_s
        self._fleet, self._voters, self._loop = fleet, voters, loop
        self.swim: MembershipCluster | None = None
        """With `config`: the real SWIM cores of the voters (members 0 to
        voters - 1, as in Raft), the workers, then the entries, on their own
        network in this run's virtual time; None: the oracle (`detect_s`)."""
        self.members: dict[bytes, int] = {}
        """SWIM: a worker's node id -> its member index."""
        self.entry_members: list[int] = []
        """SWIM: each entry's member index, in entry order."""
        self.detections: list[Detection] = []
        self.live_held_dead_s = 0.0
        """SWIM: worker-seconds the leader's core held a running worker dead
        or left, sampled every placement round (`watch_leader`)."""
        if config is not None:
            first_entry = voters + len(fleet.workers)
            self.swim = MembershipCluster(
                first_entry + entries,
                derive_seed(seed, "placement", "swim"),
                config,
                network,
                keep_trace=keep_trace,
                loop=loop,
            )
            self.members = {w.node: voters + i for i, w in enumerate(fleet.workers)}
            self.entry_members = [first_entry + i for i in range(entries)]

    def entry_member(self, entry: int) -> int | None:
        """Entry `entry`'s member index, whose own view it routes by; None: the oracle."""
        return self.entry_members[entry] if self.entry_members else None

    def seen(self, voter: int, worker: Worker) -> tuple[MemberStateName, float]:
        """What `voter`'s membership says of `worker`, and since when. The
        oracle sees a crash as "dead" `detect_s` after it; SWIM is the
        voter's own core (`member_view`)."""
        if self.swim is not None:
            return self.member_view(voter, worker)
        if not worker.alive and self._loop.now >= worker.since + self.detect_s:
            return "dead", worker.since + self.detect_s
        return "alive", worker.since

    def member_view(self, observer: int, worker: Worker) -> tuple[MemberStateName, float]:
        """SWIM member `observer`'s own view of `worker`. Every core starts
        knowing every member and forgets a dead one only after
        `reconnect_timeout` (a day), so a run always finds it."""
        assert self.swim is not None
        view = self.swim.membership(observer).member(self.swim.node_id(self.members[worker.node]))
        assert view is not None, f"member {observer} forgot worker {self._fleet.index[worker.node]}"
        return state_name(view.state), view.state_since

    def views(self, ledger: PlacementLedger, voter: int) -> dict[bytes, NodeView]:
        """What `voter`'s membership and the workers' records tell it."""
        views = {}
        for worker in self._fleet.workers:
            state, since = self.seen(voter, worker)
            held = ledger.assignment(worker.node)
            capability: CapabilityState = "none"
            if held is not None and worker.serving is not None and worker.alive:
                said = worker.serving
                if (said.model, said.layers, said.epoch) == (held.model, held.layers, held.epoch):
                    capability = worker.verdict
            views[worker.node] = NodeView(
                state,
                since,
                int(worker.spec.memory_gb * GB),
                frozenset(worker.spec.models),
                spare=worker.spec.pinned is None,
                capability=capability,
            )
        return views

    def announced(self, voter: int) -> dict[bytes, Announced]:
        """What each serving worker announces, live or not by `voter`'s view."""
        return {
            w.node: Announced(
                w.serving,
                live=self.seen(voter, w)[0] in LIVE_STATES,
                failure="doctor failed" if w.verdict == "failed" else None,
            )
            for w in self._fleet.workers
            if w.serving is not None
        }

    def crashed(self, index: int) -> None:
        """SWIM, worker `index` about to crash: note the crash for
        `detections`, and keep the record it gossiped last."""
        worker = self._fleet.workers[index]
        if self.swim is not None and worker.alive:
            self.detections.append(Detection(index, self._loop.now))
            worker.gossiped = self._fleet.record(worker)

    def crash(self, index: int, at: float) -> None:
        """SWIM: crash worker `index`'s membership core at `at`."""
        if self.swim is not None:
            self.swim.crash(self.members[self._fleet.workers[index].node], at)

    def restart(self, index: int, at: float) -> None:
        """SWIM: a fresh membership core for worker `index` rejoins at `at`."""
        if self.swim is not None:
            self.swim.restart(self.members[self._fleet.workers[index].node], at)

    def split(
        self,
        groups: Sequence[Sequence[int]],
        workers: Collection[int],
        at: float,
        heal: float,
    ) -> None:
        """The voter partition `groups` on the SWIM network: each voter set
        on a side (voters in none form one more, as in Raft), `workers` on a
        side of their own, and the other workers with every entry on the
        side of the largest voter set (the first such), the one that can
        elect a leader. Under the oracle there is no network to split."""
        self.check_cut_off(workers)
        if self.swim is None:
            return
        sides = [sorted(set(group)) for group in groups]
        rest = sorted(set(range(self._voters)).difference(*sides))
        if rest:
            sides.append(rest)
        largest = max(range(len(sides)), key=lambda side: (len(sides[side]), -side))
        cut_off = [self.members[self._fleet.workers[w].node] for w in sorted(set(workers))]
        sides[largest] += sorted(set(self.members.values()) - set(cut_off))
        sides[largest] += self.entry_members
        self.swim.partition([*sides, cut_off] if cut_off else sides, at, heal)

    def check_cut_off(self, workers: Collection[int]) -> None:
        """Cutting workers off needs a membership network to cut."""
        if workers and self.swim is None:
            raise ValueError("cutting workers off needs SWIM membership (`membership`)")

    def watch_leader(self, leader: int | None, interval_s: float) -> None:
        """SWIM, each round of `interval_s`: when the leader's core first
        holds a crashed worker dead (`detections`), and how long it holds
        running workers dead (`live_held_dead_s`)."""
        if leader is None:
            return
        for index, worker in enumerate(self._fleet.workers):
            state, since = self.member_view(leader, worker)
            if state not in GONE_STATES:
                continue
            if worker.alive:
                self.live_held_dead_s += interval_s
                continue
            for detection in self.detections:
                pending = detection.leader_dead_at is None and detection.worker == index
                if pending and detection.crashed_at == worker.since:
                    detection.leader_dead_at = max(since, worker.since)

    def summary(self, rerouted: int) -> dict[str, object]:
        """SWIM: what the real membership cores did to placement. Per crash,
        when the leader's core declared the worker dead (`detect_s` from the
        crash); `false_dead`, the voters' "dead" verdicts about workers that
        were neither down nor behind a partition (`MembershipCluster.
        false_positives`); `live_held_dead_s`; and `rerouted`, the requests
        whose first chain met a crashed or unreachable worker."""
        assert self.swim is not None
        workers = set(self.members.values())
        false_dead = [
            verdict
            for verdict in self.swim.false_positives()
            if verdict[1] < self._voters and verdict[2] in workers
        ]
        return {
            "detections": [
                {
                    "worker": d.worker,
                    "crashed_at": d.crashed_at,
                    "leader_dead_at": d.leader_dead_at,
                    "detect_s": since(d.crashed_at, d.leader_dead_at),
                }
                for d in self.detections
            ],
            "false_dead": len(false_dead),
            "live_held_dead_s": round(self.live_held_dead_s, 6),
            "rerouted": rerouted,
        }
