"""The placement benchmark's synthetic swarm (`benchmarks.placement`): it is
shaped like a busy swarm, so every rule of the policy has work to do, and
the same seed gives the same snapshot."""

from __future__ import annotations

from collections import Counter

from benchmarks.placement import synthetic_snapshot
from consensus.placement import PlacementSettings, decide


def test_the_snapshot_holds_every_kind_of_node_and_demand() -> None:
    snapshot = synthetic_snapshot(nodes=2000, models=20, seed=1)
    assert len(snapshot.nodes) == 2000 and len(snapshot.models) == 20
    states = Counter(view.state for view in snapshot.nodes.values())
    assert set(states) == {"alive", "suspect", "dead"}
    assert states["dead"] < states["suspect"] + states["dead"] < 0.1 * 2000
    tiers = Counter(a.tier for a in snapshot.assignments.values())
    assert {"operator", "bootstrap", "managed"} <= set(tiers)
    assert all(view.models for view in snapshot.nodes.values())  # 1-6 models each
    spare = sum(node not in snapshot.assignments for node in snapshot.nodes)
    assert spare > 0.4 * 2000
    assert snapshot.demand and snapshot.failures


def test_the_same_seed_gives_the_same_snapshot_and_decide_has_work() -> None:
    one = synthetic_snapshot(nodes=500, models=10, seed=3)
    assert one == synthetic_snapshot(nodes=500, models=10, seed=3)
    assert one != synthetic_snapshot(nodes=500, models=10, seed=4)
    assert decide(one, PlacementSettings())
