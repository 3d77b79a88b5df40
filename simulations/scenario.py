"""Scenario files: a membership experiment described in TOML, run to metrics.

(A scenario with a `[placement]` table is a placement experiment instead:
see `simulations.placement_scenario`.)

A scenario names the swarm (how many nodes, how they start), the membership
profile, the network, a fault schedule and a duration. ``run_scenario`` runs
it with a seed and returns a JSON-ready dict of metrics, including the trace
digest: the same file and seed always give the same dict (nothing in it
depends on the wall clock), which is what lets a researcher diff two runs.

Example::

    name = "crash-under-loss"
    duration = 120.0

    [nodes]
    count = 200
    join = "preconverged"      # or "seed": everyone joins via node 0
    # seeds = 1, stagger = 0.01, record_size = 1024

    [membership]
    profile = "lan"            # lan | wan | local; other keys override fields
    # suspicion_mult = 4

    [network]
    profile = "lan"            # lan | wan; other keys override fields
    loss = 0.1

    [[faults]]
    kind = "crash"             # crash | pause | restart | leave | publish | partition
    node = 7                   # or nodes = [1, 2], or random = 5 (seeded pick)
    at = 10.0

    [[faults]]
    kind = "pause"
    node = 3
    at = 20.0
    duration = 8.0

    [[faults]]
    kind = "partition"
    at = 30.0
    heal = 90.0
    groups = "halves"          # or explicit: [[0, 1, 2], [3, 4]]

    [[faults]]
    kind = "publish"
    node = 0
    at = 100.0
"""

from __future__ import annotations

import math
import random
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mesh.config import MembershipConfig
from simulations.cluster import MembershipCluster, Publication
from simulations.network import NetworkConfig
from simulations.placement_scenario import run_placement_scenario
from simulations.report import run_sampled, sample_step, write_plots
from simulations.seeds import component_rng

FAULT_KINDS = ("crash", "pause", "restart", "leave", "publish", "partition")

DEFAULT_PAUSE = 10.0
"""Seconds a pause lasts when the scenario does not say: longer than the LAN
probe timeout and interval, shorter than the suspicion timeout, so a paused
node is suspected but should refute on resume."""

SECONDS_PER_HOUR = 3600.0


class ScenarioError(ValueError):
    """The scenario file is malformed; the message says where."""


