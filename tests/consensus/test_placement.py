"""The placement policy (consensus/placement.py) as scenarios, boundaries and properties.

`Swarm` states a scenario the way the leader's driver sees it: the ledger's
assignments and demand, membership's view of every node, and the model
facts. Its node ids order like their numbers, so "lowest id" reads plainly.
The simulation at the end applies every decision to a real `PlacementLedger`
through the command codec, as the Raft state machine would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consensus.commands import (
    Assign,
    MarkAdmissionFailed,
    RecordDemand,
    Release,
    Verdict,
    decode_command,
    encode_command,
)
from consensus.ledger import Demand, LedgerAssignment, PlacementLedger
from consensus.placement import (
    WAIT_MESSAGES,
    AdmissionFailures,
    Announced,
    CapabilityState,
    Decision,
    GapSuggestion,
    MemberState,
    ModelFacts,
    NodeView,
    PlacementHistory,
    PlacementInput,
    PlacementSettings,
    best_gap,
    decide,
    demand_rate,
    explain,
    node_view,
    upkeep,
)
from mesh.records import Addresses, Assignment, BackendInfo, CapabilityReport, NodeRecord

GB = 1 << 30
POLICY = PlacementSettings()
NOW = 100_000.0
X, Y = "model-x", "model-y"
FACTS = {X: ModelFacts(num_layers=8, layer_bytes=GB), Y: ModelFacts(num_layers=8, layer_bytes=GB)}
"""One GB per layer and no overhead: a node's memory in GB is the layers it holds."""
OLD = NOW - POLICY.cooldown_s - 1
"""An assignment time past the cooldown (and within the idle time of fresh demand)."""


def nid(i: int) -> bytes:
    return bytes([i]) * 32


def fresh(count: int = 1, *, span_s: float = 0.0) -> Demand:
    """Demand whose last request is now: its rate is exactly 60 * count / max(span, window)."""
    return Demand(count, NOW - span_s, NOW)


@dataclass
class Swarm:
    nodes: dict[bytes, NodeView] = field(default_factory=dict)
    assignments: dict[bytes, LedgerAssignment] = field(default_factory=dict)
    demand: dict[str, Demand] = field(default_factory=dict)
    failures: dict[tuple[bytes, str], AdmissionFailures] = field(default_factory=dict)
    released_at: dict[bytes, float] = field(default_factory=dict)
    models: dict[str, ModelFacts] = field(default_factory=lambda: dict(FACTS))
    quarantined: set[bytes] = field(default_factory=set)

    def spare(self, i: int, *models: str, gb: int = 8, state: MemberState = "alive") -> bytes:
        node = nid(i)
        self.nodes[node] = NodeView(state, NOW - 1000, gb * GB, frozenset(models), True)
        return node

    def assigned(
        self,
        i: int,
        model: str,
        layers: tuple[int, int] = (0, 8),
        *,
        tier: str = "managed",
        capability: CapabilityState = "admitted",
        state: MemberState = "alive",
        state_since: float = NOW - 1000,
        at: float = OLD,
        failed_at: float | None = None,
        store: tuple[str, ...] = (),
        gb: int = 8,
        epoch: int = 1,
    ) -> bytes:
        node = nid(i)
        managed = tier == "managed"
        self.assignments[node] = LedgerAssignment(
            node, model, layers, "bf16", tier, managed, epoch, at, failed_at
        )
        models = frozenset({model, *store})
        self.nodes[node] = NodeView(state, state_since, gb * GB, models, managed, capability)
        return node

    def input(self, now: float = NOW, *, has_quorum: bool = True) -> PlacementInput:
        return PlacementInput(
            now=now,
            has_quorum=has_quorum,
            assignments=dict(self.assignments),
            epochs={n: a.epoch for n, a in self.assignments.items()},
            demand=dict(self.demand),
            nodes=dict(self.nodes),
            models=dict(self.models),
            failures=dict(self.failures),
            released_at=dict(self.released_at),
            quarantined=frozenset(self.quarantined),
        )

    def decide(self, now: float = NOW, policy: PlacementSettings = POLICY) -> list[Decision]:
        return decide(self.input(now), policy)

    def explain(self, now: float = NOW, policy: PlacementSettings = POLICY) -> dict[str, str]:
        return explain(self.input(now), policy)


def assigns(decisions: list[Decision]) -> list[tuple[bytes, str, tuple[int, int], str]]:
    return [
        (d.command.node, d.command.model, d.command.layers, d.code)
        for d in decisions
        if isinstance(d.command, Assign)
    ]


def releases(decisions: list[Decision]) -> list[tuple[bytes, str, str]]:
    return [
        (d.command.node, d.command.model, d.command.reason)
        for d in decisions
        if isinstance(d.command, Release)
    ]


# --- demand placement (ADR-0026's acceptance scenario) -------------------------------------


def test_demand_places_a_managed_assignment_on_the_model_less_node() -> None:
    """Node A pinned to X, node B model-less with Y in its store: demand for Y goes to B."""
    swarm = Swarm()
    a = swarm.assigned(1, X, tier="operator")
    b = swarm.spare(2, Y)
    swarm.demand[Y] = fresh()
    assert swarm.explain()[Y] == "loading"  # decided this round: B is about to load

    decisions = swarm.decide()

    assert len(decisions) == 1
    command = decisions[0].command
    assert command == Assign(b, Y, (0, 8), "bf16", "managed", True, 1, NOW)
    assert decisions[0].code == "demand_gap"
    assert Y in decisions[0].reason
    assert a not in {d.command.node for d in decisions}
    assert swarm.explain()[X] == "serving"


def test_loading_assignment_is_not_placed_twice() -> None:
    swarm = Swarm()
    swarm.assigned(2, Y, capability="none", at=NOW - 5)
    swarm.spare(3, Y)
    swarm.demand[Y] = fresh()
    assert swarm.decide() == []
    assert swarm.explain()[Y] == "loading"


