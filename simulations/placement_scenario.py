"""Placement scenarios: a `[placement]` table in a scenario file runs
`simulations.placement_cluster` instead of the membership swarm.

Example::

    name = "demand-and-a-crash"
    duration = 300.0

    [placement]
    voters = 3                 # Raft voters (default 3)
    # detect_s = 10.0          # crash -> "dead" at the leader

    [[placement.models]]
    name = "y"
    layers = 32
    layer_gb = 0.5
    # recipe = "bf16"

    [[placement.workers]]
    count = 2                  # default 1
    memory_gb = 24
    models = ["y"]             # what its store holds
    # hardware = "gpu"         # gpu | mac | cpu: how fast it loads
    # pinned = "y"             # an operator pinned it to the whole model
    # fails_doctor = true

    [[placement.demand]]
    model = "y"
    per_minute = 30
    from = 10.0
    until = 250.0

    [[faults]]
    kind = "crash"             # crash | restart (a worker) | partition (voters)
    worker = 1
    at = 100.0

    [[faults]]
    kind = "partition"
    voters = [[0], [1, 2]]     # or "leader": whoever leads at `at`, alone
    at = 50.0
    heal = 80.0

Workers are numbered in the order the tables list them (a `count` of n
takes n numbers), voters from 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from consensus.placement import ModelFacts
from simulations.placement_cluster import GB, PlacementCluster, WorkerSpec
from simulations.report import write_placement_plot

PLACEMENT_FAULTS = ("crash", "restart", "partition")


def run_placement_scenario(
    scenario: Mapping[str, Any],
    seed: int,
    duration: float,
    timeline: list[str] | None,
    plots: Path | None = None,
) -> dict[str, Any]:
    """Run a placement scenario; its metrics (`PlacementCluster.metrics`).
    Given a `plots` folder, draws `placement.png` there."""
    from simulations.scenario import ScenarioError  # one error type for every scenario

    table = scenario["placement"]
    if not isinstance(table, Mapping):
        raise ScenarioError("[placement] must be a table")
    try:
        models = {
            str(m["name"]): ModelFacts(
                int(m["layers"]), int(float(m["layer_gb"]) * GB), recipe=m.get("recipe", "bf16")
            )
            for m in _tables(table, "models")
        }
        workers = [
            WorkerSpec(
                float(w["memory_gb"]),
                tuple(w.get("models", ())),
                pinned=w.get("pinned"),
                hardware=w.get("hardware", "gpu"),
                fails_doctor=bool(w.get("fails_doctor", False)),
            )
            for w in _tables(table, "workers")
            for _ in range(int(w.get("count", 1)))
        ]
        for worker in workers:
            for name in (*worker.models, *([worker.pinned] if worker.pinned else [])):
                if name not in models:
                    raise ValueError(f"a worker names model {name!r}, not in [[placement.models]]")
        cluster = PlacementCluster(
            seed,
            workers,
            models,
            voters=int(table.get("voters", 3)),
            detect_s=float(table.get("detect_s", 10.0)),
            keep_trace=timeline is not None,
        )
        for demand in _tables(table, "demand"):
            cluster.demand(
                str(demand["model"]),
                float(demand["per_minute"]),
                float(demand.get("from", 0.0)),
                float(demand.get("until", duration)),
            )
        for number, fault in enumerate(scenario.get("faults", [])):
            _schedule(cluster, fault, f"faults[{number}]", len(workers))
    except (KeyError, TypeError, ValueError) as exc:
        raise ScenarioError(f"bad placement scenario: {exc!s}") from None
    cluster.run_until(duration)
    if timeline is not None:
        timeline.extend(cluster.timeline())
    if plots is not None:
        write_placement_plot(cluster, plots)
    try:
        cluster.check()
    except AssertionError as exc:  # a finding, not a crash: reported in the metrics
        return cluster.metrics() | {"invariant_failure": str(exc)}
    return cluster.metrics()


def _tables(table: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    items = table.get(name, [])
    if not isinstance(items, list) or not all(isinstance(i, Mapping) for i in items):
        raise ValueError(f"placement.{name} must be an array of tables ([[placement.{name}]])")
    return items


def _schedule(cluster: PlacementCluster, fault: Any, where: str, workers: int) -> None:
    if not isinstance(fault, Mapping) or fault.get("kind") not in PLACEMENT_FAULTS:
        raise ValueError(f"{where}: kind must be one of {', '.join(PLACEMENT_FAULTS)}")
    at = float(fault.get("at", 0.0))
    if fault["kind"] == "partition":
        heal = float(fault.get("heal", math.inf))
        if fault["voters"] == "leader":
            cluster.isolate_leader(at, heal)
        else:
            cluster.partition_voters(fault["voters"], at, heal)
        return
    worker = fault["worker"]
    if type(worker) is not int or not 0 <= worker < workers:
        raise ValueError(f"{where}: worker {worker!r} is not in 0..{workers - 1}")
    if fault["kind"] == "crash":
        cluster.crash(worker, at)
    else:
        cluster.restart(worker, at)
