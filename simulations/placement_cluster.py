"""Placement in virtual time: the real Raft cores, ledger and placement policy
under a chat-demand workload, with crashes and partitions.

What runs for real: every voter is a `consensus.raft.RaftNode` (through
`RaftCluster`, persist-before-send and all) applying committed entries to
its own `PlacementLedger`; every voter that believes it leads runs the
driver's round on its own replica (`upkeep`, then `decide`) and proposes
what they return, one round's proposals at a time, as `runtime.
placement_driver` does. A deposed leader on the minority side of a
partition keeps proposing until CheckQuorum steps it down, exactly as a
real one would; its entries never commit.

What is modelled, so that a run over minutes of demand costs seconds:

* **Workers** (the nodes that serve) are not Raft members here and their
  membership is an oracle: the leader sees a crash as "dead" `detect_s`
  after it happens (SWIM's detection, simulated for real in
  `simulations.cluster`), and sees what a worker announces (its shard and
  its doctor's verdict) at once.
* **Cost model**: a worker given a shard loads it at its hardware class's
  bytes per second (`LOAD_BYTES_PER_S`), then runs its doctor for
  `DOCTOR_S`; a worker built with `fails_doctor` fails it, as a node with a
  corrupt copy would.
* **Demand**: chat requests arrive per model as a Poisson process at the
  configured rate. A request is served when the admitted shards of live
  workers cover every layer; either way it counts as demand, flushed to the
  leader every `DEMAND_FLUSH_S` as the entry nodes' batching does.

Invariants, checked as it runs (`violations`) and by `check`: Raft's own
(one leader per term, agreeing committed logs); every replica's ledger
equal at equal applied index; a pinned shard, once recorded, never changes;
every managed assignment a leader proposes goes to a worker its view holds
alive, spare and holding the model. (A leader cut off from a quorum keeps
its role until CheckQuorum steps it down, as in the node; what it proposes
meanwhile never commits, which the agreeing ledgers show.) Same seed, same
run: `trace_digest` covers Raft's trace and this module's events.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from consensus.ledger import Assign, PlacementLedger, RecordDemand, Release, encode_command
from consensus.log import Entry, EntryKind
from consensus.placement import (
    Announced,
    CapabilityState,
    Decision,
    ModelFacts,
    NodeView,
    PlacementHistory,
    PlacementInput,
    decide,
    upkeep,
)
from consensus.settings import PlacementSettings
from mesh.fields import one_of
from mesh.records import RECIPES, TIERS, Assignment
from simulations.network import NetworkConfig
from simulations.raft_cluster import Proposal, RaftCluster
from simulations.seeds import component_rng

GB: Final = 1 << 30
PLACEMENT_INTERVAL_S: Final = 0.25
"""The driver's round (runtime.node.placement_driver.PLACEMENT_INTERVAL_S)."""
DEMAND_FLUSH_S: Final = 0.5
"""The entries' demand batching (runtime.node.placement_driver.DEMAND_FLUSH_S)."""
FOLLOW_S: Final = 0.2
"""How often a worker compares the ledger's assignment with what it serves."""
PROPOSAL_TIMEOUT_S: Final = 1.0
"""A round's proposals that have not committed by then are given up on (the
driver's proposal timeout): the next round decides afresh."""
DOCTOR_S: Final = 5.0
"""A doctor run: a real forward pass and a throughput measurement."""
LOAD_BYTES_PER_S: Final[Mapping[str, float]] = {
    "gpu": 2.0 * GB,  # NVMe into a GPU box's host memory, then to the device
    "mac": 1.5 * GB,  # Apple SSD into unified memory
    "cpu": 0.5 * GB,  # a volunteer's SATA disk
}
"""Shard load speed per hardware class, the cost model's one knob per class."""
DETECT_S: Final = 10.0
"""Crash to "dead" at the leader: the LAN profile's median at 1,000 nodes."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A node that may serve: its memory, store, hardware, and operator pin."""

    memory_gb: float
    models: tuple[str, ...] = ()
    pinned: str | None = None
    """An operator pinned it to the whole of this model (`--model`)."""
    hardware: str = "gpu"
    fails_doctor: bool = False

    def __post_init__(self) -> None:
        if self.hardware not in LOAD_BYTES_PER_S:
            raise ValueError(f"hardware must be one of {', '.join(LOAD_BYTES_PER_S)}")
        if self.memory_gb <= 0:
            raise ValueError("memory_gb must be positive")