def test_gaps_are_covered_with_the_fewest_nodes() -> None:
    swarm = Swarm()
    swarm.spare(1, Y, gb=4)
    swarm.spare(2, Y, gb=8)
    swarm.spare(3, Y, gb=2)
    swarm.demand[Y] = fresh()
    assert assigns(swarm.decide()) == [(nid(2), Y, (0, 8), "demand_gap")]


def test_a_gap_wider_than_any_node_takes_the_largest_then_the_smallest_that_fits() -> None:
    swarm = Swarm()
    swarm.spare(1, Y, gb=5)
    swarm.spare(2, Y, gb=5)
    swarm.spare(3, Y, gb=3)
    swarm.spare(4, Y, gb=4)
    swarm.demand[Y] = fresh()
    assert assigns(swarm.decide()) == [
        (nid(1), Y, (0, 5), "demand_gap"),  # largest; lowest id of the two 5s
        (nid(3), Y, (5, 8), "demand_gap"),  # the smallest that takes the rest
    ]


def test_only_gaps_are_filled_next_to_existing_coverage() -> None:
    swarm = Swarm()
    swarm.assigned(1, Y, (0, 3), tier="bootstrap")
    swarm.assigned(2, Y, (6, 8), tier="operator")
    swarm.spare(3, Y)
    swarm.demand[Y] = fresh()
    assert assigns(swarm.decide()) == [(nid(3), Y, (3, 6), "demand_gap")]


def test_equal_candidates_go_to_the_lowest_node_id() -> None:
    swarm = Swarm()
    for i in (9, 4, 7):
        swarm.spare(i, Y)
    swarm.demand[Y] = fresh()
    assert assigns(swarm.decide()) == [(nid(4), Y, (0, 8), "demand_gap")]


@pytest.mark.parametrize(
    ("why", "node"),
    [
        ("model not in its store", NodeView("alive", 0.0, 8 * GB, frozenset({X}), True)),
        ("no memory for a layer", NodeView("alive", 0.0, GB - 1, frozenset({Y}), True)),
        ("suspect", NodeView("suspect", 0.0, 8 * GB, frozenset({Y}), True)),
        ("dead", NodeView("dead", 0.0, 8 * GB, frozenset({Y}), True)),
        ("its record pins a model", NodeView("alive", 0.0, 8 * GB, frozenset({Y}), False)),
    ],
)
def test_ineligible_nodes_are_not_spare_capacity(why: str, node: NodeView) -> None:
    swarm = Swarm()
    swarm.nodes[nid(2)] = node
    swarm.demand[Y] = fresh()
    assert swarm.decide() == [], why
    assert swarm.explain()[Y] == "no_spare_capacity"


def test_all_or_nothing_when_the_spare_pool_cannot_close_every_gap() -> None:
    swarm = Swarm()
    swarm.spare(1, Y, gb=4)
    swarm.spare(2, Y, gb=3)
    swarm.demand[Y] = fresh()
    assert swarm.decide() == []
    assert swarm.explain()[Y] == "no_spare_capacity"


def test_no_spare_capacity_touches_no_pinned_node_and_says_so() -> None:
    swarm = Swarm()
    swarm.assigned(1, X, tier="operator", store=(Y,))
    swarm.assigned(2, X, tier="bootstrap", store=(Y,))
    swarm.demand[Y] = fresh(10_000)
    assert swarm.decide() == []
    reason = swarm.explain()[Y]
    assert reason == "no_spare_capacity"
    assert "spare" in WAIT_MESSAGES[reason]


def test_no_demand_places_nothing() -> None:
    swarm = Swarm()
    swarm.spare(1, Y)
    assert swarm.decide() == []
    assert swarm.explain()[Y] == "no_demand"


def test_demand_for_a_model_nobody_can_size() -> None:
    swarm = Swarm()
    swarm.demand["mystery"] = fresh()
    assert swarm.decide() == []
    assert swarm.explain()["mystery"] == "unknown_model"


# --- pinned assignments ----------------------------------------------------------------


def test_pinned_assignments_are_never_released_whatever_their_state() -> None:
    swarm = Swarm()
    swarm.assigned(1, X, tier="operator", state="dead", state_since=0.0)
    swarm.assigned(2, X, tier="bootstrap", state="left")
    swarm.assigned(3, X, tier="operator", failed_at=NOW - 1, capability="failed")
    swarm.assigned(4, Y, tier="bootstrap", at=0.0)  # idle for a day
    swarm.demand[X] = Demand(1, 0.0, 0.0)
    assert swarm.decide() == []


# --- failed admission ---------------------------------------------------------------------


def test_failed_admission_is_released_and_another_spare_node_tried() -> None:
    swarm = Swarm()
    failed = swarm.assigned(2, Y, capability="failed", at=NOW - 30, failed_at=NOW - 10)
    swarm.spare(3, Y)
    swarm.demand[Y] = fresh()

    decisions = swarm.decide()

    assert releases(decisions) == [(failed, Y, "admission_failed")]
    assert assigns(decisions) == [(nid(3), Y, (0, 8), "demand_gap")]
    assert isinstance(decisions[0].command, Release)  # releases come first


def test_failed_node_is_backed_off_exponentially_for_that_model_only() -> None:
    swarm = Swarm()
    node = swarm.spare(2, X, Y)
    swarm.demand[Y] = fresh()
    swarm.failures[(node, Y)] = AdmissionFailures(1, NOW - 59)
    assert swarm.decide() == []
    assert swarm.explain()[Y] == "admission_failed"
    swarm.failures[(node, Y)] = AdmissionFailures(1, NOW - 60)
    assert assigns(swarm.decide()) == [(node, Y, (0, 8), "demand_gap")]

    swarm.failures[(node, Y)] = AdmissionFailures(2, NOW - 119)  # second failure: 120 s
    assert swarm.decide() == []
    swarm.failures[(node, Y)] = AdmissionFailures(30, NOW - 3600)  # capped at an hour
    assert len(swarm.decide()) == 1

    swarm.failures[(node, Y)] = AdmissionFailures(1, NOW - 1)
    swarm.demand[X] = fresh()
    assert assigns(swarm.decide()) == [(node, X, (0, 8), "demand_gap")]


