"""The placement policy: which Assign and Release commands the leader proposes next.

ADR-0026 (docs/adr/0026-node-assignment-ownership.md) is the contract:
pinned (operator and bootstrap) work is never touched, managed placements go
only onto spare capacity, and a managed node moves to another model only
under the safety policy. The leader calls `decide` (and `upkeep`) whenever
its inputs change and proposes what they return; the ledger re-checks every
command at apply time. It is a pure function of the ledger, membership's
view, the model facts, the failure history and `now`: the same input gives
the same decisions in the same order. The numbered rules, the demand rate
and what counts as spare, admitted and loading are in docs/design/placement.md.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Literal, Protocol

from consensus.commands import Assign, Command, MarkAdmissionFailed, Release
from consensus.ledger import PINNED_TIERS, Demand, LedgerAssignment, PlacementLedger
from consensus.settings import PlacementSettings
from mesh.identity import node_id_text
from mesh.member_table import LIVE_STATES, MemberState, MemberStateName
from mesh.records import RECIPES, Assignment, CapabilityReport, NodeRecord

__all__ = [
    "AdmissionFailures",
    "Announced",
    "CapabilityState",
    "Decision",
    "GapSuggestion",
    "MemberState",
    "ModelFacts",
    "NodeView",
    "PlacementHistory",
    "PlacementInput",
    "PlacementSettings",
    "Shard",
    "WaitReason",
    "best_gap",
    "capability_state",
    "decide",
    "demand_rate",
    "explain",
    "node_view",
    "upkeep",
]

CapabilityState = Literal["admitted", "failed", "none"]
WaitReason = Literal[
    "serving",
    "no_leader",
    "no_demand",
    "loading",
    "admission_failed",
    "no_spare_capacity",
    "unknown_model",
]

# Decision codes: fixed strings, so the status API and metrics can count them.
CODE_NODE_LEFT: Final = "node_left"
CODE_NODE_DEAD: Final = "node_dead"
CODE_QUARANTINED: Final = "quarantined"
CODE_ADMISSION_FAILED: Final = "admission_failed"
CODE_IDLE: Final = "idle"
CODE_DEMAND_GAP: Final = "demand_gap"
CODE_RELOCATE: Final = "relocate"
CODE_RETARGET: Final = "retarget"
CODE_HOT_COPY: Final = "hot_copy"
CODE_PINNED: Final = "pinned"
CODE_OPERATOR_RELOAD: Final = "operator_reload"

WAIT_MESSAGES: Final[Mapping[str, str]] = MappingProxyType(
    {
        "serving": "the model is served by admitted nodes",
        "no_leader": "no placement leader with a quorum is known; placement resumes once one is",
        "no_demand": "nobody has asked for this model recently, so nothing is placed for it",
        "loading": "nodes are assigned to every missing layer and are loading or running doctor",
        "admission_failed": "a node assigned to this model failed admission; trying another",
        "no_spare_capacity": "no spare node with this model and enough memory can cover the gaps",
        "unknown_model": "no node knows this model's size (no manifest has been seen)",
    }
)
"""Human text per `explain` reason, for the 503 `model_loading` body and status."""


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What placement must know about a model to size shards (from its manifest)."""

    num_layers: int
    layer_bytes: int
    """Weight bytes of one transformer layer at `recipe`."""
    overhead_bytes: int = 0
    """Fixed bytes every shard needs besides its layers: embeddings or LM head
    (counted for every shard, since the policy does not know yet which end a
    node will get), KV cache headroom and runtime overhead."""
    recipe: str = "bf16"
    """The recipe managed placements of this model use."""

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.layer_bytes < 1 or self.overhead_bytes < 0:
            raise ValueError("need num_layers >= 1, layer_bytes >= 1, overhead_bytes >= 0")
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r}")

    def max_layers(self, memory_bytes: int) -> int:
        """How many consecutive layers fit in `memory_bytes` (0: none)."""
        return max(
            0, min(self.num_layers, (memory_bytes - self.overhead_bytes) // self.layer_bytes)
        )


@dataclass(frozen=True, slots=True)
class NodeView:
    """What membership and the node's signed record say about one node."""

    state: MemberStateName
    """SWIM's verdict."""
    state_since: float | None = None
    """When membership entered `state` (the dead grace counts from it); None:
    unknown, and then a dead node's managed assignment is kept."""
    memory_bytes: int = 0
    """Backend memory (0 when the record has no backend: nothing fits)."""
    models: frozenset[str] = frozenset()
    """Model names in the node's local store (`--models STORE`)."""
    spare: bool = False
    """The node offers capacity for managed placement: its record holds no
    pinned assignment (model-less, or a managed one). With one slot per node
    a pinned record is never spare."""
    capability: CapabilityState = "none"
    """Its capability report about its live ledger assignment: admitted
    (routable), failed, or none (absent, stale or about another shard)."""


@dataclass(frozen=True, slots=True)
class AdmissionFailures:
    """How often a node failed admission for one model, and when it last did."""

    count: int
    last_at: float


@dataclass(frozen=True, slots=True)
class PlacementInput:
    """Everything `decide` reads. Build it with `from_ledger` in a driver."""

    now: float
    has_quorum: bool
    """The caller is a leader that can commit: False on a minority side of a
    partition (CheckQuorum lost) or with no known leader; then no decisions."""
    assignments: Mapping[bytes, LedgerAssignment]
    epochs: Mapping[bytes, int]
    """The ledger's highest epoch per node; a new Assign uses the next one."""
    demand: Mapping[str, Demand]
    nodes: Mapping[bytes, NodeView]
    models: Mapping[str, ModelFacts]
    failures: Mapping[tuple[bytes, str], AdmissionFailures] = field(default_factory=dict)
    released_at: Mapping[bytes, float] = field(default_factory=dict)
    """When each node's managed assignment was last released (cooldown)."""
    quarantined: frozenset[bytes] = frozenset()
    """The nodes the ledger holds quarantined at `now`: they serve nothing
    and are assigned nothing ("quarantine" in the module doc)."""

    @classmethod
    def from_ledger(
        cls,
        ledger: PlacementLedger,
        *,
        nodes: Mapping[bytes, NodeView],
        models: Mapping[str, ModelFacts],
        now: float,
        has_quorum: bool,
        history: PlacementHistory | None = None,
    ) -> PlacementInput:
        """The input for the ledger's current state and the driver's views."""
        assignments = {a.node: a for a in ledger.assignments()}
        epochs = {node: ledger.epoch(node) for node in set(assignments) | set(nodes)}
        return cls(
            now=now,
            has_quorum=has_quorum,
            assignments=assignments,
            epochs=epochs,
            demand=ledger.demand(),
            nodes=nodes,
            models=models,
            failures=history.failures if history else {},
            released_at=history.released_at if history else {},
            quarantined=frozenset(ledger.quarantined(now)),
        )


class PlacementHistory:
    """What the ledger forgets but the policy needs: failure counts and release times.

    Feed it every *accepted* committed command (`ApplyResult.command` when
    `accepted`). Every replica applies the same commands, so every replica's
    history agrees and a new leader continues the same back-offs; one rebuilt
    from a ledger snapshot starts empty, which only shortens back-offs. It
    holds at most one entry per (node, model) and per node.
    """

    def __init__(self) -> None:
        self.failures: dict[tuple[bytes, str], AdmissionFailures] = {}
        self.released_at: dict[bytes, float] = {}

    def observe(self, command: Command) -> None:
        """Account for one accepted command."""
        if isinstance(command, MarkAdmissionFailed):
            key = (command.node, command.model)
            old = self.failures.get(key)
            self.failures[key] = AdmissionFailures(
                1 if old is None else old.count + 1,
                command.at if old is None else max(old.last_at, command.at),
            )
        elif isinstance(command, Release):
            self.released_at[command.node] = command.at


@dataclass(frozen=True, slots=True)
class Decision:
    """One command for the leader to propose, and why (for status and logs)."""

    command: Assign | Release | MarkAdmissionFailed
    code: str
    reason: str


@dataclass(frozen=True, slots=True)
class Announced:
    """What a member's signed record says about its shard (`upkeep`'s input)."""

    assignment: Assignment
    live: bool
    """Membership holds the member alive or suspect."""
    failure: str | None = None
    """Its doctor's report about this assignment failed, saying why; None:
    no failed report (admitted, absent, or about another shard)."""


@dataclass(frozen=True, slots=True)
class GapSuggestion:
    """`best_gap`'s answer: the shard a joining node should take."""

    model: str
    layers: tuple[int, int]
    recipe: str
    demand_per_min: float


def demand_rate(demand: Demand | None, now: float, window_s: float) -> float:
    """Requests per minute, decayed (formula and reasoning in the module doc)."""
    if demand is None:
        return 0.0
    span = max(demand.last_at - demand.first_at, window_s)
    decay = math.exp(-max(0.0, now - demand.last_at) / window_s)
    return 60.0 * demand.count / span * decay


class Shard(Protocol):
    """What a capability report must be about: a ledger or a record assignment."""

    @property
    def model(self) -> str: ...
    @property
    def layers(self) -> tuple[int, int]: ...
    @property
    def recipe(self) -> str: ...


def capability_state(
    report: CapabilityReport | None, shard: Shard | None, now: float
) -> CapabilityState:
    """The one definition of *admitted*: a report about exactly `shard`
    (model, layers, recipe) that is admitted and unexpired at wall-clock
    `now`. A report for another shard proves nothing about this one, so it
    counts as none; a failed one about this shard is `failed`."""
    if report is None or shard is None:
        return "none"
    if (report.model, report.layers, report.recipe) != (shard.model, shard.layers, shard.recipe):
        return "none"
    if report.result == "failed":
        return "failed"
    return "admitted" if report.expires_at > now else "none"


def node_view(
    state: MemberStateName,
    state_since: float | None,
    record: NodeRecord | None,
    assignment: LedgerAssignment | None,
    now: float,
) -> NodeView:
    """A `NodeView` from membership's verdict, the node's record and its ledger assignment."""
    if record is None:
        return NodeView(state, state_since)
    capability = capability_state(record.capability, assignment, now)
    held = record.assignment
    return NodeView(
        state=state,
        state_since=state_since,
        memory_bytes=0 if record.backend is None else record.backend.memory_bytes,
        models=frozenset(record.models),
        spare=held is None or held.managed,
        capability=capability,
    )


# --- internals ----------------------------------------------------------------


def _short(node: bytes) -> str:
    return node_id_text(node)[:12]


def _spans_below(replicas: list[int], level: int) -> list[tuple[int, int]]:
    """Maximal runs of layers with fewer than `level` replicas."""
    spans: list[tuple[int, int]] = []
    start = -1
    for index, count in enumerate(replicas):
        if count < level:
            if start < 0:
                start = index
        elif start >= 0:
            spans.append((start, index))
            start = -1
    if start >= 0:
        spans.append((start, len(replicas)))
    return spans


def _backed_off(failures: AdmissionFailures | None, now: float, policy: PlacementSettings) -> bool:
    if failures is None:
        return False
    wait = policy.admission_backoff_s * 2.0 ** min(failures.count - 1, 62)
    return now - failures.last_at < min(wait, policy.max_admission_backoff_s)


class _Pool:
    """Candidate nodes for one model, as (capacity in layers, node id), sorted."""

    __slots__ = ("entries",)

    def __init__(self, entries: list[tuple[int, bytes]]) -> None:
        entries.sort()
        self.entries = entries

    def pick(self, need: int, usable: Callable[[bytes], bool]) -> tuple[int, bytes] | None:
        """The smallest usable node holding `need` layers (lowest id among equals),
        else the largest usable node (lowest id among equals), else None."""
        entries = self.entries
        split = bisect_left(entries, (need, b""))
        for index in range(split, len(entries)):
            if usable(entries[index][1]):
                return entries[index]
        best: tuple[int, bytes] | None = None
        for index in range(split - 1, -1, -1):
            entry = entries[index]
            if best is not None and entry[0] < best[0]:
                break
            if usable(entry[1]):
                best = entry  # scanning down: the last hit of a capacity has the lowest id
        return best


def _cover(
    spans: list[tuple[int, int]],
    pools: Iterable[_Pool],
    usable: Callable[[bytes], bool],
    take: Callable[[bytes], None],
) -> tuple[list[tuple[bytes, tuple[int, int]]], bool]:
    """Cover `spans` from `pools` in order (rule "cover" in the module doc).

    Returns the picks and whether every span was covered; `take` has been
    called for each pick either way, so the caller can undo a failed attempt.
    """
    picks: list[tuple[bytes, tuple[int, int]]] = []
    remaining = sorted(spans, key=lambda span: (span[0] - span[1], span[0]))
    for pool in pools:
        left: list[tuple[int, int]] = []
        for start, end in remaining:
            while start < end:
                entry = pool.pick(end - start, usable)
                if entry is None:
                    break
                stop = min(end, start + entry[0])
                take(entry[1])
                picks.append((entry[1], (start, stop)))
                start = stop
            if start < end:
                left.append((start, end))
        remaining = left
        if not remaining:
            break
    return picks, not remaining


@dataclass(slots=True)
class _Model:
    """Per-model working state for one round."""

    name: str
    facts: ModelFacts
    rate: float
    admitted: list[int]
    planned: list[int]
    dead_spans: list[tuple[int, int]] = field(default_factory=list)
    failed: bool = False


@dataclass(slots=True)
class _Plan:
    decisions: list[Decision]
    status: dict[str, str]


def _replicas(deltas: list[int]) -> list[int]:
    out: list[int] = []
    running = 0
    for delta in deltas[:-1]:
        running += delta
        out.append(running)
    return out


def _coverage(
    snapshot: PlacementInput, released: set[bytes], policy: PlacementSettings
) -> dict[str, _Model]:
    """Admitted and planned (admitted or loading) replicas per layer, per known model."""
    admitted: dict[str, list[int]] = {}
    planned: dict[str, list[int]] = {}
    dead: dict[str, list[tuple[int, int]]] = {}
    failed: set[str] = set()
    for node, assignment in snapshot.assignments.items():
        facts = snapshot.models.get(assignment.model)
        # A quarantined node serves nothing, pinned or not: its layers are gaps.
        if facts is None or node in released or node in snapshot.quarantined:
            if assignment.admission_failed_at is not None:
                failed.add(assignment.model)
            continue
        view = snapshot.nodes.get(node)
        start, end = assignment.layers
        end = min(end, facts.num_layers)
        if start >= end:
            continue
        if view is None or view.state not in LIVE_STATES:
            dead.setdefault(assignment.model, []).append((start, end))
            continue
        if assignment.admission_failed_at is not None or view.capability == "failed":
            failed.add(assignment.model)
            continue
        length = facts.num_layers + 1
        if view.capability == "admitted":
            deltas = admitted.setdefault(assignment.model, [0] * length)
            deltas[start] += 1
            deltas[end] -= 1
        deltas = planned.setdefault(assignment.model, [0] * length)
        deltas[start] += 1
        deltas[end] -= 1
    now = snapshot.now
    for (_node, model), record in snapshot.failures.items():
        if _backed_off(record, now, policy):
            failed.add(model)
    out: dict[str, _Model] = {}
    for name, facts in snapshot.models.items():
        zeros = [0] * (facts.num_layers + 1)
        out[name] = _Model(
            name=name,
            facts=facts,
            rate=demand_rate(snapshot.demand.get(name), now, policy.demand_window_s),
            admitted=_replicas(admitted.get(name, zeros)),
            planned=_replicas(planned.get(name, zeros)),
            dead_spans=sorted(dead.get(name, [])),
            failed=name in failed,
        )
    return out


def _release_code(
    assignment: LedgerAssignment,
    view: NodeView | None,
    snapshot: PlacementInput,
    policy: PlacementSettings,
) -> str | None:
    """Rules 2, 2b, 3 and 4 for one managed assignment (None: keep it)."""
    now = snapshot.now
    if view is not None and view.state == MemberState.LEFT:
        return CODE_NODE_LEFT
    if (
        view is not None
        and view.state == MemberState.DEAD
        and view.state_since is not None
        and now - view.state_since >= policy.dead_grace_s
    ):
        return CODE_NODE_DEAD
    if assignment.node in snapshot.quarantined:
        return CODE_QUARANTINED
    if assignment.admission_failed_at is not None:
        return CODE_ADMISSION_FAILED
    demand = snapshot.demand.get(assignment.model)
    last = assignment.assigned_at if demand is None else max(assignment.assigned_at, demand.last_at)
    if now - last >= policy.idle_release_s:
        return CODE_IDLE
    return None


_RELEASE_TEXT: Final[Mapping[str, str]] = MappingProxyType(
    {
        CODE_NODE_LEFT: "the node left the swarm",
        CODE_NODE_DEAD: "the node has been dead past the grace period",
        CODE_QUARANTINED: "the node is quarantined (proven wrong output or false reports)",
        CODE_ADMISSION_FAILED: "the node failed admission (doctor); backing it off for this model",
        CODE_IDLE: "no demand for the model within the idle-release time",
    }
)


def _plan(snapshot: PlacementInput, policy: PlacementSettings) -> _Plan:
    """The decisions of one round and every model's waiting reason."""
    now = snapshot.now
    decisions: list[Decision] = []
    released: set[bytes] = set()
    if snapshot.has_quorum:
        for node in sorted(snapshot.assignments):
            assignment = snapshot.assignments[node]
            if assignment.pinned:
                continue  # rule 1
            code = _release_code(assignment, snapshot.nodes.get(node), snapshot, policy)
            if code is not None:
                released.add(node)
                decisions.append(
                    Decision(
                        Release(node, assignment.model, assignment.epoch, code, now),
                        code,
                        f"release {assignment.model} from {_short(node)}: {_RELEASE_TEXT[code]}",
                    )
                )
    models = _coverage(snapshot, released, policy)
    fresh = {
        name
        for name, demand in snapshot.demand.items()
        if now - demand.last_at < policy.idle_release_s
    }
    if snapshot.has_quorum:
        _Placer(snapshot, policy, models, released, decisions).run(
            sorted((models[n] for n in fresh if n in models), key=lambda m: (-m.rate, m.name))
        )
    status: dict[str, str] = {}
    for name in sorted(set(snapshot.models) | set(snapshot.demand)):
        model = models.get(name)
        if model is not None and min(model.admitted) > 0:
            status[name] = "serving"
        elif not snapshot.has_quorum:
            status[name] = "no_leader"
        elif name not in fresh:
            status[name] = "no_demand"
        elif model is None:
            status[name] = "unknown_model"
        elif min(model.planned) > 0:
            status[name] = "loading"
        elif model.failed:
            status[name] = "admission_failed"
        else:
            status[name] = "no_spare_capacity"
    return _Plan(decisions, status)


class _Placer:
    """Rules 5-7 for one round: builds the candidate pools once, then places."""

    def __init__(
        self,
        snapshot: PlacementInput,
        policy: PlacementSettings,
        models: dict[str, _Model],
        released: set[bytes],
        decisions: list[Decision],
    ) -> None:
        self.snapshot = snapshot
        self.policy = policy
        self.models = models
        self.decisions = decisions
        self.used: set[bytes] = set(released)
        self.spare = self._spare_pools()
        self.movable: dict[str, list[bytes]] | None = None  # rule 6's candidates, built lazily
        self.moving: dict[bytes, LedgerAssignment] = {}

    def _spare_pools(self) -> dict[str, list[tuple[int, bytes]]]:
        """Eligible spare nodes per model (the "spare" definition in the module doc)."""
        snapshot, policy, models = self.snapshot, self.policy, self.models
        now = snapshot.now
        assigned = snapshot.assignments
        released_at = snapshot.released_at
        failures = snapshot.failures
        pools: dict[str, list[tuple[int, bytes]]] = {}
        for node, view in snapshot.nodes.items():
            if view.state != MemberState.ALIVE or not view.spare or node in assigned:
                continue
            if node in snapshot.quarantined:
                continue
            last_release = released_at.get(node)
            if last_release is not None and now - last_release < policy.release_cooldown_s:
                continue
            for name in view.models:
                model = models.get(name)
                if model is None:
                    continue
                capacity = model.facts.max_layers(view.memory_bytes)
                if capacity and not _backed_off(failures.get((node, name)), now, policy):
                    pools.setdefault(name, []).append((capacity, node))
        return pools

    def _movable(self) -> dict[str, list[bytes]]:
        """Rule 6's static part, per target model: managed, alive, not failed,
        older than the cooldown, the target in the node's store."""
        if self.movable is None:
            snapshot, policy = self.snapshot, self.policy
            self.movable = {}
            for node in sorted(snapshot.assignments):
                assignment = snapshot.assignments[node]
                view = snapshot.nodes.get(node)
                if (
                    assignment.pinned
                    or node in self.used
                    or view is None
                    or view.state != MemberState.ALIVE
                    or assignment.admission_failed_at is not None
                    or view.capability == "failed"
                    or assignment.model not in self.models
                    or assignment.layers[1] > self.models[assignment.model].facts.num_layers
                    or not snapshot.now - assignment.assigned_at > policy.cooldown_s
                ):
                    continue
                self.moving[node] = assignment
                for name in view.models:
                    if name != assignment.model:
                        self.movable.setdefault(name, []).append(node)
        return self.movable

    def _copies_after(self, node: bytes) -> int:
        """Admitted copies of the node's current model if it moved away."""
        assignment = self.moving[node]
        model = self.models[assignment.model]
        admitted = model.admitted
        if self.snapshot.nodes[node].capability != "admitted":
            return min(admitted)
        start, end = assignment.layers
        outside = min(admitted[:start] + admitted[end:], default=math.inf)
        return int(min(outside, min(admitted[start:end]) - 1))

    def _shift(self, node: bytes, delta: int) -> None:
        """Move a retarget candidate out of (-1) or back into (+1) its model's counts."""
        assignment = self.moving.get(node)
        if assignment is None:
            return
        model = self.models[assignment.model]
        counted = [model.planned]
        if self.snapshot.nodes[node].capability == "admitted":
            counted.append(model.admitted)
        start, end = assignment.layers
        for replicas in counted:
            for index in range(start, min(end, len(replicas))):
                replicas[index] += delta

    def _attempt(self, model: _Model, level: int, retarget: bool) -> bool:
        """All-or-nothing cover of `model`'s layers below `level` replicas."""
        spans = _spans_below(model.planned, level)
        if not spans:
            return True
        pools = [_Pool(self.spare.get(model.name, []))]
        policy = self.policy
        if retarget:
            entries = []
            for node in self._movable().get(model.name, []):
                old = self.models[self.moving[node].model]
                if model.rate > 0 and model.rate >= policy.retarget_demand_ratio * old.rate:
                    capacity = model.facts.max_layers(self.snapshot.nodes[node].memory_bytes)
                    if capacity:
                        entries.append((capacity, node))
            pools.append(_Pool(entries))
        used = self.used
        moving = self.moving

        def usable(node: bytes) -> bool:
            if node in used:
                return False
            return node not in moving or self._copies_after(node) >= policy.min_copies_left

        def take(node: bytes) -> None:
            used.add(node)
            self._shift(node, -1)

        picks, complete = _cover(spans, pools, usable, take)
        if not complete:
            for node, _span in picks:
                used.discard(node)
                self._shift(node, +1)
            return False
        for node, span in picks:
            self._assign(model, node, span, level)
        return True

    def _assign(self, model: _Model, node: bytes, span: tuple[int, int], level: int) -> None:
        snapshot = self.snapshot
        now = snapshot.now
        old = self.moving.get(node)
        if old is not None:
            code = CODE_RETARGET
            why = (
                f"retarget from {old.model} (safety policy: demand {model.rate:.2f}/min vs "
                f"{self.models[old.model].rate:.2f}/min, {old.model} keeps >= "
                f"{self.policy.min_copies_left} copies, cooldown passed)"
            )
        elif level > 1:
            code = CODE_HOT_COPY
            why = f"copy {level} for demand {model.rate:.2f}/min"
        elif any(s < span[1] and span[0] < e for s, e in model.dead_spans):
            code = CODE_RELOCATE
            why = "a dead node's span is a gap (dropout relocation)"
        else:
            code = CODE_DEMAND_GAP
            why = f"gap with demand {model.rate:.2f}/min"
        epoch = max(snapshot.epochs.get(node, 0), old.epoch if old else 0) + 1
        for index in range(span[0], span[1]):
            model.planned[index] += 1
        self.decisions.append(
            Decision(
                Assign(node, model.name, span, model.facts.recipe, "managed", True, epoch, now),
                code,
                f"place {model.name} layers [{span[0]}, {span[1]}) on {_short(node)}: {why}",
            )
        )

    def run(self, demanded: list[_Model]) -> None:
        """Rules 5 and 6 for every demanded model, then rule 7 level by level."""
        done = {m.name for m in demanded if self._attempt(m, 1, retarget=False)}
        done |= {m.name for m in demanded if m.name not in done and self._attempt(m, 1, True)}
        complete = [m for m in demanded if m.name in done]
        for level in range(2, self.policy.max_copies + 1):
            for model in complete:
                wanted = 1 + int(model.rate // self.policy.requests_per_copy_per_min)
                if min(wanted, self.policy.max_copies) >= level:
                    self._attempt(model, level, retarget=False)


# --- public API -----------------------------------------------------------------


def upkeep(
    ledger: PlacementLedger, announced: Mapping[bytes, Announced], now: float
) -> list[Decision]:
    """What the leader commits before it decides, so that `decide` sees a
    ledger that agrees with what the members announce:

    * the shards live members were pinned to by their operator (ADR-0026's
      tiers live in the ledger): recorded, after releasing the node's older
      entry when the operator restarted it with another shard
      (`operator_reload`);
    * `MarkAdmissionFailed` for a managed assignment whose node reports a
      failed doctor for it, so the policy releases it and tries another node.
    """
    decisions = []
    for node in sorted(announced):
        wanted = announced[node].assignment
        if not announced[node].live or wanted.tier not in PINNED_TIERS:
            continue
        held = ledger.assignment(node)
        shard = (wanted.model, wanted.layers, wanted.recipe, wanted.tier)
        if held is not None and (held.model, held.layers, held.recipe, held.tier) == shard:
            continue
        if held is not None:
            release = Release(node, held.model, held.epoch, CODE_OPERATOR_RELOAD, now)
            decisions.append(
                Decision(release, CODE_OPERATOR_RELOAD, "the operator restarted the node")
            )
        assign = Assign(
            node, wanted.model, wanted.layers, wanted.recipe, wanted.tier, False,
            ledger.epoch(node) + 1, now,
        )  # fmt: skip
        decisions.append(Decision(assign, CODE_PINNED, f"the node was started with {wanted.model}"))
    for held in ledger.assignments():
        about = announced.get(held.node)
        if not held.managed or held.admission_failed_at is not None or about is None:
            continue
        said = about.assignment
        if about.failure is None or (said.model, said.layers, said.epoch) != (
            held.model,
            held.layers,
            held.epoch,
        ):
            continue
        mark = MarkAdmissionFailed(held.node, held.model, held.epoch, now)
        decisions.append(Decision(mark, CODE_ADMISSION_FAILED, about.failure))
    return decisions


def decide(snapshot: PlacementInput, policy: PlacementSettings | None = None) -> list[Decision]:
    """The commands to propose now (rules in the module doc), releases first.

    Empty without a quorum (rule 0). Deterministic: the same input gives the
    same list in the same order.
    """
    if not snapshot.has_quorum:
        return []
    return _plan(snapshot, policy or PlacementSettings()).decisions


def explain(snapshot: PlacementInput, policy: PlacementSettings | None = None) -> dict[str, str]:
    """Why each known or demanded model is (not) servable, as a `WaitReason` code.

    Computed after this round's decisions, so a model that `decide` is about to
    place reads "loading". `WAIT_MESSAGES` has the human text for each code.
    """
    return _plan(snapshot, policy or PlacementSettings()).status


def best_gap(
    snapshot: PlacementInput, node: NodeView, policy: PlacementSettings | None = None
) -> GapSuggestion | None:
    """The bootstrap suggestion for a joining node (`POST /v1/network/assign`).

    Among the models in the node's store, the gap (layers no serving or loading
    node holds) with the largest demand-weighted size — layers it can take
    times the model's demand rate — then the most layers, then model name and
    start. The span starts at the gap's start and is as long as the node's
    memory allows. None when no gap fits: the node is then best left spare.
    """
    policy = policy or PlacementSettings()
    models = _coverage(snapshot, set(), policy)
    best: tuple[tuple[float, int, str, int], GapSuggestion] | None = None
    for name in node.models:
        model = models.get(name)
        capacity = 0 if model is None else model.facts.max_layers(node.memory_bytes)
        if model is None or not capacity:
            continue
        for start, end in _spans_below(model.planned, 1):
            take = min(end - start, capacity)
            key = (-take * model.rate, -take, name, start)
            if best is None or key < best[0]:
                best = (
                    key,
                    GapSuggestion(name, (start, start + take), model.facts.recipe, model.rate),
                )
    return None if best is None else best[1]
