"""The invariants a placement simulation checks: managed assignments onto
live spare holders only, pinned shards that never change, no route through
a quarantined node, and ledgers that agree."""

from __future__ import annotations

import pytest

from consensus.commands import Assign, RecordDemand, Release, encode_command
from consensus.ledger import PlacementLedger
from consensus.placement import Decision, ModelFacts, NodeView, PlacementInput
from simulations.loop import EventLoop
from simulations.placement_invariants import Invariants
from simulations.raft_cluster import RaftCluster

NODE = bytes([0xAA, *(1).to_bytes(31, "big")])
OTHER = bytes([0xAA, *(2).to_bytes(31, "big")])


def managed(node: bytes, model: str = "y") -> Assign:
    return Assign(node, model, (0, 32), "bf16", "managed", True, 1, 0.0)


def pinned(node: bytes, layers: tuple[int, int] = (0, 32)) -> Assign:
    return Assign(node, "y", layers, "bf16", "operator", False, 1, 0.0)


def snapshot(view: NodeView) -> PlacementInput:
    return PlacementInput.from_ledger(
        PlacementLedger(),
        nodes={NODE: view},
        models={"y": ModelFacts(32, 1 << 29)},
        now=0.0,
        has_quorum=True,
    )


def test_a_managed_assignment_onto_a_live_spare_holder_is_fine() -> None:
    invariants = Invariants(EventLoop())
    view = NodeView("alive", 0.0, 24 << 30, frozenset({"y"}), spare=True)
    invariants.decision(snapshot(view), Decision(managed(NODE), "place", "demand"))
    assert invariants.violations == []


@pytest.mark.parametrize(
    "view",
    [
        NodeView("dead", 0.0, 24 << 30, frozenset({"y"}), spare=True),
        NodeView("alive", 0.0, 24 << 30, frozenset({"y"}), spare=False),
        NodeView("alive", 0.0, 24 << 30, frozenset({"x"}), spare=True),
    ],
)
def test_a_managed_assignment_onto_a_dead_pinned_or_storeless_node_is_a_violation(
    view: NodeView,
) -> None:
    invariants = Invariants(EventLoop())
    invariants.decision(snapshot(view), Decision(managed(NODE), "place", "demand"))
    assert len(invariants.violations) == 1 and "managed" in invariants.violations[0]


def test_a_pinned_shard_once_recorded_never_changes_nor_is_released() -> None:
    invariants = Invariants(EventLoop())
    invariants.committed(pinned(NODE))
    invariants.committed(pinned(NODE))  # the same shard again: fine
    invariants.committed(managed(OTHER))
    invariants.committed(Release(OTHER, "y", 1, "idle", 1.0))  # a managed release: fine
    invariants.committed(RecordDemand("y", 3, 1.0))
    assert invariants.violations == []
    invariants.committed(pinned(NODE, (0, 16)))
    invariants.committed(Release(NODE, "y", 1, "idle", 2.0))
    assert invariants.violations == [
        f"pinned shard of {NODE.hex()[:8]} changed",
        f"pinned shard of {NODE.hex()[:8]} released",
    ]


def test_a_route_through_a_quarantined_node_is_a_violation() -> None:
    invariants = Invariants(EventLoop())
    invariants.routed((NODE, OTHER), {})
    invariants.routed((NODE,), {OTHER: object()})
    assert invariants.violations == []
    invariants.routed((NODE, OTHER), {OTHER: object()})
    assert invariants.violations == ["0.000: a route through a quarantined node"]


def test_check_passes_agreeing_ledgers_and_raises_on_any_violation() -> None:
    raft = RaftCluster(3, 1)
    ledgers = [PlacementLedger() for _ in range(3)]
    for ledger in ledgers[:2]:
        assert ledger.apply(1, encode_command(managed(NODE))).accepted
    invariants = Invariants(raft.loop)
    invariants.check(7, raft, ledgers)  # equal at equal applied index
    invariants.violations.append("something")
    with pytest.raises(AssertionError, match="seed 7: something"):
        invariants.check(7, raft, ledgers)


def test_check_finds_ledgers_that_differ_at_one_index() -> None:
    raft = RaftCluster(3, 1)
    ledgers = [PlacementLedger() for _ in range(3)]
    assert ledgers[0].apply(1, encode_command(managed(NODE))).accepted
    assert ledgers[1].apply(1, encode_command(managed(OTHER))).accepted
    invariants = Invariants(raft.loop)
    with pytest.raises(AssertionError, match="ledger of voter 1 differs at 1"):
        invariants.check(1, raft, ledgers)