def test_recently_released_node_rests_before_a_new_assignment() -> None:
    swarm = Swarm()
    node = swarm.spare(2, Y)
    swarm.demand[Y] = fresh()
    swarm.released_at[node] = NOW - POLICY.release_cooldown_s + 1
    assert swarm.decide() == []
    swarm.released_at[node] = NOW - POLICY.release_cooldown_s
    assert len(swarm.decide()) == 1


def test_history_counts_failures_and_releases_from_committed_commands() -> None:
    history = PlacementHistory()
    node = nid(2)
    history.observe(MarkAdmissionFailed(node, Y, 1, 10.0))
    history.observe(MarkAdmissionFailed(node, Y, 3, 50.0))
    history.observe(Release(node, Y, 3, "admission_failed", 51.0))
    history.observe(RecordDemand(Y, 1, 52.0))
    assert history.failures == {(node, Y): AdmissionFailures(2, 50.0)}
    assert history.released_at == {node: 51.0}


# --- upkeep: what the leader records before it decides ------------------------------------


def announced(
    model: str, tier: str, epoch: int = 0, live: bool = True, failure: str | None = None
) -> Announced:
    record = Assignment(model, (0, 8), "bf16", tier, tier == "managed", epoch)  # type: ignore[arg-type]
    return Announced(record, live, failure)


def commit_all(ledger: PlacementLedger, decisions: list[Decision]) -> None:
    for decision in decisions:
        result = ledger.apply(ledger.applied_index + 1, encode_command(decision.command))
        assert result.accepted, result


def test_upkeep_records_pinned_shards_once_and_a_reload_releases_the_old_one() -> None:
    ledger = PlacementLedger()
    first = upkeep(
        ledger, {nid(1): announced(X, "operator"), nid(2): announced(Y, "bootstrap")}, NOW
    )
    assert [(d.code, type(d.command), d.command.node) for d in first] == [
        ("pinned", Assign, nid(1)),
        ("pinned", Assign, nid(2)),
    ]
    commit_all(ledger, first)
    assert ledger.assignment(nid(2)).tier == "bootstrap"  # type: ignore[union-attr]
    # Recorded: nothing more to do while the records say the same.
    assert upkeep(ledger, {nid(1): announced(X, "operator")}, NOW) == []
    # The operator restarted node 1 with Y: the old entry goes, the new one comes.
    reload = upkeep(ledger, {nid(1): announced(Y, "operator")}, NOW + 1)
    assert [d.code for d in reload] == ["operator_reload", "pinned"]
    commit_all(ledger, reload)
    held = ledger.assignment(nid(1))
    assert held is not None and held.model == Y and held.epoch == 2
    # A member that is not alive or suspect is not recorded.
    assert upkeep(PlacementLedger(), {nid(3): announced(X, "operator", live=False)}, NOW) == []


def test_upkeep_marks_a_managed_assignment_whose_own_doctor_failed() -> None:
    ledger = PlacementLedger()
    commit_all(
        ledger,
        [Decision(Assign(nid(4), Y, (0, 8), "bf16", "managed", True, 3, NOW), "demand_gap", "")],
    )
    # A failed report about another epoch (an older placement) is no reason.
    assert (
        upkeep(ledger, {nid(4): announced(Y, "managed", 2, failure="digest_mismatch")}, NOW) == []
    )
    assert upkeep(ledger, {nid(4): announced(Y, "managed", 3)}, NOW) == []  # not failed
    marks = upkeep(ledger, {nid(4): announced(Y, "managed", 3, live=False, failure="x")}, NOW)
    assert [(d.code, d.reason, type(d.command)) for d in marks] == [
        ("admission_failed", "x", MarkAdmissionFailed)
    ]
    commit_all(ledger, marks)
    assert upkeep(ledger, {nid(4): announced(Y, "managed", 3, failure="x")}, NOW) == []  # once


# --- hot copies and idle release ------------------------------------------------------------


def test_hot_models_get_extra_copies_bounded_by_max_copies() -> None:
    swarm = Swarm()
    swarm.assigned(1, Y, tier="operator")
    for i in range(2, 10):
        swarm.spare(i, Y)
    swarm.demand[Y] = fresh(100)  # 20 requests a minute over the 5-minute window: 2 copies
    assert assigns(swarm.decide()) == [(nid(2), Y, (0, 8), "hot_copy")]
    swarm.demand[Y] = fresh(10_000)  # far beyond: capped at max_copies
    assert [a[0] for a in assigns(swarm.decide())] == [nid(2), nid(3), nid(4)]


def test_every_model_gets_its_second_copy_before_any_gets_a_third() -> None:
    swarm = Swarm()
    swarm.assigned(1, X, tier="operator")
    swarm.assigned(2, Y, tier="operator")
    swarm.spare(3, X, Y)
    swarm.spare(4, X, Y)
    swarm.demand[X] = fresh(1000)
    swarm.demand[Y] = fresh(300)
    assert {(a[1], a[3]) for a in assigns(swarm.decide())} == {(X, "hot_copy"), (Y, "hot_copy")}


def test_idle_managed_assignments_are_released() -> None:
    swarm = Swarm()
    node = swarm.assigned(2, Y, at=NOW - 5000)
    swarm.demand[Y] = Demand(5, NOW - 9000, NOW - POLICY.idle_release_s)
    assert releases(swarm.decide()) == [(node, Y, "idle")]
    swarm.demand[Y] = Demand(5, NOW - 9000, NOW - POLICY.idle_release_s + 1)
    assert swarm.decide() == []