def load_scenario(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The scenario as a dict: a TOML file's contents, or a dict as given."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"invalid TOML: {exc}") from None


def quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile of ``values`` (None when there are none).

    Nearest rank, not interpolation: "99.9% of nodes had it by t" should be
    a time at which some node actually got it.
    """
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _table(scenario: Mapping[str, Any], name: str) -> dict[str, Any]:
    table = scenario.get(name, {})
    if not isinstance(table, Mapping):
        raise ScenarioError(f"[{name}] must be a table")
    return dict(table)


def build_cluster(
    scenario: Mapping[str, Any], seed: int, *, keep_trace: bool = False
) -> MembershipCluster:
    """The cluster a scenario describes, with its fault schedule laid down."""
    nodes = _table(scenario, "nodes")
    count = int(nodes.pop("count", 0))
    if count < 1:
        raise ScenarioError("[nodes] count must be a positive integer")
    membership = _table(scenario, "membership")
    network = _table(scenario, "network")
    try:
        config = MembershipConfig.profile(membership.pop("profile", "lan"))
        if membership:
            config = config.with_overrides(**membership)
        net = NetworkConfig.profile(network.pop("profile", "lan"), **network)
        cluster = MembershipCluster(
            count,
            seed,
            config,
            net,
            join=nodes.pop("join", "preconverged"),
            keep_trace=keep_trace,
            **nodes,
        )
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"bad scenario settings: {exc}") from None
    faults = scenario.get("faults", [])
    if not isinstance(faults, list):
        raise ScenarioError("faults must be an array of tables ([[faults]])")
    picker = component_rng(seed, "scenario", "faults")
    for number, fault in enumerate(faults):
        _schedule(cluster, fault, number, picker)
    return cluster


def _targets(fault: Mapping[str, Any], n: int, picker: random.Random, where: str) -> list[int]:
    if "node" in fault:
        targets = [fault["node"]]
    elif "nodes" in fault:
        targets = list(fault["nodes"])
    elif "random" in fault:
        # Node 0 is spared: it is the seed that restarts and joins go through.
        targets = sorted(picker.sample(range(1, n), int(fault["random"])))
    else:
        raise ScenarioError(f"{where}: say which node(s): node, nodes or random")
    for target in targets:
        if not isinstance(target, int) or not 0 <= target < n:
            raise ScenarioError(f"{where}: node {target!r} is not in 0..{n - 1}")
    return targets


def _schedule(cluster: MembershipCluster, fault: Any, number: int, picker: random.Random) -> None:
    where = f"faults[{number}]"
    if not isinstance(fault, Mapping):
        raise ScenarioError(f"{where} must be a table")
    kind = fault.get("kind")
    if kind not in FAULT_KINDS:
        raise ScenarioError(f"{where}: kind must be one of {', '.join(FAULT_KINDS)}")
    at = float(fault.get("at", 0.0))
    if kind == "partition":
        groups = fault.get("groups", "halves")
        if groups == "halves":
            half = cluster.n // 2
            groups = [list(range(half)), list(range(half, cluster.n))]
        if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
            raise ScenarioError(f'{where}: groups must be "halves" or a list of lists')
        heal = float(fault.get("heal", math.inf))
        try:
            cluster.partition(groups, at, heal)
        except ValueError as exc:
            raise ScenarioError(f"{where}: {exc}") from None
        return
    for target in _targets(fault, cluster.n, picker, where):
        if kind == "crash":
            cluster.crash(target, at)
        elif kind == "pause":
            cluster.pause(target, at, float(fault.get("duration", DEFAULT_PAUSE)))
        elif kind == "restart":
            cluster.restart(target, at)
        elif kind == "leave":
            cluster.leave(target, at)
        else:
            cluster.publish(target, at)


def _spread_report(cluster: MembershipCluster, publication: Publication) -> dict[str, Any]:
    times = cluster.spread_times(publication)
    got = [t for t in times.values() if t is not None]
    return {
        "node": publication.node,
        "seq": publication.seq,
        "at": publication.at,
        "held_fraction": len(got) / len(times) if times else 0.0,
        "p50": quantile(got, 0.5),
        "p99": quantile(got, 0.99),
        "p999": quantile(got, 0.999),
        "max": max(got, default=None),
    }


def _detection_reports(cluster: MembershipCluster) -> list[dict[str, Any]]:
    reports = []
    for node in cluster.nodes:
        for fault in node.faults:
            if fault.kind != "crash":
                continue
            times = cluster.detection_times(node.index, since=fault.start)
            got = [t for t in times.values() if t is not None]
            reports.append(
                {
                    "node": node.index,
                    "crashed_at": fault.start,
                    "restarted_at": None if fault.end == math.inf else fault.end,
                    "detected_fraction": len(got) / len(times) if times else 0.0,
                    "median": quantile(got, 0.5),
                    "max": max(got, default=None),
                }
            )
    return reports


def metrics(cluster: MembershipCluster) -> dict[str, Any]:
    """What a run measured, as a JSON-ready dict (see ``run_scenario``)."""
    traffic = cluster.traffic()
    drops = cluster.drops()
    false_positives = cluster.false_positives()
    node_hours = cluster.n * cluster.now / SECONDS_PER_HOUR
    running = cluster.running()
    return {
        "nodes": cluster.n,
        "running_at_end": len(running),
        "simulated_seconds": cluster.now,
        "loop_events": cluster.loop.events_run,
        "trace_digest": cluster.trace_digest(),
        "trace_lines": cluster.trace_length,
        "events": dict(sorted(cluster.event_counts.items())),
        "traffic": {
            key: traffic[key]
            for key in (
                "messages_per_node_second",
                "bytes_per_node_second",
                "max_messages_per_node_second",
                "max_bytes_per_node_second",
            )
        },
        "drops": {where: dict(sorted(c.items())) for where, c in drops.items()},
        "publications": [_spread_report(cluster, p) for p in cluster.publications],
        "detections": _detection_reports(cluster),
        "false_positives": len(false_positives),
        "false_positives_per_node_hour": (
            len(false_positives) / node_hours if node_hours > 0 else 0.0
        ),
        "view_agreement": cluster.view_agreement(),
    }


def run_scenario(
    source: str | Path | Mapping[str, Any],
    seed: int,
    timeline: list[str] | None = None,
    plots: Path | None = None,
) -> dict[str, Any]:
    """Run a scenario (a TOML path or an already-loaded dict) with ``seed``.

    Returns the metrics dict (see ``metrics``) plus the scenario's name,
    the seed and the duration. Deterministic: no wall-clock figures in it.
    Given a ``timeline`` list, appends the run's trace lines to it (what the
    trace digest is computed over). Given a ``plots`` folder, writes the
    run's PNG plots there (``simulations.report``; needs matplotlib): the
    metrics are the same either way.
    """
    scenario = load_scenario(source)
    duration = float(scenario.get("duration", 60.0))
    if duration <= 0:
        raise ScenarioError("duration must be positive")
    header = {"scenario": scenario.get("name", ""), "seed": seed, "duration": duration}
    if "placement" in scenario:
        return header | run_placement_scenario(scenario, seed, duration, timeline, plots)
    cluster = build_cluster(scenario, seed, keep_trace=timeline is not None)
    if plots is None:
        cluster.run_until(duration)
    else:
        samples = run_sampled(cluster, duration, sample_step(duration))
        write_plots(cluster, samples, plots)
    if timeline is not None and cluster.trace_lines is not None:
        timeline.extend(cluster.trace_lines)
    return header | metrics(cluster)
