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

* **Workers** (the nodes that serve) are not Raft members here. By
  default their membership is an oracle: the leader sees a crash as "dead"
  `detect_s` after it happens (SWIM's detection, simulated for real in
  `simulations.cluster`), and entries route over who is alive in truth.
  With `membership` (a `MembershipConfig`) it is real SWIM instead: a
  `MembershipCluster` on its own network in the same virtual time, whose
  members are the voters (numbered as in Raft), the workers, then the
  entries. The leader's round reads each worker's state and its time from
  the leading voter's own core, each entry routes over the coverage of its
  own core's view (a crashed worker keeps its last record there until that
  view holds it dead; a chain that meets a crashed or unreachable hop is
  routed around it, `rerouted`), and a crash or restart is one in
  membership too. A voter partition splits the membership network as well:
  each voter set on a side, the workers and entries with the largest set,
  and the workers a partition names on a side of their own
  (`cut_off_workers` cuts off workers alone). Either way what a worker
  announces (its shard and its doctor's verdict) and what it reads from
  the ledger travel at once, partitions or not.
* **Cost model**: a worker given a shard loads it at its hardware class's
  bytes per second (`LOAD_BYTES_PER_S`), then runs its doctor for
  `DOCTOR_S`; a worker built with `fails_doctor` fails it, as a node with a
  corrupt copy would.
* **Demand**: chat requests arrive per model as a Poisson process at the
  configured rate, each at one of `ENTRIES` entry nodes (members that serve
  no shard; each has its own latency to every worker, so entries route
  differently, as a real swarm's do). A request is served when the entry
  finds a route (`mesh.routes.find_route`) over the coverage map
  (`mesh.coverage.build_coverage`: admitted shards of live workers, less
  the nodes the ledger holds quarantined); either way it counts as demand,
  flushed to the leader every `DEMAND_FLUSH_S` as the entry nodes'
  batching does.
* **Liars and spot checks** (`runtime.node.spot_check`, issue 18): a served
  request takes `STEPS_PER_REQUEST` decode steps of the route's estimated
  step time, and is *correct* unless some hop lies on some step: a worker
  built with `Lies` lies on each step from `from_s` on with probability
  `rate`. The entry checks a finished request with the policy's
  `verify_fraction`, by a replay of `REPLAY_S`, modelled as honest; the
  first lie (earliest step, then earliest hop) names the accused, as the
  first diverging commitment does. The check is independent evidence only
  when another node serves the accused's exact span; otherwise the request
  is `unchecked`. Evidence makes the entry avoid the accused for
  `DISTRUST_S` at once and reaches the leader, which judges it by one more
  replay (`REPLAY_S`, on a node other than the accused) and commits a guilty
  `consensus.ledger.Verdict` through Raft. From its commit the ledger holds
  the node quarantined: coverage leaves it out of every route and the
  policy releases its managed shard. Entries read the most advanced
  replica's ledger at once (the leader's notice and the pull that follows
  take about a gossip spread, not modelled here); the runtime's bounds on
  pending checks and verdicts are not modelled either. Entries are honest:
  false reports are not modelled.

Availability, recorded as transitions (not samples) and summed in the
metrics: `leadership` changes whenever a voter's role or term changes, a
voter crashes or restarts, or a voter partition starts or heals, and holds
the voter that could commit then (`committing_leader`: it leads the highest
term among live voters and reaches a quorum of them both ways) or None;
`chains` changes whenever coverage's inputs do (a worker loads, passes or
fails its doctor, unloads, crashes or restarts; a quarantine starts or
ends), and holds whether each model has a complete chain (`servable`).
Observing adds no traced event, so the trace digest is what it was.