def test_a_fresh_placement_is_not_idle_even_if_its_demand_is_old() -> None:
    swarm = Swarm()
    swarm.assigned(2, Y, at=NOW - 10)
    swarm.demand[Y] = Demand(5, 0.0, NOW - POLICY.idle_release_s - 10)
    assert swarm.decide() == []


# --- the safety policy at each boundary ---------------------------------------------------


def retarget_swarm(copies: int, *, a_count: int = 100, b_count: int = 200, age: float = 0.0,
                   tier: str = "managed") -> Swarm:  # fmt: skip
    """`copies` admitted copies of X on nodes 1..copies that also hold Y; no spare nodes;
    demand for both (last request now, same span) so the rates' ratio is exact."""
    swarm = Swarm()
    for i in range(1, copies + 1):
        at = NOW - (age or POLICY.cooldown_s + 1)
        swarm.assigned(i, X, tier=tier, store=(Y,), at=at, epoch=i)
    swarm.demand[X] = fresh(a_count)
    swarm.demand[Y] = fresh(b_count)
    return swarm


def test_retarget_when_the_old_model_keeps_three_copies() -> None:
    decisions = retarget_swarm(4).decide()
    assert assigns(decisions) == [(nid(1), Y, (0, 8), "retarget")]
    command = decisions[0].command
    assert isinstance(command, Assign) and command.managed and command.epoch == 2
    assert "safety policy" in decisions[0].reason


def test_no_retarget_when_the_old_model_would_keep_two_copies() -> None:
    swarm = retarget_swarm(3)
    assert swarm.decide() == []
    assert swarm.explain()[Y] == "no_spare_capacity"


def test_retarget_counts_copies_per_layer() -> None:
    """Layers 0-4 of X have four copies, layers 4-8 three: a full-span node
    would leave two copies of 4-8, so only the node holding [0, 4) can go."""
    swarm = retarget_swarm(3)
    swarm.assigned(5, X, (0, 4), store=(Y,), at=OLD, epoch=5)
    swarm.models[Y] = ModelFacts(num_layers=4, layer_bytes=GB)
    decided = assigns(swarm.decide())
    assert len(decided) == 1 and decided[0][0] == nid(5)


@pytest.mark.parametrize(("b_count", "moves"), [(149, False), (150, True)])
def test_retarget_demand_ratio_boundary(b_count: int, moves: bool) -> None:
    """1.49x the old model's demand is not enough, 1.5x is."""
    swarm = retarget_swarm(4, a_count=100, b_count=b_count)
    a = demand_rate(swarm.demand[X], NOW, POLICY.demand_window_s)
    b = demand_rate(swarm.demand[Y], NOW, POLICY.demand_window_s)
    assert b / a == pytest.approx(b_count / 100)
    assert bool(swarm.decide()) is moves


@pytest.mark.parametrize(
    ("age", "moves"),
    [(POLICY.cooldown_s - 1, False), (POLICY.cooldown_s, False), (POLICY.cooldown_s + 1, True)],
)
def test_retarget_cooldown_boundary(age: float, moves: bool) -> None:
    """The assignment must be older than the cooldown."""
    assert bool(retarget_swarm(4, age=age).decide()) is moves


@pytest.mark.parametrize("tier", ["operator", "bootstrap"])
def test_pinned_nodes_are_never_retargeted(tier: str) -> None:
    assert retarget_swarm(6, tier=tier, a_count=1, b_count=10_000).decide() == []


def test_spare_nodes_are_used_before_retargeting() -> None:
    swarm = retarget_swarm(4)
    swarm.spare(9, Y)
    assert assigns(swarm.decide()) == [(nid(9), Y, (0, 8), "demand_gap")]


def test_retargets_stop_when_the_next_would_break_the_copies_floor() -> None:
    """Y needs two nodes (4 layers each); X has four copies, so only one can move."""
    swarm = Swarm()
    for i in range(1, 5):
        swarm.assigned(i, X, store=(Y,), gb=4, layers=(0, 4), epoch=i)
    swarm.models[X] = ModelFacts(num_layers=4, layer_bytes=GB)
    swarm.demand[X] = fresh(100)
    swarm.demand[Y] = fresh(1000)
    assert swarm.decide() == []  # all or nothing: one move alone cannot serve Y
    swarm.assigned(5, X, store=(Y,), gb=4, layers=(0, 4), epoch=5)
    assert [a[0] for a in assigns(swarm.decide())] == [nid(1), nid(2)]


# --- dropout relocation ---------------------------------------------------------------------


def test_dead_nodes_span_is_refilled_from_spare_nodes_only() -> None:
    swarm = Swarm()
    swarm.assigned(1, X, (0, 4), tier="operator")
    dead_pinned = swarm.assigned(2, X, (4, 8), tier="operator", state="dead")
    swarm.assigned(3, Y, tier="managed", store=(X,))  # busy with Y: not a candidate
    spare = swarm.spare(4, X)
    swarm.demand[X] = fresh()
    swarm.demand[Y] = fresh()
    decisions = swarm.decide()
    assert assigns(decisions) == [(spare, X, (4, 8), "relocate")]
    assert dead_pinned not in {d.command.node for d in decisions}


def test_managed_assignment_on_a_dead_node_is_released_after_the_grace() -> None:
    swarm = Swarm()
    since = NOW - POLICY.dead_grace_s
    node = swarm.assigned(2, Y, state="dead", state_since=since + 1)
    swarm.demand[Y] = fresh()
    assert swarm.decide() == []
    swarm.nodes[node] = replace(swarm.nodes[node], state_since=since)
    assert releases(swarm.decide()) == [(node, Y, "node_dead")]
    swarm.nodes[node] = replace(swarm.nodes[node], state="left", state_since=NOW)
    assert releases(swarm.decide()) == [(node, Y, "node_left")]


