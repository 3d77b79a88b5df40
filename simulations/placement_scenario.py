"""Placement scenarios: a `[placement]` table in a scenario file runs
`simulations.placement_cluster` instead of the membership swarm.

Example::

    name = "demand-and-a-crash"
    duration = 300.0

    [placement]
    voters = 3                 # Raft voters (default 3)
    # detect_s = 10.0          # crash -> "dead" at the leader (the oracle)
    # membership = "swim"      # real SWIM cores instead of the oracle; then
    # swim = {profile = "lan", suspicion_mult = 4}  # optionally its config

    [placement.policy]         # the policy's knobs (consensus.settings)
    verify_fraction = 0.25     # share of answers the entries spot-check

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
    # lies = {rate = 0.01, from_s = 60.0}  # wrong on 1% of decode steps from 60 s

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
    # workers = [1]            # swim: cut off too, on a side of their own
    at = 50.0
    heal = 80.0

Workers are numbered in the order the tables list them (a `count` of n
takes n numbers), voters from 0. `simulations.schema` checks every key.
The metrics' `verification` says what liars cost and how soon the spot
checks had them quarantined (`PlacementCluster.metrics`); with
`membership = "swim"`, `membership` says when the leader's own core saw
each crash, and what its views cost (`PlacementCluster._membership`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from consensus.placement import ModelFacts
from consensus.settings import PlacementSettings, with_settings
from simulations.placement_cluster import GB, Lies, PlacementCluster, WorkerSpec
from simulations.report import write_placement_plot, write_verification_plot
from simulations.schema import swim_config

PLACEMENT_FAULTS = ("crash", "restart", "partition")


def run_placement_scenario(
    resolved: Mapping[str, Any],
    seed: int,
    timeline: list[str] | None,
    plots: Path | None = None,
    *,
    scenario_digest: str = "",
) -> dict[str, Any]:
    """Run a resolved placement scenario (`simulations.schema.resolve`); its
    metrics (`PlacementCluster.metrics`). Given a `plots` folder, draws
    `placement.png` and `verification.png` there."""
    table = resolved["placement"]
    models = {
        m["name"]: ModelFacts(m["layers"], int(m["layer_gb"] * GB), recipe=m["recipe"])
        for m in table["models"]
    }
    workers = [
        WorkerSpec(
            w["memory_gb"],
            tuple(w["models"]),
            pinned=w["pinned"],
            hardware=w["hardware"],
            fails_doctor=w["fails_doctor"],
            lies=None if w["lies"] is None else Lies(w["lies"]["rate"], w["lies"]["from_s"]),
        )
        for w in table["workers"]
        for _ in range(w["count"])
    ]
    cluster = PlacementCluster(
        seed,
        workers,
        models,
        voters=table["voters"],
        policy=with_settings(PlacementSettings(), table["policy"]),
        detect_s=table["detect_s"],
        membership=swim_config(table["swim"]) if table["membership"] == "swim" else None,
        keep_trace=timeline is not None,
    )
    cluster.trace_scenario(scenario_digest)
    for demand in table["demand"]:
        cluster.demand(demand["model"], demand["per_minute"], demand["from"], demand["until"])
    for fault in resolved["faults"]:
        _schedule(cluster, fault)
    cluster.run_until(resolved["duration"])
    if timeline is not None:
        timeline.extend(cluster.timeline())
    if plots is not None:
        write_placement_plot(cluster, plots)
        write_verification_plot(cluster, plots)
    try:
        cluster.check()
    except AssertionError as exc:  # a finding, not a crash: reported in the metrics
        return cluster.metrics() | {"invariant_failure": str(exc)}
    return cluster.metrics()


def _schedule(cluster: PlacementCluster, fault: Mapping[str, Any]) -> None:
    at = fault["at"]
    if fault["kind"] == "partition":
        workers = fault["workers"] or ()
        if fault["voters"] == "leader":
            cluster.isolate_leader(at, fault["heal"], workers)
        elif fault["voters"] is None:
            cluster.cut_off_workers(workers, at, fault["heal"])
        else:
            cluster.partition_voters(fault["voters"], at, fault["heal"], workers)
    elif fault["kind"] == "crash":
        cluster.crash(fault["worker"], at)
    else:
        cluster.restart(fault["worker"], at)