Invariants, checked as it runs (`violations`) and by `check`: Raft's own
(one leader per term, agreeing committed logs); every replica's ledger
equal at equal applied index; a pinned shard, once recorded, never changes;
every managed assignment a leader proposes goes to a worker its view holds
alive, spare and holding the model; no request is routed through a node
the ledger holds quarantined. (A leader cut off from a quorum keeps
its role until CheckQuorum steps it down, as in the node; what it proposes
meanwhile never commits, which the agreeing ledgers show.) Same seed, same
run: `trace_digest` covers Raft's trace and this module's events (and with
SWIM the membership cores' events).
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, TypeVar

from consensus.ledger import (
    ApplyResult,
    Assign,
    PlacementLedger,
    RecordDemand,
    Release,
    Verdict,
    changed_node,
    encode_command,
)
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
from mesh.config import MembershipConfig
from mesh.coverage import CoverageMap, ModelCoverage, build_coverage
from mesh.fields import one_of
from mesh.member_table import (
    GONE_STATES,
    LIVE_STATES,
    MemberState,
    MemberStateName,
    state_name,
)
from mesh.records import (
    RECIPES,
    TIERS,
    Addresses,
    Assignment,
    BackendKind,
    CapabilityReport,
    NodeRecord,
)
from mesh.routes import Hop, Route, RouteInputs, find_route
from simulations.cluster import MembershipCluster
from simulations.network import NetworkConfig
from simulations.raft_cluster import Proposal, RaftCluster
from simulations.seeds import component_rng, derive_seed

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
DECODE_LAYERS_PER_S: Final[Mapping[str, float]] = {
    "gpu": 32 * 40.0,  # a 7-8B model's 32 layers at ~40 tokens/s on a consumer GPU
    "mac": 32 * 20.0,  # ~20 tokens/s on Apple silicon
    "cpu": 32 * 4.0,  # ~4 tokens/s on a volunteer's CPU
}
"""Decode steps times layers per second, per hardware class: a doctor's
claim for a span is this over its layer count (`decode_tokens_per_s`),
which routes price a hop by."""
ENTRIES: Final = 16
"""Entry nodes the requests arrive at, uniformly. Routes tie-break to the
smallest node ids, so entries that agreed on every latency would all use
one chain; their own latencies (`ENTRY_LATENCY_S`) spread the traffic over
the replicas as clients spread over a real swarm. Sixteen make a worker
that no entry routes through rare: (1 - 1/replicas)**16, 1% at 4 replicas."""
ENTRY_LATENCY_S: Final = (0.005, 0.08)
"""One-way latency from an entry to a worker, uniform in this range per
(entry, worker): a volunteer swarm across a continent, next door to 80 ms."""
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
BACKENDS: Final[Mapping[str, BackendKind]] = {"gpu": "torch", "mac": "mlx", "cpu": "torch"}
"""The backend a hardware class's doctor reports."""
REPORT_EXPIRES_AT: Final = sys.float_info.max
"""A node refreshes its capability report before it expires
(`runtime.node.admission`); the refresh is not simulated, so a simulated
report never expires."""
CHECK_OUTCOMES: Final = ("checked", "clean", "caught", "unchecked", "chain_gone", "not_judged")
"""What became of the spot checks, counted in the metrics: `checked`, the
finished requests an entry picked (a `verify_fraction` of those served);
of these, `clean` (no hop lied), `caught` (a lie, replayed on another node
of the liar's span: evidence for the leader), `unchecked` (a lie, but no
other node serves the liar's span, so no independent replay), `chain_gone`
(a hop left coverage before the replay, as a quarantined liar does: the
runtime finds no variant to replay in); and of the caught, `not_judged`
(no leader, or none could propose, or no other node left to recompute on)."""


@dataclass(frozen=True, slots=True)
class Lies:
    """A worker that returns wrong outputs (a faulty card, a tampered build,
    a cheat saving compute): on each decode step it runs from `from_s` on,
    with probability `rate`."""

    rate: float
    from_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.rate <= 1:
            raise ValueError(f"a liar's rate must be in (0, 1], not {self.rate!r}")
        if not 0 <= self.from_s < math.inf:
            raise ValueError(f"a liar's from_s must be a time >= 0, not {self.from_s!r}")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A node that may serve: its memory, store, hardware, operator pin, and
    whether it lies."""

    memory_gb: float
    models: tuple[str, ...] = ()
    pinned: str | None = None
    """An operator pinned it to the whole of this model (`--model`)."""
    hardware: str = "gpu"
    fails_doctor: bool = False
    lies: Lies | None = None

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
    gossiped: NodeRecord | None = None
    """SWIM, while it is crashed: the record it gossiped last, which members
    keep (and entries route by) until their own core holds it dead."""


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


@dataclass
class LiarStats:
    """What one lying worker did: its first lie, the requests routed
    through it, and the answers it spoiled."""

    first_lie_at: float | None = None
    routed: list[tuple[float, float]] = field(default_factory=list)
    """When each request routed through it started and ended."""
    wrong: int = 0


@dataclass
class _Entry:
    """An entry node: its latency to each worker, and the nodes its own
    checks caught, avoided until a time."""

    node: bytes
    latency_s: dict[bytes, float]
    distrusted: dict[bytes, float] = field(default_factory=dict)
    member: int | None = None
    """Its SWIM member index, whose own view it routes by; None: the oracle."""

    def inputs(self, now: float) -> RouteInputs:
        avoid = frozenset(node for node, until in self.distrusted.items() if until > now)
        return RouteInputs(self.node, latency_s=self.latency_s, avoid=avoid)


@dataclass
class Detection:
    """One worker crash under SWIM, and when the leader's own membership
    core declared the worker dead (None: not before it restarted or the
    run ended)."""

    worker: int
    crashed_at: float
    leader_dead_at: float | None = None


@dataclass(frozen=True)
class _Check:
    """A finished request an entry replays: which, over what route, and
    the hop of its first lie (None: a correct answer)."""

    number: int
    model: str
    entry: _Entry
    route: Route
    lie: int | None


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
        membership: MembershipConfig | None = None,
        keep_trace: bool = False,
    ) -> None:
        self.seed = seed
        self.models = dict(models)
        self.detect_s = detect_s
        self.raft = RaftCluster(voters, seed, network=network, keep_trace=keep_trace)
        self.loop = self.raft.loop
        self.policy = policy or PlacementSettings()
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
        self.answers: list[tuple[float, bool]] = []
        """Every served request: (time, correct)."""
        self.checks: Counter[str] = Counter()
        """Spot checks by outcome (`CHECK_OUTCOMES`)."""
        self.liars = {i: LiarStats() for i, w in enumerate(self.workers) if w.spec.lies is not None}
        self.quarantined_at: dict[int, float] = {}
        """Worker -> when the first guilty verdict against it committed."""
        self._serving = component_rng(seed, "placement", "serving")
        latencies = component_rng(seed, "placement", "entries")
        self._entries = [
            _Entry(
                bytes([0xEE, *i.to_bytes(31, "big")]),
                {w.node: latencies.uniform(*ENTRY_LATENCY_S) for w in self.workers},
            )
            for i in range(ENTRIES)
        ]
        self._digests = {name: hashlib.sha256(name.encode()).hexdigest() for name in self.models}
        self._coverage: tuple[object, CoverageMap] | None = None
        self._seen_coverage: dict[int, tuple[object, CoverageMap]] = {}
        """SWIM: each observer's coverage, as `_coverage` is the truth's."""
        self.swim: MembershipCluster | None = None
        """With `membership`: the real SWIM cores of the voters (members 0 to
        voters - 1, as in Raft), the workers, then the entries, on their own
        network in this run's virtual time; None: the oracle (`detect_s`)."""
        self._members: dict[bytes, int] = {}
        self.detections: list[Detection] = []
        self.rerouted = 0
        """SWIM: requests whose first chain hit a worker down or cut off
        from their entry, and were routed around it."""
        self.live_held_dead_s = 0.0
        """SWIM: worker-seconds the leader's core held a running worker dead
        or left, sampled every placement round."""
        if membership is not None:
            first_entry = voters + len(self.workers)
            self.swim = MembershipCluster(
                first_entry + ENTRIES,
                derive_seed(seed, "placement", "swim"),
                membership,
                network,
                keep_trace=keep_trace,
                loop=self.loop,
            )
            self._members = {w.node: voters + i for i, w in enumerate(self.workers)}
            for i, entry in enumerate(self._entries):
                entry.member = first_entry + i
        self._trace = hashlib.sha256()
        self._lines: list[str] | None = [] if keep_trace else None
        for worker in self.workers:
            if worker.spec.pinned is not None:
                self._load(worker, self._pin(worker.spec.pinned))
        self.leadership: list[tuple[float, int | None, int]] = [(0.0, None, 0)]
        """Every change of the committing leader or of the highest term:
        (time, voter or None, term); see `committing_leader`."""
        self.chains: list[tuple[float, str, bool]] = []
        """Every change of a model's complete chain: (time, model, complete)."""
        self._complete: dict[str, bool] = {}
        self._chains_seen: CoverageMap | None = None
        self.raft.on_role = lambda _voter: self._observe_leader()
        self._observe_chains()
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
        """Crash `worker` at `at` (with SWIM, its membership core too)."""
        self.loop.call_at(at, self._crash, worker)
        if self.swim is not None:
            self.swim.crash(self._members[self.workers[worker].node], at)

    def restart(self, worker: int, at: float) -> None:
        """Restart `worker` at `at` (with SWIM, a fresh core that rejoins)."""
        self.loop.call_at(at, self._restart, worker)
        if self.swim is not None:
            self.swim.restart(self._members[self.workers[worker].node], at)

    def partition_voters(
        self,
        groups: Sequence[Sequence[int]],
        at: float,
        heal: float,
        workers: Collection[int] = (),
    ) -> None:
        """Cut the voters into `groups` from `at` to `heal`. Under the oracle
        workers are unaffected; with SWIM the members' network splits too
        (`_split_members`), `workers` on a side of their own."""
        self._check_cut_off(workers)
        self.raft.network.schedule_partition(groups, at, heal)
        self._split_members(groups, workers, at, heal)
        self._observe_leader_at(at, heal)

    def isolate_leader(self, at: float, heal: float, workers: Collection[int] = ()) -> None:
        """Cut whichever voter leads at `at` off from the others until `heal`
        (nothing happens if none leads then): a scenario cannot know in
        advance which voter its election will pick. With SWIM, as
        `partition_voters`."""
        self._check_cut_off(workers)

        def cut() -> None:
            leader = self.raft.leader()
            if leader is None:
                return
            others = [i for i in range(len(self.ledgers)) if i != leader]
            self._note(f"isolate leader {leader}")
            self.raft.network.schedule_partition([[leader], others], self.now, heal)
            self._split_members([[leader], others], workers, self.now, heal)
            self._observe_leader_at(self.now, heal)

        self.loop.call_at(at, cut)

    def cut_off_workers(self, workers: Collection[int], at: float, heal: float) -> None:
        """SWIM: cut `workers` off from the voters, the entries and the other
        workers from `at` to `heal`; the voters stay together."""
        self._split_members([range(len(self.ledgers))], workers, at, heal)

    def _split_members(
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
        self._check_cut_off(workers)
        if self.swim is None:
            return
        sides = [sorted(set(group)) for group in groups]
        rest = sorted(set(range(len(self.ledgers))).difference(*sides))
        if rest:
            sides.append(rest)
        largest = max(range(len(sides)), key=lambda side: (len(sides[side]), -side))
        cut_off = [self._members[self.workers[w].node] for w in sorted(set(workers))]
        sides[largest] += sorted(set(self._members.values()) - set(cut_off))
        sides[largest] += [entry.member for entry in self._entries if entry.member is not None]
        self.swim.partition([*sides, cut_off] if cut_off else sides, at, heal)

    def _check_cut_off(self, workers: Collection[int]) -> None:
        if workers and self.swim is None:
            raise ValueError("cutting workers off needs SWIM membership (`membership`)")

    # --- observers -------------------------------------------------------------------

    def ledger(self) -> PlacementLedger:
        """The most advanced replica."""
        return max(self.ledgers, key=lambda ledger: ledger.applied_index)

    def committing_leader(self) -> int | None:
        """The voter that could commit now: the leader of the highest term
        among live voters (`RaftCluster.leader`) that reaches a quorum of live
        voters, itself included, both ways over the network as it stands. A
        leader cut off keeps its role until CheckQuorum steps it down, and
        pre-vote keeps the others' term until one can win, so role and term
        alone would hide the first election timeout of an outage."""
        leader = self.raft.leader()
        if leader is None:
            return None
        network, voters = self.raft.network, len(self.ledgers)
        reached = sum(
            1
            for v in range(voters)
            if self.raft.is_up(v)
            and (v == leader or (network.can_reach(leader, v) and network.can_reach(v, leader)))
        )
        return leader if reached > voters // 2 else None

    def leader_spans(self) -> list[tuple[float, float, int | None, int]]:
        """`leadership` as spans up to now: (start, end, voter or None, term)."""
        changes = [(at, (voter, term)) for at, voter, term in self.leadership]
        return [(start, end, *state) for start, end, state in _spans(changes, self.now)]

    def chain_spans(self, model: str) -> list[tuple[float, float, bool]]:
        """`chains` of `model` as spans up to now: (start, end, complete)."""
        return _spans([(at, ok) for at, name, ok in self.chains if name == model], self.now)

    def trace_scenario(self, digest: str) -> None:
        """Put the resolved scenario's digest in the trace (at time 0)."""
        self._note(f"scenario {digest}")

    def trace_digest(self) -> str:
        both = f"{self.raft.trace_digest()} {self._trace.hexdigest()}"
        if self.swim is not None:
            both += f" {self.swim.trace_digest()}"
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
            **self._leadership(),
            "committed": dict(sorted(self.committed.items())),
            "models": {
                name: {
                    "requests": s.requests,
                    "served": s.served,
                    "served_fraction": s.served / s.requests if s.requests else None,
                    "first_request_at": s.first_request_at,
                    "request_to_assigned_s": _since(s.first_request_at, s.first_assigned_at),
                    "request_to_served_s": _since(s.first_request_at, s.first_served_at),
                    "incomplete_chain_s": self._incomplete_chain_s(name),
                }
                for name, s in sorted(self.stats.items())
            },
            "verification": self._verification(),
            **({} if self.swim is None else {"membership": self._membership()}),
            "violations": len(self.violations),
            "trace_digest": self.trace_digest(),
        }

    def _leadership(self) -> dict[str, object]:
        """`leaderless_s`: seconds with no `committing_leader`, from the first
        one on (the bootstrap election is no outage; a run that never had
        one was leaderless throughout). `leader_changes`: leaders that could
        commit after the first, one per (voter, term), so a leader that loses
        and regains its quorum within its term is no change."""
        spans = self.leader_spans()
        first = next((start for start, _, voter, _ in spans if voter is not None), None)
        since = 0.0 if first is None else first
        leaderless = sum((end - start for start, end, voter, _ in spans
                          if voter is None and start >= since), 0.0)  # fmt: skip
        leaders = {(voter, term) for _, _, voter, term in spans if voter is not None}
        return {
            "first_leader_at": first,
            "leaderless_s": round(leaderless, 6),
            "leader_changes": max(0, len(leaders) - 1),
        }

    def _incomplete_chain_s(self, model: str) -> float | None:
        """Seconds from `model`'s first request (before it, nobody is kept
        waiting) to now without a complete chain; None: never requested."""
        since = self.stats[model].first_request_at
        if since is None:
            return None
        spans = self.chain_spans(model)
        return round(sum((end - max(start, since) for start, end, ok in spans
                          if not ok and end > since), 0.0), 6)  # fmt: skip

    def _observe_leader(self) -> None:
        state = (self.committing_leader(), self._top_term())
        if state != self.leadership[-1][1:]:
            self.leadership.append((self.now, *state))

    def _top_term(self) -> int:
        live = [i for i in range(len(self.ledgers)) if self.raft.is_up(i)]
        return max((self.raft.term(i) for i in live), default=0)

    def _observe_leader_at(self, start: float, heal: float) -> None:
        """Observe leadership when a voter partition starts and heals: the
        network switches at those instants (scheduled before these, so these
        run after it)."""
        self.loop.call_at(start, self._observe_leader)
        if math.isfinite(heal):
            self.loop.call_at(heal, self._observe_leader)

    def _observe_chains(self) -> None:
        """Note each model whose complete chain came or went; nothing to do
        while coverage is the one last seen."""
        coverage = self.coverage()
        if coverage is self._chains_seen:
            return
        self._chains_seen = coverage
        for model in sorted(self.models):
            complete = self.servable(model)
            if self._complete.get(model) != complete:
                self._complete[model] = complete
                self.chains.append((self.now, model, complete))

    def _standing_changed(self, voter: int, result: ApplyResult) -> None:
        """A verdict committed: a quarantine may have started, and it ends
        at a time no event marks, so observe chains then too."""
        self._observe_chains()
        node = changed_node(result)
        standing = None if node is None else self.ledgers[voter].quarantined(self.now).get(node)
        if standing is not None and standing.until is not None:
            self.loop.call_at(standing.until, self._observe_chains)

    def _membership(self) -> dict[str, object]:
        """SWIM: what the real membership cores did to placement. Per crash,
        when the leader's core declared the worker dead (`detect_s` from the
        crash); `false_dead`, the voters' "dead" verdicts about workers that
        were neither down nor behind a partition (`MembershipCluster.
        false_positives`); `live_held_dead_s` and `rerouted` (see their
        attributes)."""
        assert self.swim is not None
        voters, workers = len(self.ledgers), set(self._members.values())
        false_dead = [
            verdict
            for verdict in self.swim.false_positives()
            if verdict[1] < voters and verdict[2] in workers
        ]
        return {
            "detections": [
                {
                    "worker": d.worker,
                    "crashed_at": d.crashed_at,
                    "leader_dead_at": d.leader_dead_at,
                    "detect_s": _since(d.crashed_at, d.leader_dead_at),
                }
                for d in self.detections
            ],
            "false_dead": len(false_dead),
            "live_held_dead_s": round(self.live_held_dead_s, 6),
            "rerouted": self.rerouted,
        }

    def _verification(self) -> dict[str, object]:
        """What the spot checks caught and what the clients got (see the
        module doc and `CHECK_OUTCOMES`)."""
        wrong = sum(not correct for _, correct in self.answers)
        served = len(self.answers)
        honest = [i for i in self.quarantined_at if self.workers[i].spec.lies is None]
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
        lies = self.workers[index].spec.lies
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
            "detection_s": _since(stats.first_lie_at, until),
            "requests_until_quarantine": served,
            "wrong_answers": stats.wrong,
        }

    # --- the leader's round (runtime.node.placement_driver._place) -------------------------

    def _round(self) -> None:
        self.loop.call_later(PLACEMENT_INTERVAL_S, self._round)
        if self.swim is not None:
            self._watch_leader()
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
                nodes=self._views(ledger, i),
                models=self.models,
                now=self.now,
                has_quorum=core.leader is not None,
                history=self.histories[i],
            )
            announced = self._announced(i)
            decisions = upkeep(ledger, announced, self.now) or decide(snapshot, self.policy)
            for decision in decisions:
                self._check_decision(snapshot, decision)
                proposal = self.raft.propose(encode_command(decision.command), on=i)
                if proposal is None:
                    break
                leading.proposals.append(proposal)
            leading.until = self.now + PROPOSAL_TIMEOUT_S

    def _views(self, ledger: PlacementLedger, voter: int) -> dict[bytes, NodeView]:
        """What `voter`'s membership and the workers' records tell it."""
        views = {}
        for worker in self.workers:
            state, since = self._seen(voter, worker)
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

    def _announced(self, voter: int) -> dict[bytes, Announced]:
        return {
            w.node: Announced(
                w.serving,
                live=self._seen(voter, w)[0] in LIVE_STATES,
                failure="doctor failed" if w.verdict == "failed" else None,
            )
            for w in self.workers
            if w.serving is not None
        }

    def _seen(self, voter: int, worker: _Worker) -> tuple[MemberStateName, float]:
        """What `voter`'s membership says of `worker`, and since when. The
        oracle sees a crash as "dead" `detect_s` after it; SWIM is the
        voter's own core (`_member_view`)."""
        if self.swim is not None:
            return self._member_view(voter, worker)
        if not worker.alive and self.now >= worker.since + self.detect_s:
            return "dead", worker.since + self.detect_s
        return "alive", worker.since

    def _member_view(self, observer: int, worker: _Worker) -> tuple[MemberStateName, float]:
        """SWIM member `observer`'s own view of `worker`. Every core starts
        knowing every member and forgets a dead one only after
        `reconnect_timeout` (a day), so a run always finds it."""
        assert self.swim is not None
        view = self.swim.membership(observer).member(self.swim.node_id(self._members[worker.node]))
        assert view is not None, f"member {observer} forgot worker {self._index[worker.node]}"
        return state_name(view.state), view.state_since

    def _watch_leader(self) -> None:
        """SWIM, each round: when the leader's core first holds a crashed
        worker dead (`detections`), and how long it holds running workers
        dead (`live_held_dead_s`)."""
        leader = self.raft.leader()
        if leader is None:
            return
        for index, worker in enumerate(self.workers):
            state, since = self._member_view(leader, worker)
            if state not in GONE_STATES:
                continue
            if worker.alive:
                self.live_held_dead_s += PLACEMENT_INTERVAL_S
                continue
            for detection in self.detections:
                pending = detection.leader_dead_at is None and detection.worker == index
                if pending and detection.crashed_at == worker.since:
                    detection.leader_dead_at = max(since, worker.since)

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
        elif isinstance(command, Verdict) and command.guilty:
            self.quarantined_at.setdefault(self._index[command.accused], self.now)
        if isinstance(command, Verdict):
            self._standing_changed(voter, result)

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
            if held is None or held.tier == "operator":
                if worker.serving is not None:
                    worker.serving, worker.verdict = None, "none"
                    self._note(f"unload {self._index[worker.node]}")
                continue
            serving = worker.serving
            shard = (held.model, held.layers, held.recipe, held.tier, held.managed, held.epoch)
            if serving is not None and shard == (
                serving.model,
                serving.layers,
                serving.recipe,
                serving.tier,
                serving.managed,
                serving.epoch,
            ):
                continue  # field by field: an Assignment built every round cost a fifth of a run
            # The ledger checked recipe and tier; one_of narrows their types.
            wanted = Assignment(
                held.model,
                held.layers,
                one_of(held.recipe, "recipe", RECIPES),
                one_of(held.tier, "tier", TIERS),
                held.managed,
                held.epoch,
            )
            self._load(worker, wanted)
        self._observe_chains()

    def _crash(self, index: int) -> None:
        worker = self.workers[index]
        if self.swim is not None and worker.alive:
            self.detections.append(Detection(index, self.now))
            worker.gossiped = self._record(worker)
        worker.alive, worker.since = False, self.now
        worker.serving, worker.verdict = None, "none"
        self._note(f"crash {index}")
        self._observe_chains()

    def _restart(self, index: int) -> None:
        worker = self.workers[index]
        worker.alive, worker.since, worker.gossiped = True, self.now, None
        if worker.spec.pinned is not None:
            self._load(worker, self._pin(worker.spec.pinned))
        self._note(f"restart {index}")
        self._observe_chains()

    # --- demand ----------------------------------------------------------------------

    def _request(self, model: str) -> None:
        stats = self.stats[model]
        stats.requests += 1
        if stats.first_request_at is None:
            stats.first_request_at = self.now
        self._demand[model] += 1
        entry = self._entries[self._serving.randrange(ENTRIES)]
        inputs = entry.inputs(self.now)
        route = self._route(model, inputs, entry.member)
        if route is not None and self.swim is not None:
            route = self._reroute(model, entry, inputs, route)
        self.requests.append((self.now, model, route is not None))
        if route is not None:
            stats.served += 1
            if stats.first_served_at is None:
                stats.first_served_at = self.now
            self._serve(model, entry, route)

    def servable(self, model: str) -> bool:
        """A route over every layer of `model` exists through admitted
        shards of live workers the ledger does not hold quarantined (live
        in truth, whatever any member believes)."""
        return self._route(model, RouteInputs(self._entries[0].node)) is not None

    def _route(self, model: str, inputs: RouteInputs, observer: int | None = None) -> Route | None:
        """The route an entry with `inputs` takes (`mesh.routes`) over the
        coverage of `observer`'s view (`coverage`), or None."""
        variant = self.coverage(observer).best(model)
        found = None if variant is None else find_route(variant, inputs)
        return found if isinstance(found, Route) else None

    def coverage(self, observer: int | None = None) -> CoverageMap:
        """What the entries route over (`mesh.coverage`): each worker's record,
        less the nodes the ledger holds quarantined now. Rebuilt only when a
        worker's state or the quarantined set changed. `observer`: the SWIM
        member whose own view says who is alive, as a runtime node builds it
        from its membership (`runtime.node.swarm_view`); None: the truth,
        which is what the oracle's entries see."""
        if observer is not None:
            return self._coverage_seen_by(observer)
        quarantined = frozenset(self.ledger().quarantined(self.now))
        key = (quarantined, tuple((w.alive, w.serving, w.verdict) for w in self.workers))
        if self._coverage is None or self._coverage[0] != key:
            members = [
                (w.node, MemberState.ALIVE if w.alive else MemberState.DEAD, self._record(w))
                for w in self.workers
            ]
            lengths = {name: facts.num_layers for name, facts in self.models.items()}
            built = build_coverage(members, self.now, lengths, quarantined=quarantined)
            self._coverage = (key, built)
        return self._coverage[1]

    def _coverage_seen_by(self, observer: int) -> CoverageMap:
        """`coverage` by SWIM member `observer`'s view: a worker it holds
        live serves by its record (a crashed one's last, `gossiped`)."""
        quarantined = frozenset(self.ledger().quarantined(self.now))
        states = tuple(self._member_view(observer, w)[0] for w in self.workers)
        said = tuple((w.alive, w.serving, w.verdict, w.gossiped) for w in self.workers)
        key = (quarantined, states, said)
        cached = self._seen_coverage.get(observer)
        if cached is None or cached[0] != key:
            members = [
                (w.node, state, self._record(w) if w.alive else w.gossiped)
                for w, state in zip(self.workers, states, strict=True)
            ]
            lengths = {name: facts.num_layers for name, facts in self.models.items()}
            cached = (key, build_coverage(members, self.now, lengths, quarantined=quarantined))
            self._seen_coverage[observer] = cached
        return cached[1]

    def _reroute(
        self, model: str, entry: _Entry, inputs: RouteInputs, route: Route
    ) -> Route | None:
        """SWIM: the entry's view may still hold a crashed or cut-off worker
        alive. Its chain then fails on that hop and the entry routes around
        it (`runtime.inference.chat`'s reroute: the hop backed off, the
        tokens so far replayed on the new chain), until a chain works or
        none is left; the request counts as `rerouted`."""
        avoid = set(inputs.avoid)
        found: Route | None = route
        while found is not None:
            broken = self._unusable(entry, found)
            if not broken:
                break
            avoid |= broken
            found = self._route(model, replace(inputs, avoid=frozenset(avoid)), entry.member)
        if avoid != set(inputs.avoid):
            self.rerouted += 1
        return found

    def _unusable(self, entry: _Entry, route: Route) -> set[bytes]:
        """Hops of `route` that fail the entry's chain: crashed, or across a
        partition from the entry, which opens a session on every hop and
        gets the token back from the last (`runtime.inference.chain`); each
        side of a placement partition is whole, so hops the entry reaches
        reach each other."""
        assert self.swim is not None and entry.member is not None
        network, at = self.swim.network, entry.member
        return {
            node
            for node in route.node_ids
            if not self.workers[self._index[node]].alive
            or not network.can_reach(at, self._members[node])
            or not network.can_reach(self._members[node], at)
        }

    def _record(self, worker: _Worker) -> NodeRecord:
        """The record a worker gossips: its shard and its doctor's report,
        claiming its hardware class's decode rate for the span."""
        index = self._index[worker.node]
        shard = worker.serving
        capability = None
        if shard is not None and worker.verdict != "none":
            admitted = worker.verdict == "admitted"
            hardware = worker.spec.hardware
            layers = shard.layers[1] - shard.layers[0]
            capability = CapabilityReport(
                result="admitted" if admitted else "failed",
                model=shard.model,
                manifest_digest=self._digests[shard.model],
                layers=shard.layers,
                recipe=shard.recipe,
                backend=BACKENDS[hardware],
                prefill_tokens_per_s=0.0,  # routes price decode steps only
                decode_tokens_per_s=DECODE_LAYERS_PER_S[hardware] / layers,
                validated_at=worker.ready_at,
                expires_at=REPORT_EXPIRES_AT,
                failure=None if admitted else "doctor failed",
                num_layers=self.models[shard.model].num_layers,
            )
        address = f"sim:worker-{index}"
        return NodeRecord(
            Addresses(address, address), worker.since, assignment=shard, capability=capability
        )

    # --- serving and spot checks (runtime.node.spot_check) ---------------------------

    def _serve(self, model: str, entry: _Entry, route: Route) -> None:
        """Run the answer over `route`: note whether a hop lied, and have the
        entry check it with the policy's `verify_fraction`."""
        if not self.ledger().quarantined(self.now).keys().isdisjoint(route.node_ids):
            self.violations.append(f"{self.now:.3f}: a route through a quarantined node")
        lie = self._first_lie(route)
        done = self.now + STEPS_PER_REQUEST * route.cost_s
        self.answers.append((self.now, lie is None))
        for node in route.node_ids:
            liar = self.liars.get(self._index[node])
            if liar is not None:
                liar.routed.append((self.now, done))
        if lie is not None:
            hop, at = lie
            liar = self.liars[self._index[route.hops[hop].node_id]]
            liar.wrong += 1
            if liar.first_lie_at is None or at < liar.first_lie_at:
                liar.first_lie_at = at
        if self._serving.random() < self.policy.verify_fraction:
            self.checks["checked"] += 1
            check = _Check(len(self.answers), model, entry, route, None if lie is None else lie[0])
            self.loop.call_at(done + REPLAY_S, self._spot_check, check)

    def _first_lie(self, route: Route) -> tuple[int, float] | None:
        """The first lie in the answer (hop index, time): the earliest step,
        then the earliest hop, as the first diverging commitment names it.
        Step k runs k estimated step times (`route.cost_s`) after the start."""
        liars = []
        for hop, node in enumerate(route.node_ids):
            lies = self.workers[self._index[node]].spec.lies
            if lies is not None:
                liars.append((hop, lies))
        if not liars:
            return None
        for step in range(STEPS_PER_REQUEST):
            at = self.now + step * route.cost_s
            for hop, lies in liars:
                if at >= lies.from_s and self._serving.random() < lies.rate:
                    return hop, at
        return None

    def _spot_check(self, check: _Check) -> None:
        """The entry's replay has run: act on the first lie, when another node
        of the liar's span replayed it (see `CHECK_OUTCOMES`)."""
        variant = self.coverage(check.entry.member).best(check.model)
        serving = set() if variant is None else {n.node_id for n in variant.nodes}
        if variant is None or not serving.issuperset(check.route.node_ids):
            self.checks["chain_gone"] += 1
            return
        if check.lie is None:
            self.checks["clean"] += 1
            return
        accused = check.route.hops[check.lie]
        worker = self._index[accused.node_id]
        if not _replicated(variant, accused):
            self.checks["unchecked"] += 1
            self._note(f"unchecked lie of {worker}")
            return
        self.checks["caught"] += 1
        check.entry.distrusted[accused.node_id] = self.now + DISTRUST_S
        self._note(f"caught {worker}")
        self.loop.call_later(REPLAY_S, self._judge, check)

    def _judge(self, check: _Check) -> None:
        """The leader's recomputation has run, on another node of the
        accused's span: it finds the accused's step wrong (the check did),
        and the leader proposes a guilty verdict."""
        assert check.lie is not None
        accused = check.route.hops[check.lie]
        leader = self.raft.leader()
        observer = None if self.swim is None or leader is None else leader
        variant = self.coverage(observer).best(check.model)
        if leader is None or variant is None or not _replicated(variant, accused):
            self.checks["not_judged"] += 1
            return
        evidence = hashlib.sha256(f"evidence for answer {check.number}".encode()).digest()
        verdict = Verdict(accused.node_id, check.entry.node, evidence, guilty=True, at=self.now)
        if self.raft.propose(encode_command(verdict), on=leader) is None:
            self.checks["not_judged"] += 1

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
        """With `keep_trace`: Raft's traced events, this module's and (with
        SWIM) the membership cores' as `swim OBSERVER KIND SUBJECT N`, merged
        in time order (in that order at equal times); `trace_digest` covers
        every stream."""
        raft = self.raft.trace_lines or []
        mine = self._lines or []
        swim = [] if self.swim is None else self.swim.trace_lines or []
        return [line for _, _, line in sorted(
            [(float(line.split()[0]), 0, line) for line in raft]
            + [(float(line.split()[0]), 1, line) for line in mine]
            + [(float(line.split(" ", 1)[0]), 2, line.replace(" ", " swim ", 1)) for line in swim],
            key=lambda item: (item[0], item[1]),
        )]  # fmt: skip

    def _note(self, line: str) -> None:
        text = f"{self.now:.6f} {line}"
        self._trace.update(text.encode() + b"\n")
        if self._lines is not None:
            self._lines.append(text)


def _replicated(variant: ModelCoverage, hop: Hop) -> bool:
    """Another node of `variant` serves exactly `hop`'s span: a replay of the
    span there is independent of the hop."""
    return any(n.layers == hop.layers and n.node_id != hop.node_id for n in variant.nodes)


State = TypeVar("State")


def _spans(changes: Sequence[tuple[float, State]], end: float) -> list[tuple[float, float, State]]:
    """Changes (time, state) in time order as the spans each state held
    until the next change or `end`. A state that held for no time (two
    changes at one instant) is left out, and so neighbours that agree merge."""
    spans: list[tuple[float, float, State]] = []
    for number, (start, state) in enumerate(changes):
        until = changes[number + 1][0] if number + 1 < len(changes) else end
        if until <= start:
            continue
        if spans and spans[-1][2] == state:
            start = spans.pop()[0]
        spans.append((start, until, state))
    return spans


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 6)
