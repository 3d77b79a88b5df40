"""Placement in virtual time: the real Raft cores, ledger and placement policy
under a chat-demand workload, with crashes and partitions.

Every voter is a real `consensus.raft.RaftNode` (through `RaftCluster`)
applying committed entries to its own `PlacementLedger`, and every voter
that believes it leads runs the driver's round (`upkeep`, then `decide`)
as `runtime.node.placement_driver` does. `PlacementCluster` composes the
modelled rest, one concern per collaborator: workers and the cost model,
membership (oracle or SWIM), routing, the workload, spot checks,
availability, invariants, faults and the trace. What is real and what is
modelled, and why: docs/design/placement-simulation.md.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from consensus.commands import Assign, RecordDemand, Verdict, encode_command
from consensus.ledger import PlacementLedger
from consensus.log import Entry, EntryKind
from consensus.placement import (
    ModelFacts,
    PlacementHistory,
    PlacementInput,
    decide,
    upkeep,
)
from consensus.settings import PlacementSettings
from mesh.config import MembershipConfig
from mesh.coverage import CoverageMap
from simulations.cluster import MembershipCluster
from simulations.network import NetworkConfig
from simulations.placement_faults import Faults
from simulations.placement_invariants import Invariants
from simulations.placement_membership import DETECT_S, Detection, Membership
from simulations.placement_metrics import Availability
from simulations.placement_routing import ENTRIES, Routing
from simulations.placement_spot_checks import LiarStats, SpotChecks
from simulations.placement_trace import Trace, merge_timeline
from simulations.placement_workers import FOLLOW_S, GB, Fleet, Lies, Worker, WorkerSpec
from simulations.placement_workload import DEMAND_FLUSH_S, ModelStats, Workload
from simulations.raft_cluster import Proposal, RaftCluster
from simulations.seeds import component_rng

__all__ = [
    "GB",
    "PLACEMENT_INTERVAL_S",
    "PROPOSAL_TIMEOUT_S",
    "Detection",
    "LiarStats",
    "Lies",
    "ModelStats",
    "PlacementCluster",
    "WorkerSpec",
]

PLACEMENT_INTERVAL_S: Final = 0.25
"""The driver's round (runtime.node.placement_driver.PLACEMENT_INTERVAL_S)."""
PROPOSAL_TIMEOUT_S: Final = 1.0
"""A round's proposals that have not committed by then are given up on (the
driver's proposal timeout): the next round decides afresh."""


@dataclass
class _Leading:
    """One voter's round in flight: what it proposed, until when it waits."""

    proposals: list[Proposal] = field(default_factory=list)
    until: float = 0.0