# --- quarantine ------------------------------------------------------------------------------


def test_a_quarantined_managed_node_is_released_and_its_span_refilled() -> None:
    swarm = Swarm()
    liar = swarm.assigned(2, Y, (0, 4))
    swarm.assigned(3, Y, (4, 8))
    spare = swarm.spare(4, Y)
    swarm.demand[Y] = fresh()
    assert swarm.decide() == []
    swarm.quarantined.add(liar)
    decisions = swarm.decide()
    assert releases(decisions) == [(liar, Y, "quarantined")]
    assert assigns(decisions) == [(spare, Y, (0, 4), "demand_gap")]
    assert "quarantined" in decisions[0].reason


def test_a_quarantined_node_is_never_spare_capacity() -> None:
    swarm = Swarm()
    swarm.quarantined.add(swarm.spare(2, Y))
    swarm.demand[Y] = fresh()
    assert swarm.decide() == []
    assert swarm.explain()[Y] == "no_spare_capacity"
    swarm.quarantined.clear()  # its quarantine ended
    assert assigns(swarm.decide()) == [(nid(2), Y, (0, 8), "demand_gap")]


@pytest.mark.parametrize("tier", ["operator", "bootstrap"])
def test_a_quarantined_pinned_node_keeps_its_pin_but_its_layers_are_a_gap(tier: str) -> None:
    """ADR-0026: pinned work is the operator's; coverage keeps the node out of
    every route, so placement must not count it as serving either."""
    swarm = Swarm()
    pinned = swarm.assigned(1, X, (0, 8), tier=tier)
    spare = swarm.spare(2, X)
    swarm.demand[X] = fresh()
    assert swarm.decide() == [] and swarm.explain()[X] == "serving"
    swarm.quarantined.add(pinned)
    decisions = swarm.decide()
    assert releases(decisions) == []
    assert assigns(decisions) == [(spare, X, (0, 8), "demand_gap")]
    assert pinned not in {d.command.node for d in decisions}
    joiner = NodeView("alive", memory_bytes=4 * GB, models=frozenset({X}), spare=True)
    gap = best_gap(swarm.input(), joiner, POLICY)  # a joiner is offered the pinned span
    assert gap is not None and (gap.model, gap.layers) == (X, (0, 4))


def test_a_quarantined_node_is_not_retargeted_to_another_model() -> None:
    swarm = Swarm()
    for i in range(1, 5):
        swarm.assigned(i, X, store=(Y,))  # four copies of X: one could move to Y
    swarm.demand[X] = fresh(1)
    swarm.demand[Y] = fresh(100)
    assert {d.code for d in swarm.decide()} == {"retarget"}
    swarm.quarantined = {nid(1), nid(2), nid(3), nid(4)}
    decisions = swarm.decide()
    assert {d.code for d in decisions} == {"quarantined"} and not assigns(decisions)


def test_the_input_reads_the_ledgers_quarantines_at_its_now() -> None:
    ledger = PlacementLedger()
    verdict = Verdict(nid(2), nid(3), b"\x05" * 32, True, NOW)
    assert ledger.apply(1, encode_command(verdict)).accepted
    until = ledger.quarantine(nid(2)).until  # type: ignore[union-attr]
    during = PlacementInput.from_ledger(ledger, nodes={}, models={}, now=NOW, has_quorum=True)
    assert during.quarantined == {nid(2)}
    after = PlacementInput.from_ledger(ledger, nodes={}, models={}, now=until, has_quorum=True)
    assert after.quarantined == frozenset()


# --- quorum, explain, best_gap ----------------------------------------------------------------


def test_a_leader_without_quorum_decides_nothing() -> None:
    swarm = Swarm()
    swarm.spare(2, Y)
    swarm.assigned(3, X, failed_at=NOW - 1)
    swarm.demand[Y] = fresh()
    assert decide(swarm.input(has_quorum=False), POLICY) == []
    assert explain(swarm.input(has_quorum=False), POLICY)[Y] == "no_leader"


def test_explain_covers_every_reason_with_a_message() -> None:
    swarm = Swarm()
    swarm.assigned(1, X, tier="operator")
    swarm.demand["mystery"] = fresh()
    assert swarm.explain() == {X: "serving", Y: "no_demand", "mystery": "unknown_model"}
    assert {"serving", "no_demand", "unknown_model", "loading", "no_leader",
            "admission_failed", "no_spare_capacity"} <= set(WAIT_MESSAGES)  # fmt: skip


def test_best_gap_is_the_largest_demand_weighted_gap_that_fits() -> None:
    swarm = Swarm()
    swarm.assigned(1, X, (0, 2), tier="operator")
    swarm.demand[X] = fresh(1)
    swarm.demand[Y] = fresh(50)
    joining = NodeView("alive", None, 3 * GB, frozenset({X, Y}), True)
    assert best_gap(swarm.input(), joining, POLICY) == GapSuggestion(
        Y, (0, 3), "bf16", pytest.approx(10.0)
    )
    only_x = replace(joining, models=frozenset({X}))
    assert best_gap(swarm.input(), only_x, POLICY) == GapSuggestion(
        X, (2, 5), "bf16", pytest.approx(0.2)
    )
    assert best_gap(swarm.input(), replace(joining, memory_bytes=GB - 1), POLICY) is None


def test_best_gap_without_demand_still_suggests_the_largest_gap() -> None:
    swarm = Swarm()
    swarm.assigned(1, X, (0, 6), tier="operator")
    joining = NodeView("alive", None, 8 * GB, frozenset({X, Y}), True)
    assert best_gap(swarm.input(), joining, POLICY) == GapSuggestion(Y, (0, 8), "bf16", 0.0)
    swarm.assigned(2, Y, tier="operator")
    assert best_gap(swarm.input(), joining, POLICY) == GapSuggestion(X, (6, 8), "bf16", 0.0)
    swarm.assigned(3, X, (6, 8), tier="operator")
    assert best_gap(swarm.input(), joining, POLICY) is None


