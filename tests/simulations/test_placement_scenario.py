"""Placement scenarios: a resolved `[placement]` table built into a
`PlacementCluster`, its faults dispatched to the right kind, and its
metrics returned."""

from __future__ import annotations

from typing import Any

from simulations.placement_scenario import _schedule, run_placement_scenario
from simulations.schema import resolve


def scenario(**placement: Any) -> dict[str, Any]:
    table = {
        "models": [{"name": "y", "layers": 32, "layer_gb": 0.5}],
        "workers": [
            {"memory_gb": 24, "models": ["y"], "count": 2},
            {"memory_gb": 24, "models": ["y"], "lies": {"rate": 1.0}},
        ],
        "demand": [{"model": "y", "per_minute": 60, "from": 5.0, "until": 60.0}],
    }
    return {"duration": 60.0, "placement": table | placement}


class Recorder:
    """A stand-in cluster that records which fault method each fault calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append((name, *args))


def test_each_fault_goes_to_its_kind() -> None:
    cluster = Recorder()
    faults = [
        {"kind": "crash", "worker": 1, "at": 5.0},
        {"kind": "restart", "worker": 1, "at": 9.0},
        {"kind": "partition", "voters": [[0], [1, 2]], "workers": None, "at": 1.0, "heal": 2.0},
        {"kind": "partition", "voters": "leader", "workers": [3], "at": 3.0, "heal": 4.0},
        {"kind": "partition", "voters": None, "workers": [2], "at": 5.0, "heal": 6.0},
    ]
    for fault in faults:
        _schedule(cluster, fault)  # type: ignore[arg-type]
    assert cluster.calls == [
        ("crash", 1, 5.0),
        ("restart", 1, 9.0),
        ("partition_voters", [[0], [1, 2]], 1.0, 2.0, ()),
        ("isolate_leader", 3.0, 4.0, [3]),
        ("cut_off_workers", [2], 5.0, 6.0),
    ]


def test_workers_are_numbered_in_table_order_with_counts_expanded() -> None:
    timeline: list[str] = []
    metrics = run_placement_scenario(resolve(scenario()), 1, timeline, scenario_digest="abc")
    liars = metrics["verification"]["liars"]
    assert [liar["worker"] for liar in liars] == [2]  # after the two of the first table
    assert liars[0]["rate"] == 1.0
    assert metrics["models"]["y"]["requests"] > 0 and metrics["violations"] == 0
    assert any(line.endswith("scenario abc") for line in timeline)
    assert "invariant_failure" not in metrics


def test_the_same_resolved_scenario_and_seed_give_the_same_metrics() -> None:
    resolved = resolve(scenario(voters=1))
    first = run_placement_scenario(resolved, 4, None)
    assert first == run_placement_scenario(resolved, 4, None)
    assert first["terms"] == 1  # a lone voter elects itself once