class PlacementCluster:
    """`voters` Raft voters placing `models` on `workers` (see the module doc).

    With `membership` (a `MembershipConfig`) the voters, workers and entries
    run real SWIM cores; without, membership is an oracle that sees a crash
    `detect_s` after it. `keep_trace` keeps every traced line for `timeline`.
    """

    def __init__(
        self,
        seed: int,
        workers: Sequence[WorkerSpec],
        models: Mapping[str, ModelFacts],
        *,
        voters: int = 3,
        policy: PlacementSettings | None = None,
        network: NetworkConfig | None = None,
        detect_s: float = DETECT_S,
        membership: MembershipConfig | None = None,
        keep_trace: bool = False,
    ) -> None:
        self.seed = seed
        self.models = dict(models)
        self.raft = RaftCluster(voters, seed, network=network, keep_trace=keep_trace)
        self.loop = self.raft.loop
        self.policy = policy or PlacementSettings()
        self.ledgers = [PlacementLedger() for _ in range(voters)]
        self.histories = [PlacementHistory() for _ in range(voters)]
        self.raft.on_commit = self._apply
        self.committed: Counter[str] = Counter()
        """Accepted commands by type: Assign, Release, MarkAdmissionFailed, ..."""
        self.commits: list[tuple[float, str, str]] = []
        """Every accepted placement command but demand: (time, type, model)."""
        self._counted_index = 0
        self._leading = [_Leading() for _ in range(voters)]
        self._compose(seed, workers, voters, detect_s, membership, network, keep_trace)
        self.fleet.load_pinned(self.now)
        self.raft.on_role = lambda _voter: self.availability.observe_leader()
        self.availability.observe_chains()
        self.loop.call_later(PLACEMENT_INTERVAL_S, self._round)
        self.loop.call_later(DEMAND_FLUSH_S, self.workload.flush)
        self.loop.call_later(FOLLOW_S, self._follow)

    def _compose(
        self,
        seed: int,
        workers: Sequence[WorkerSpec],
        voters: int,
        detect_s: float,
        membership: MembershipConfig | None,
        network: NetworkConfig | None,
        keep_trace: bool,
    ) -> None:
        """Build the collaborators, each given what its concern reads."""
        self.trace = Trace(self.loop, keep=keep_trace)
        self.fleet = Fleet(workers, self.models, self.trace)
        self.invariants = Invariants(self.loop)
        self.membership = Membership(
            seed,
            self.fleet,
            voters,
            ENTRIES,
            self.loop,
            detect_s=detect_s,
            config=membership,
            network=network,
            keep_trace=keep_trace,
        )
        self.routing = Routing(
            seed,
            self.fleet,
            self.membership,
            self.models,
            self.loop,
            quarantined=lambda: self.ledger().quarantined(self.now),
        )
        swim = self.membership.swim is not None
        serving = component_rng(seed, "placement", "serving")
        self.spot_checks = SpotChecks(
            self.raft,
            self.fleet,
            self.routing,
            self.invariants,
            self.trace,
            rng=serving,
            verify_fraction=self.policy.verify_fraction,
            ledger=self.ledger,
            swim=swim,
        )
        self.workload = Workload(
            self.raft,
            self.models,
            self.routing,
            self.spot_checks,
            arrivals=component_rng(seed, "placement", "workload"),
            serving=serving,
            swim=swim,
        )
        self.availability = Availability(
            self.raft, voters, self.models, self.routing.coverage, self.routing.servable
        )
        self.faults = Faults(
            self.raft, voters, self.fleet, self.membership, self.availability, self.trace
        )

    # --- driving ---------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.loop.now

    def run_until(self, until: float) -> None:
        self.loop.run_until(until)

    def demand(self, model: str, per_minute: float, start: float, stop: float) -> None:
        """Chat requests for `model` at `per_minute` on average (Poisson),
        from `start` to `stop` virtual seconds."""
        self.workload.schedule(model, per_minute, start, stop)

    def crash(self, worker: int, at: float) -> None:
        """Crash `worker` at `at` (with SWIM, its membership core too)."""
        self.faults.crash(worker, at)

    def restart(self, worker: int, at: float) -> None:
        """Restart `worker` at `at` (with SWIM, a fresh core that rejoins)."""
        self.faults.restart(worker, at)

    def partition_voters(
        self,
        groups: Sequence[Sequence[int]],
        at: float,
        heal: float,
        workers: Collection[int] = (),
    ) -> None:
        """Cut the voters into `groups` from `at` to `heal` (`Faults.partition_voters`)."""
        self.faults.partition_voters(groups, at, heal, workers)

    def isolate_leader(self, at: float, heal: float, workers: Collection[int] = ()) -> None:
        """Cut whichever voter leads at `at` off until `heal` (`Faults.isolate_leader`)."""
        self.faults.isolate_leader(at, heal, workers)

    def cut_off_workers(self, workers: Collection[int], at: float, heal: float) -> None:
        """SWIM: cut `workers` off from everyone from `at` to `heal`."""
        self.faults.cut_off_workers(workers, at, heal)

    # --- what it holds ---------------------------------------------------------------

    @property
    def workers(self) -> list[Worker]:
        return self.fleet.workers

    @property
    def swim(self) -> MembershipCluster | None:
        """The real SWIM cores (`Membership.swim`); None: the oracle."""
        return self.membership.swim

    @property
    def detect_s(self) -> float:
        return self.membership.detect_s

    @property
    def stats(self) -> dict[str, ModelStats]:
        return self.workload.stats

    @property
    def requests(self) -> list[tuple[float, str, bool]]:
        """Every chat request: (time, model, served)."""
        return self.workload.requests

    @property
    def answers(self) -> list[tuple[float, bool]]:
        """Every served request: (time, correct)."""
        return self.spot_checks.answers

    @property
    def liars(self) -> dict[int, LiarStats]:
        return self.spot_checks.liars

    @property
    def quarantined_at(self) -> dict[int, float]:
        """Worker -> when the first guilty verdict against it committed."""
        return self.spot_checks.quarantined_at

    @property
    def violations(self) -> list[str]:
        return self.invariants.violations

    # --- observers -------------------------------------------------------------------

    def ledger(self) -> PlacementLedger:
        """The most advanced replica."""
        return max(self.ledgers, key=lambda ledger: ledger.applied_index)

    def coverage(self, observer: int | None = None) -> CoverageMap:
        """What the entries route over (`Routing.coverage`)."""
        return self.routing.coverage(observer)

    def servable(self, model: str) -> bool:
        """A complete chain of `model` exists in truth (`Routing.servable`)."""
        return self.routing.servable(model)

    def committing_leader(self) -> int | None:
        """The voter that could commit now (`Availability.committing_leader`)."""
        return self.availability.committing_leader()

    def leader_spans(self) -> list[tuple[float, float, int | None, int]]:
        """Who could commit, as spans up to now: (start, end, voter or None, term)."""
        return self.availability.leader_spans()

    def chain_spans(self, model: str) -> list[tuple[float, float, bool]]:
        """Whether `model` had a complete chain, as spans up to now."""
        return self.availability.chain_spans(model)

    def trace_scenario(self, digest: str) -> None:
        """Put the resolved scenario's digest in the trace (at time 0)."""
        self.trace.note(f"scenario {digest}")

    def trace_digest(self) -> str:
        """Covers Raft's trace, this simulation's and (with SWIM) membership's."""
        both = f"{self.raft.trace_digest()} {self.trace.hexdigest()}"
        if self.swim is not None:
            both += f" {self.swim.trace_digest()}"
        return hashlib.sha256(both.encode()).hexdigest()

    def timeline(self) -> list[str]:
        """With `keep_trace`: every stream `trace_digest` covers, merged in
        time order (`merge_timeline`)."""
        swim = [] if self.swim is None else self.swim.trace_lines or []
        return merge_timeline(self.raft.trace_lines or [], self.trace.lines or [], swim)

    def check(self) -> None:
        """Raise AssertionError if any invariant failed (`Invariants.check`)."""
        self.invariants.check(self.seed, self.raft, self.ledgers)

    def metrics(self) -> dict[str, object]:
        """A JSON-ready summary of the run (deterministic for a seed)."""
        membership = None if self.swim is None else self.membership.summary(self.routing.rerouted)
        return {
            "simulated_seconds": self.now,
            "terms": len(self.raft.leader_of_term),
            **self.availability.leadership_summary(),
            "committed": dict(sorted(self.committed.items())),
            "models": {name: self._model_metrics(name) for name in sorted(self.stats)},
            "verification": self.spot_checks.summary(),
            **({} if membership is None else {"membership": membership}),
            "violations": len(self.violations),
            "trace_digest": self.trace_digest(),
        }

    def _model_metrics(self, model: str) -> dict[str, object]:
        stats = self.stats[model]
        incomplete = self.availability.incomplete_chain_s(model, stats.first_request_at)
        return stats.summary() | {"incomplete_chain_s": incomplete}

    # --- the leader's round (runtime.node.placement_driver._place) -------------------

    def _round(self) -> None:
        self.loop.call_later(PLACEMENT_INTERVAL_S, self._round)
        if self.swim is not None:
            self.membership.watch_leader(self.raft.leader(), PLACEMENT_INTERVAL_S)
        for i in range(len(self.ledgers)):
            core = self.raft.node(i)
            if core is None or not core.is_leader:
                continue
            leading = self._leading[i]
            pending = [p for p in leading.proposals if not self.raft.is_committed(p)]
            if pending and self.now < leading.until:
                continue
            leading.proposals = []
            ledger = self.ledgers[i]
            snapshot = PlacementInput.from_ledger(
                ledger,
                nodes=self.membership.views(ledger, i),
                models=self.models,
                now=self.now,
                has_quorum=core.leader is not None,
                history=self.histories[i],
            )
            announced = self.membership.announced(i)
            decisions = upkeep(ledger, announced, self.now) or decide(snapshot, self.policy)
            for decision in decisions:
                self.invariants.decision(snapshot, decision)
                proposal = self.raft.propose(encode_command(decision.command), on=i)
                if proposal is None:
                    break
                leading.proposals.append(proposal)
            leading.until = self.now + PROPOSAL_TIMEOUT_S

    def _follow(self) -> None:
        self.loop.call_later(FOLLOW_S, self._follow)
        self.fleet.follow(self.ledger(), self.now)
        self.availability.observe_chains()

    # --- the replicated state machine ------------------------------------------------

    def _apply(self, voter: int, entry: Entry) -> None:
        if entry.kind != EntryKind.COMMAND:
            return
        result = self.ledgers[voter].apply(entry.index, entry.data)
        if not result.accepted or result.command is None:
            return
        command = result.command
        self.histories[voter].observe(command)
        # Replicas apply in log order, so the first to reach an index is
        # the cluster's commit of it: the figures count it then, once.
        if entry.index <= self._counted_index:
            return
        self._counted_index = entry.index
        kind, model = type(command).__name__, getattr(command, "model", "")
        self.committed[kind] += 1
        self.trace.note(f"commit {kind} {model}")
        if not isinstance(command, RecordDemand):
            self.commits.append((self.now, kind, model))
        if isinstance(command, Assign) and command.managed:
            self.workload.assigned(command.model)
        self.invariants.committed(command)
        if isinstance(command, Verdict) and command.guilty:
            self.spot_checks.convicted(command)
        if isinstance(command, Verdict):
            self.availability.standing_changed(self.ledgers[voter], result)