@dataclass
class _Worker:
    spec: WorkerSpec
    node: bytes
    alive: bool = True
    since: float = 0.0
    serving: Assignment | None = None
    ready_at: float = math.inf
    verdict: CapabilityState = "none"
    """Its doctor's verdict on `serving`: none (loading), admitted, failed."""


@dataclass
class ModelStats:
    """What happened to one model's demand."""

    requests: int = 0
    served: int = 0
    first_request_at: float | None = None
    first_assigned_at: float | None = None
    first_served_at: float | None = None


@dataclass
class _Leading:
    """One voter's round in flight: what it proposed, until when it waits."""

    proposals: list[Proposal] = field(default_factory=list)
    until: float = 0.0


class PlacementCluster:
    """`voters` Raft voters placing `models` on `workers` (see the module doc)."""

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
        keep_trace: bool = False,
    ) -> None:
        self.seed = seed
        self.models = dict(models)
        self.detect_s = detect_s
        self.raft = RaftCluster(voters, seed, network=network, keep_trace=keep_trace)
        self.loop = self.raft.loop
        self.policy = policy
        self.ledgers = [PlacementLedger() for _ in range(voters)]
        self.histories = [PlacementHistory() for _ in range(voters)]
        self.raft.on_commit = self._apply
        self.workers = [_Worker(spec, bytes([0xAA, *i.to_bytes(31, "big")])) for i, spec in
                        enumerate(workers)]  # fmt: skip
        self._index = {w.node: i for i, w in enumerate(self.workers)}
        self.stats = {name: ModelStats() for name in self.models}
        self.committed: Counter[str] = Counter()
        """Accepted commands by type: Assign, Release, MarkAdmissionFailed, ..."""
        self.violations: list[str] = []
        self.requests: list[tuple[float, str, bool]] = []
        """Every chat request: (time, model, served)."""
        self.commits: list[tuple[float, str, str]] = []
        """Every accepted placement command but demand: (time, type, model)."""
        self._pinned_recorded: dict[bytes, tuple[str, tuple[int, int]]] = {}
        self._demand: Counter[str] = Counter()
        self._counted_index = 0
        self._leading = [_Leading() for _ in range(voters)]
        self._rng = component_rng(seed, "placement", "workload")
        self._trace = hashlib.sha256()
        self._lines: list[str] | None = [] if keep_trace else None
        for worker in self.workers:
            if worker.spec.pinned is not None:
                self._load(worker, self._pin(worker.spec.pinned))
        self.loop.call_later(PLACEMENT_INTERVAL_S, self._round)
        self.loop.call_later(DEMAND_FLUSH_S, self._flush)
        self.loop.call_later(FOLLOW_S, self._follow)

    # --- driving ---------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.loop.now

    def run_until(self, until: float) -> None:
        self.loop.run_until(until)

    def demand(self, model: str, per_minute: float, start: float, stop: float) -> None:
        """Chat requests for `model` at `per_minute` on average (Poisson),
        from `start` to `stop` virtual seconds."""
        if model not in self.models or per_minute <= 0:
            raise ValueError(f"unknown model {model!r} or a rate <= 0")
        at = start
        while True:
            at += self._rng.expovariate(per_minute / 60.0)
            if at >= stop:
                return
            self.loop.call_at(at, self._request, model)

    def crash(self, worker: int, at: float) -> None:
        self.loop.call_at(at, self._crash, worker)

    def restart(self, worker: int, at: float) -> None:
        self.loop.call_at(at, self._restart, worker)

    def partition_voters(self, groups: Sequence[Sequence[int]], at: float, heal: float) -> None:
        """Cut the voters into `groups` from `at` to `heal` (workers are unaffected)."""
        self.raft.network.schedule_partition(groups, at, heal)

    def isolate_leader(self, at: float, heal: float) -> None:
        """Cut whichever voter leads at `at` off from the others until `heal`
        (nothing happens if none leads then): a scenario cannot know in
        advance which voter its election will pick."""

        def cut() -> None:
            leader = self.raft.leader()
            if leader is None:
                return
            others = [i for i in range(len(self.ledgers)) if i != leader]
            self._note(f"isolate leader {leader}")
            self.raft.network.schedule_partition([[leader], others], self.now, heal)

        self.loop.call_at(at, cut)

    # --- observers -------------------------------------------------------------------

    def ledger(self) -> PlacementLedger:
        """The most advanced replica."""
        return max(self.ledgers, key=lambda ledger: ledger.applied_index)

    def trace_scenario(self, digest: str) -> None:
        """Put the resolved scenario's digest in the trace (at time 0)."""
        self._note(f"scenario {digest}")

    def trace_digest(self) -> str:
        both = f"{self.raft.trace_digest()} {self._trace.hexdigest()}"
        return hashlib.sha256(both.encode()).hexdigest()

    def check(self) -> None:
        """Raise AssertionError if any invariant failed (see the module doc)."""
        self.raft.check_safety()
        by_index: dict[int, bytes] = {}
        for i, ledger in enumerate(self.ledgers):
            snapshot = ledger.snapshot()
            other = by_index.setdefault(ledger.applied_index, snapshot)
            if other != snapshot:
                self.violations.append(f"ledger of voter {i} differs at {ledger.applied_index}")
        if self.violations:
            raise AssertionError(f"seed {self.seed}: " + "; ".join(self.violations[:5]))

    def metrics(self) -> dict[str, object]:
        """A JSON-ready summary of the run (deterministic for a seed)."""
        return {
            "simulated_seconds": self.now,
            "terms": len(self.raft.leader_of_term),
            "committed": dict(sorted(self.committed.items())),
            "models": {
                name: {
                    "requests": s.requests,
                    "served": s.served,
                    "served_fraction": s.served / s.requests if s.requests else None,
                    "first_request_at": s.first_request_at,
                    "request_to_assigned_s": _since(s.first_request_at, s.first_assigned_at),
                    "request_to_served_s": _since(s.first_request_at, s.first_served_at),
                }
                for name, s in sorted(self.stats.items())
            },
            "violations": len(self.violations),
            "trace_digest": self.trace_digest(),
        }

    # --- the leader's round (runtime.node.placement_driver._place) -------------------------

    def _round(self) -> None:
        self.loop.call_later(PLACEMENT_INTERVAL_S, self._round)
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
                nodes=self._views(ledger),
                models=self.models,
                now=self.now,
                has_quorum=core.leader is not None,
                history=self.histories[i],
            )
            decisions = upkeep(ledger, self._announced(), self.now) or decide(snapshot, self.policy)
            for decision in decisions:
                self._check_decision(snapshot, decision)
                proposal = self.raft.propose(encode_command(decision.command), on=i)
                if proposal is None:
                    break
                leading.proposals.append(proposal)
            leading.until = self.now + PROPOSAL_TIMEOUT_S

    def _views(self, ledger: PlacementLedger) -> dict[bytes, NodeView]:
        """What the leader's membership and the workers' records tell it."""
        views = {}
        for worker in self.workers:
            seen_dead = not worker.alive and self.now >= worker.since + self.detect_s
            held = ledger.assignment(worker.node)
            capability: CapabilityState = "none"
            if held is not None and worker.serving is not None and worker.alive:
                said = worker.serving
                if (said.model, said.layers, said.epoch) == (held.model, held.layers, held.epoch):
                    capability = worker.verdict
            views[worker.node] = NodeView(
                "dead" if seen_dead else "alive",
                worker.since + self.detect_s if seen_dead else worker.since,
                int(worker.spec.memory_gb * GB),
                frozenset(worker.spec.models),
                spare=worker.spec.pinned is None,
                capability=capability,
            )
        return views

    def _announced(self) -> dict[bytes, Announced]:
        return {
            w.node: Announced(
                w.serving,
                live=w.alive or self.now < w.since + self.detect_s,
                failure="doctor failed" if w.verdict == "failed" else None,
            )
            for w in self.workers
            if w.serving is not None
        }

    def _check_decision(self, snapshot: PlacementInput, decision: Decision) -> None:
        command = decision.command
        if isinstance(command, Assign) and command.managed:
            view = snapshot.nodes[command.node]
            if view.state != "alive" or not view.spare or command.model not in view.models:
                self.violations.append(f"{self.now:.3f}: managed {command} onto {view}")

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
        self._note(f"commit {kind} {model}")
        if not isinstance(command, RecordDemand):
            self.commits.append((self.now, kind, model))
        if isinstance(command, Assign) and command.managed:
            stats = self.stats[command.model]
            if stats.first_assigned_at is None:
                stats.first_assigned_at = self.now
        elif isinstance(command, Assign):
            shard = (command.model, command.layers)
            if self._pinned_recorded.setdefault(command.node, shard) != shard:
                self.violations.append(f"pinned shard of {command.node.hex()[:8]} changed")
        elif isinstance(command, Release) and command.node in self._pinned_recorded:
            self.violations.append(f"pinned shard of {command.node.hex()[:8]} released")

    # --- workers ---------------------------------------------------------------------

    def _pin(self, model: str) -> Assignment:
        layers = (0, self.models[model].num_layers)
        recipe = one_of(self.models[model].recipe, "recipe", RECIPES)  # ModelFacts checked it
        return Assignment(model, layers, recipe, "operator", False, 0)

    def _load(self, worker: _Worker, assignment: Assignment) -> None:
        facts = self.models[assignment.model]
        size = (assignment.layers[1] - assignment.layers[0]) * facts.layer_bytes
        worker.serving = assignment
        worker.verdict = "none"
        worker.ready_at = self.now + size / LOAD_BYTES_PER_S[worker.spec.hardware] + DOCTOR_S
        self._note(f"load {self._index[worker.node]} {assignment.model} {assignment.layers}")

    def _follow(self) -> None:
        self.loop.call_later(FOLLOW_S, self._follow)
        ledger = self.ledger()
        for worker in self.workers:
            if not worker.alive:
                continue
            if (
                worker.serving is not None
                and worker.verdict == "none"
                and self.now >= worker.ready_at
            ):
                worker.verdict = "failed" if worker.spec.fails_doctor else "admitted"
                self._note(f"doctor {self._index[worker.node]} {worker.verdict}")
            if worker.spec.pinned is not None:
                continue
            held = ledger.assignment(worker.node)
            wanted = None
            if held is not None and held.tier != "operator":
                # The ledger checked recipe and tier; one_of narrows their types.
                wanted = Assignment(
                    held.model,
                    held.layers,
                    one_of(held.recipe, "recipe", RECIPES),
                    one_of(held.tier, "tier", TIERS),
                    held.managed,
                    held.epoch,
                )
            if wanted == worker.serving:
                continue
            if wanted is None:
                worker.serving, worker.verdict = None, "none"
                self._note(f"unload {self._index[worker.node]}")
            else:
                self._load(worker, wanted)

    def _crash(self, index: int) -> None:
        worker = self.workers[index]
        worker.alive, worker.since = False, self.now
        worker.serving, worker.verdict = None, "none"
        self._note(f"crash {index}")

    def _restart(self, index: int) -> None:
        worker = self.workers[index]
        worker.alive, worker.since = True, self.now
        if worker.spec.pinned is not None:
            self._load(worker, self._pin(worker.spec.pinned))
        self._note(f"restart {index}")

    # --- demand ----------------------------------------------------------------------

    def _request(self, model: str) -> None:
        stats = self.stats[model]
        stats.requests += 1
        if stats.first_request_at is None:
            stats.first_request_at = self.now
        self._demand[model] += 1
        served = self.servable(model)
        self.requests.append((self.now, model, served))
        if served:
            stats.served += 1
            if stats.first_served_at is None:
                stats.first_served_at = self.now

    def servable(self, model: str) -> bool:
        """Admitted shards of live workers cover every layer of `model`."""
        spans = sorted(
            w.serving.layers
            for w in self.workers
            if w.alive and w.verdict == "admitted" and w.serving is not None
            and w.serving.model == model
        )  # fmt: skip
        reached = 0
        for start, end in spans:
            if start > reached:
                return False
            reached = max(reached, end)
        return reached >= self.models[model].num_layers

    def _flush(self) -> None:
        self.loop.call_later(DEMAND_FLUSH_S, self._flush)
        leader = self.raft.leader()
        if leader is None or not self._demand:
            return
        for model, count in sorted(self._demand.items()):
            command = RecordDemand(model, count, self.now)
            if self.raft.propose(encode_command(command), on=leader) is None:
                return  # kept for the next flush
            del self._demand[model]

    def timeline(self) -> list[str]:
        """With `keep_trace`: Raft's traced events and this module's, merged
        in time order (Raft's first at equal times); `trace_digest` covers
        both streams."""
        raft = self.raft.trace_lines or []
        mine = self._lines or []
        return [line for _, _, line in sorted(
            [(float(line.split()[0]), 0, line) for line in raft]
            + [(float(line.split()[0]), 1, line) for line in mine],
            key=lambda item: (item[0], item[1]),
        )]  # fmt: skip

    def _note(self, line: str) -> None:
        text = f"{self.now:.6f} {line}"
        self._trace.update(text.encode() + b"\n")
        if self._lines is not None:
            self._lines.append(text)


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 6)
