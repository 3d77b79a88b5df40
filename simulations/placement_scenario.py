"""Placement scenarios: a `[placement]` table in a scenario file runs
`simulations.placement_cluster` instead of the membership swarm.

`run_placement_scenario` builds a `PlacementCluster` from the resolved
table (models, workers in the order the tables list them, voters from 0,
the policy's knobs, the oracle or SWIM membership), schedules its demand
and faults (a worker's crash or restart; a voter partition, the leader
isolated, or workers cut off), runs it and returns its metrics, with the
plots drawn when asked. An example file and every key: docs/simulation.md,
"A placement scenario" and "`[placement]`".
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