def test_demand_rate_is_windowed_and_decays() -> None:
    window = POLICY.demand_window_s
    assert demand_rate(None, NOW, window) == 0.0
    assert demand_rate(fresh(1), NOW, window) == pytest.approx(60 / window)
    assert demand_rate(fresh(600, span_s=600), NOW, window) == pytest.approx(60.0)
    later = demand_rate(fresh(1), NOW + window, window)
    assert later == pytest.approx(60 / window / math.e)


def test_node_view_from_a_record() -> None:
    assignment = LedgerAssignment(nid(1), Y, (0, 4), "bf16", "managed", True, 3, 0.0)

    def report(
        result: str = "admitted", layers: tuple[int, int] = (0, 4), expires: float = NOW + 60
    ):
        return CapabilityReport(
            result, Y, "ab", layers, "bf16", "torch", 1.0, 1.0, NOW - 10, expires,
            None if result == "admitted" else "logits off",
        )  # fmt: skip

    def record(capability: CapabilityReport | None, tier: str | None = "managed") -> NodeRecord:
        held = None if tier is None else Assignment(Y, (0, 4), "bf16", tier, tier == "managed", 3)
        return NodeRecord(
            Addresses("tcp://a:1", "tcp://a:2"), 0.0, BackendInfo("torch", "cpu", 4 * GB),
            held, capability, (X, Y),
        )  # fmt: skip

    view = node_view("alive", 5.0, record(report()), assignment, NOW)
    assert view == NodeView("alive", 5.0, 4 * GB, frozenset({X, Y}), True, "admitted")
    assert node_view("alive", 5.0, record(report("failed")), assignment, NOW).capability == "failed"
    assert (
        node_view("alive", 5.0, record(report(layers=(0, 2))), assignment, NOW).capability == "none"
    )
    assert (
        node_view("alive", 5.0, record(report(expires=NOW)), assignment, NOW).capability == "none"
    )
    assert node_view("alive", 5.0, record(None, tier="operator"), None, NOW).spare is False
    assert node_view("alive", 5.0, record(None, tier=None), None, NOW).spare is True
    assert node_view("dead", None, None, None, NOW) == NodeView("dead", None)


# --- properties over random snapshots ------------------------------------------------------


MODEL_NAMES = ("m0", "m1", "m2")


@st.composite
def snapshots(draw: st.DrawFn) -> PlacementInput:
    models = {
        name: ModelFacts(num_layers=draw(st.integers(1, 8)), layer_bytes=GB)
        for name in MODEL_NAMES[: draw(st.integers(1, len(MODEL_NAMES)))]
    }
    names = [*sorted(models), "unknown"]
    now = 10_000.0
    nodes: dict[bytes, NodeView] = {}
    assignments: dict[bytes, LedgerAssignment] = {}
    failures: dict[tuple[bytes, str], AdmissionFailures] = {}
    released_at: dict[bytes, float] = {}
    for i in range(draw(st.integers(0, 16))):
        node = nid(i + 1)
        kind = draw(st.sampled_from(["none", "none", "operator", "bootstrap", "managed"]))
        store = frozenset(draw(st.lists(st.sampled_from(names), min_size=1, max_size=3)))
        if kind != "none":
            model = draw(st.sampled_from(names))
            start = draw(st.integers(0, 7))
            end = draw(st.integers(start + 1, 8))
            failed_at = draw(st.none() | st.floats(now - 500, now))
            at = draw(st.floats(now - 5000, now))
            epoch = draw(st.integers(1, 5))
            assignments[node] = LedgerAssignment(
                node, model, (start, end), "bf16", kind, kind == "managed", epoch, at, failed_at
            )
            store |= {model}
        nodes[node] = NodeView(
            state=draw(st.sampled_from(["alive", "alive", "alive", "suspect", "dead", "left"])),
            state_since=draw(st.none() | st.floats(now - 500, now)),
            memory_bytes=draw(st.integers(0, 9)) * GB,
            models=store,
            spare=kind in ("none", "managed") and draw(st.booleans() | st.just(True)),
            capability=draw(st.sampled_from(["admitted", "admitted", "none", "failed"])),
        )
        if draw(st.integers(0, 3)) == 0:
            failures[(node, draw(st.sampled_from(names)))] = AdmissionFailures(
                draw(st.integers(1, 4)), draw(st.floats(now - 500, now))
            )
        if draw(st.integers(0, 4)) == 0:
            released_at[node] = draw(st.floats(now - 100, now))
    quarantined = frozenset(n for n in nodes if draw(st.integers(0, 5)) == 0)
    demand = {}
    for name in draw(st.lists(st.sampled_from(names), min_size=1, unique=True)):
        last = draw(st.floats(now - 600, now) | st.floats(now - 3000, now))
        demand[name] = Demand(draw(st.integers(1, 5000)), last - draw(st.floats(0, 900)), last)
    return PlacementInput(
        now=now,
        has_quorum=draw(st.booleans() | st.just(True)),
        assignments=assignments,
        epochs={n: a.epoch + draw(st.integers(0, 2)) for n, a in assignments.items()},
        demand=demand,
        nodes=nodes,
        models=models,
        failures=failures,
        released_at=released_at,
        quarantined=quarantined,
    )


def check_decisions(snapshot: PlacementInput, decisions: list[Decision]) -> None:
    """The invariants every round must keep, whatever the input."""
    if not snapshot.has_quorum:
        assert decisions == []
    seen_assign: set[bytes] = set()
    released: set[bytes] = set()
    for decision in decisions:
        command = decision.command
        live = snapshot.assignments.get(command.node)
        assert live is None or not live.pinned, "a pinned node appeared in a decision"
        if isinstance(command, Release):
            assert live is not None and live.managed and command.epoch == live.epoch
            assert command.model == live.model and command.node not in released
            released.add(command.node)
            continue
        assert command.node not in seen_assign, "two assignments for one node in a round"
        assert command.node not in released
        assert command.node not in snapshot.quarantined, "assigned a quarantined node"
        seen_assign.add(command.node)
        view = snapshot.nodes[command.node]
        facts = snapshot.models[command.model]
        assert command.tier == "managed" and command.managed
        assert view.state == "alive" and command.model in view.models
        assert 0 <= command.layers[0] < command.layers[1] <= facts.num_layers
        assert facts.max_layers(view.memory_bytes) >= command.layers[1] - command.layers[0]
        assert command.epoch > snapshot.epochs.get(command.node, 0)
        if live is None:
            assert view.spare, "placed onto a node that is not spare capacity"
        else:
            assert decision.code == "retarget" and live.model != command.model
            assert snapshot.now - live.assigned_at > POLICY.cooldown_s
            old = demand_rate(snapshot.demand.get(live.model), snapshot.now, 300.0)
            new = demand_rate(snapshot.demand.get(command.model), snapshot.now, 300.0)
            assert new >= POLICY.retarget_demand_ratio * old
    if snapshot.has_quorum:
        benched = {
            n
            for n in snapshot.quarantined
            if n in snapshot.assignments and snapshot.assignments[n].managed
        }
        assert benched <= released, "a quarantined node kept its managed shard"
    check_copies_left(snapshot, decisions)


def check_copies_left(snapshot: PlacementInput, decisions: list[Decision]) -> None:
    """Every model a retarget moved a node away from keeps >= min_copies_left admitted
    copies on every layer, counted independently of the policy's own bookkeeping."""
    moved = {
        d.command.node: snapshot.assignments[d.command.node].model
        for d in decisions
        if d.code == "retarget"
    }
    gone = {d.command.node for d in decisions if isinstance(d.command, Release)} | set(moved)
    for model in set(moved.values()):
        replicas = [0] * snapshot.models[model].num_layers
        for node, assignment in snapshot.assignments.items():
            view = snapshot.nodes[node]
            if (
                assignment.model == model
                and node not in gone
                and node not in snapshot.quarantined
                and view.state in ("alive", "suspect")
                and view.capability == "admitted"
                and assignment.admission_failed_at is None
            ):
                for layer in range(*assignment.layers):
                    replicas[layer] += 1
        assert min(replicas) >= POLICY.min_copies_left


def reordered(snapshot: PlacementInput) -> PlacementInput:
    """The same snapshot with every mapping in reverse insertion order."""

    def flip(mapping: dict) -> dict:  # type: ignore[type-arg]
        return dict(reversed(list(mapping.items())))

    return replace(
        snapshot,
        assignments=flip(snapshot.assignments),  # type: ignore[arg-type]
        epochs=flip(snapshot.epochs),  # type: ignore[arg-type]
        demand=flip(snapshot.demand),  # type: ignore[arg-type]
        nodes=flip(snapshot.nodes),  # type: ignore[arg-type]
        models=flip(snapshot.models),  # type: ignore[arg-type]
        failures=flip(snapshot.failures),  # type: ignore[arg-type]
        released_at=flip(snapshot.released_at),  # type: ignore[arg-type]
    )


@pytest.mark.slow  # 300 examples, ~8-16 s: left to `make test`
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots())
def test_random_snapshots_keep_the_invariants_and_are_deterministic(
    snapshot: PlacementInput,
) -> None:
    decisions = decide(snapshot, POLICY)
    check_decisions(snapshot, decisions)
    assert decide(snapshot, POLICY) == decisions
    assert decide(reordered(snapshot), POLICY) == decisions
    assert explain(reordered(snapshot), POLICY) == explain(snapshot, POLICY)


@st.composite
def retarget_snapshots(draw: st.DrawFn) -> PlacementInput:
    """Managed nodes of X (random spans, ages and admission) that also hold Y, no
    spare nodes, and demand for both: the only way to serve Y is the safety policy."""
    swarm = Swarm()
    swarm.models[X] = ModelFacts(num_layers=4, layer_bytes=GB)
    for i in range(1, draw(st.integers(1, 12)) + 1):
        start = draw(st.sampled_from([0, 0, 0, 1, 2]))
        swarm.assigned(
            i,
            X,
            (start, draw(st.sampled_from([4, 4, start + 1]))),
            store=(Y,),
            gb=draw(st.integers(2, 8)),
            at=NOW - draw(st.sampled_from([0.0, POLICY.cooldown_s, POLICY.cooldown_s + 1, 5000])),
            capability=draw(st.sampled_from(["admitted", "admitted", "none"])),
            epoch=i,
        )
    swarm.demand[X] = fresh(draw(st.integers(1, 300)))
    swarm.demand[Y] = fresh(draw(st.integers(1, 600)))
    return swarm.input()


@settings(max_examples=300, deadline=None)
@given(retarget_snapshots())
def test_random_retargets_respect_the_safety_policy(snapshot: PlacementInput) -> None:
    check_decisions(snapshot, decide(snapshot, POLICY))


# --- simulation: random joins, crashes, demand and partitions against a real ledger -------------


@dataclass
class SimNode:
    memory_gb: int
    store: frozenset[str]
    state: MemberState = "alive"
    since: float = 0.0
    pinned: bool = False
    capability: tuple[int, CapabilityState] = (0, "none")
    """(ledger epoch the node's report is about, outcome)."""


@dataclass
class Sim:
    ledger: PlacementLedger = field(default_factory=PlacementLedger)
    history: PlacementHistory = field(default_factory=PlacementHistory)
    nodes: dict[bytes, SimNode] = field(default_factory=dict)
    pinned: dict[bytes, LedgerAssignment] = field(default_factory=dict)
    now: float = 1000.0
    index: int = 0
    no_quorum_rounds: int = 0
    placements: int = 0

    def commit(self, command: Assign | Release | RecordDemand | MarkAdmissionFailed) -> bool:
        self.index += 1
        result = self.ledger.apply(self.index, encode_command(command))
        if result.accepted:
            self.history.observe(decode_command(encode_command(command)))
        return result.accepted

    def views(self) -> dict[bytes, NodeView]:
        views = {}
        for node, sim in self.nodes.items():
            live = self.ledger.assignment(node)
            epoch, outcome = sim.capability
            capability = outcome if live is not None and live.epoch == epoch else "none"
            views[node] = NodeView(
                sim.state, sim.since, sim.memory_gb * GB, sim.store, not sim.pinned, capability
            )
        return views

    def round(self) -> None:
        has_quorum = self.no_quorum_rounds == 0
        self.no_quorum_rounds = max(0, self.no_quorum_rounds - 1)
        snapshot = PlacementInput.from_ledger(
            self.ledger, nodes=self.views(), models=FACTS, now=self.now,
            has_quorum=has_quorum, history=self.history,
        )  # fmt: skip
        decisions = decide(snapshot, POLICY)
        check_decisions(snapshot, decisions)
        for decision in decisions:
            assert self.commit(decision.command), f"ledger refused {decision}"
            self.placements += isinstance(decision.command, Assign)
        for node, assignment in self.pinned.items():
            assert self.ledger.assignment(node) == assignment, "a pinned assignment changed"
        managed = [a.node for a in self.ledger.assignments() if a.managed]
        assert len(managed) == len(set(managed))

    def step(self, op: tuple) -> None:  # type: ignore[type-arg]
        kind, i, arg = op
        node = nid(i) if kind not in ("demand", "partition", "tick") else b""
        sim = self.nodes.get(node)
        if kind == "join" and sim is None:
            self.nodes[node] = SimNode(arg[0], frozenset(arg[1]), since=self.now)
        elif kind == "join_pinned" and sim is None:
            self.nodes[node] = SimNode(8, frozenset({arg}), since=self.now, pinned=True)
            command = Assign(node, arg, (0, 8), "bf16", "operator", False, 1, self.now)
            assert self.commit(command)
            self.pinned[node] = self.ledger.assignment(node)  # type: ignore[assignment]
            self.nodes[node].capability = (1, "admitted")
        elif kind in ("crash", "leave", "recover") and sim is not None:
            sim.state = {"crash": "dead", "leave": "left", "recover": "alive"}[kind]
            sim.since = self.now
        elif kind == "demand":
            self.commit(RecordDemand(arg, i, self.now))
        elif kind == "doctor" and sim is not None:
            live = self.ledger.assignment(node)
            if live is not None and live.managed and sim.capability[0] != live.epoch:
                sim.capability = (live.epoch, "admitted" if arg else "failed")
                if not arg:
                    self.commit(MarkAdmissionFailed(node, live.model, live.epoch, self.now))
        elif kind == "partition":
            self.no_quorum_rounds = i
        elif kind == "tick":
            self.now += arg
        self.round()


JOIN = st.tuples(
    st.just("join"),
    st.integers(1, 12),
    st.tuples(st.integers(0, 9), st.lists(st.sampled_from([X, Y]), min_size=1, max_size=2)),
)
DEMAND = st.tuples(st.just("demand"), st.integers(1, 400), st.sampled_from([X, Y]))
OPS = st.one_of(
    JOIN,
    JOIN,
    DEMAND,
    DEMAND,
    st.tuples(st.just("join_pinned"), st.integers(1, 12), st.sampled_from([X, Y])),
    st.tuples(st.sampled_from(["crash", "leave", "recover"]), st.integers(1, 12), st.none()),
    st.tuples(st.just("doctor"), st.integers(1, 12), st.booleans()),
    st.tuples(st.just("partition"), st.integers(1, 4), st.none()),
    st.tuples(st.just("tick"), st.just(0), st.sampled_from([1.0, 30.0, 120.0, 700.0, 2000.0])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, min_size=15, max_size=60))
def test_simulated_churn_keeps_pinned_work_and_places_only_on_spare_nodes(ops: list) -> None:  # type: ignore[type-arg]
    sim = Sim()
    for op in ops:
        sim.step(op)


def test_simulated_sequence_places_relocates_and_releases() -> None:
    """A fixed run through the same driver: demand places, a failed doctor moves the
    placement, a crash is relocated, a partition places nothing, silence releases."""
    sim = Sim()
    sim.step(("join_pinned", 1, X))
    sim.step(("join", 2, (8, [Y])))
    sim.step(("join", 3, (8, [Y])))
    sim.step(("demand", 1, Y))
    assert sim.ledger.assignment(nid(2)) is not None
    sim.step(("doctor", 2, False))  # fails: released, node 3 tried instead
    assert sim.ledger.assignment(nid(2)) is None
    assert sim.ledger.assignment(nid(3)) is not None
    sim.step(("doctor", 3, True))
    sim.step(("partition", 4, None))  # this and the next three rounds have no quorum
    sim.step(("crash", 3, None))
    sim.step(("tick", 0, 120.0))
    sim.step(("demand", 1, Y))
    assert sim.ledger.assignment(nid(3)) is not None  # no quorum: nothing moved
    placements = sim.placements
    sim.step(("tick", 0, 1.0))  # quorum is back: node 3 is released as dead, and node 2's
    assert sim.ledger.assignment(nid(3)) is None  # back-off has passed: it relocates the gap
    assert sim.ledger.assignment(nid(2)) is not None
    assert sim.placements == placements + 1
    sim.step(("tick", 0, 2000.0))
    assert sim.ledger.assignment(nid(2)) is None  # idle
    assert sim.ledger.assignment(nid(1)) == sim.pinned[nid(1)]
