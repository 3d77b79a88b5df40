"""Scenario files: a membership experiment described in TOML, run to metrics.

A scenario names the swarm (how many nodes, how they start), the membership
profile, the network, a fault schedule and a duration. ``run_scenario`` runs
it with a seed and returns a JSON-ready dict of metrics, trace digest
included: the same file and seed always give the same dict. Every key is
checked against `simulations.schema` before anything runs. A scenario with
a `[placement]` table is a placement experiment instead
(`simulations.placement_scenario`). Examples and every key:
docs/simulation.md.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import itertools
import json
import math
import random
import subprocess
import tomllib
from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from simulations.cluster import MembershipCluster, Publication
from simulations.compiled import is_compiled
from simulations.network import LINK_FIELDS, Cut, NetworkConfig, Partition
from simulations.placement_scenario import run_placement_scenario
from simulations.report import run_sampled, sample_step, write_plots
from simulations.schema import LINK_FAULTS, ScenarioError, resolve, swim_config
from simulations.seeds import component_rng

SECONDS_PER_HOUR = 3600.0


def load_scenario(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The scenario as a dict: a TOML file's contents, or a dict as given."""
    return _read(source)[0]


def _read(source: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The scenario, and the bytes it was written as (a dict's canonical JSON),
    read once: provenance hashes what the run parsed."""
    if isinstance(source, Mapping):
        return dict(source), _canonical(dict(source)).encode()
    written = Path(source).read_bytes()
    try:
        return tomllib.loads(written.decode()), written
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
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


def build_cluster(
    resolved: Mapping[str, Any], seed: int, *, keep_trace: bool = False
) -> MembershipCluster:
    """The cluster a resolved scenario (`simulations.schema.resolve`)
    describes, with its fault schedule laid down."""
    nodes = resolved["nodes"]
    network = dict(resolved["network"])
    links = network.pop("links")
    try:
        config = swim_config(resolved["membership"])
        net = NetworkConfig.profile(network.pop("profile"), **network)
        cluster = MembershipCluster(
            nodes["count"],
            seed,
            config,
            net,
            join=nodes["join"],
            keep_trace=keep_trace,
            seeds=nodes["seeds"],
            stagger=nodes["stagger"],
            record_size=nodes["record_size"],
        )
        for link in links:
            fields = {key: value for key, value in link.items() if key in LINK_FIELDS}
            cluster.network.set_link(link["from"], link["to"], **fields)
            if link["both"]:
                cluster.network.set_link(link["to"], link["from"], **fields)
    except ValueError as exc:  # a value the config itself refuses (e.g. loss > 1)
        raise ScenarioError(f"bad scenario settings: {exc}") from None
    picker = component_rng(seed, "scenario", "faults")
    for fault in resolved["faults"]:
        _schedule(cluster, fault, picker)
    return cluster


def _schedule(cluster: MembershipCluster, fault: Mapping[str, Any], picker: random.Random) -> None:
    kind, at = fault["kind"], fault["at"]
    if kind in LINK_FAULTS:
        for start, heal in windows(at, fault["heal"], fault["flap"]):
            _cut_links(cluster, fault, start, heal)
        return
    if "random" in fault:
        # Node 0 is spared: it is the seed that restarts and joins go through.
        targets = sorted(picker.sample(range(1, cluster.n), fault["random"]))
    else:
        targets = fault["nodes"] if "nodes" in fault else [fault["node"]]
    for target in targets:
        if kind == "crash":
            cluster.crash(target, at)
        elif kind == "pause":
            cluster.pause(target, at, fault["duration"])
        elif kind == "restart":
            cluster.restart(target, at)
        elif kind == "leave":
            cluster.leave(target, at)
        elif kind == "skew":
            cluster.skew(target, at, rate=fault["rate"], jump=fault["jump"])
        else:
            cluster.publish(target, at)


def windows(at: float, heal: float, flap: Mapping[str, float] | None) -> list[tuple[float, float]]:
    """When a link fault is on: once from `at` to `heal`, or, flapping, for
    `duty` of every `period` in between."""
    if flap is None:
        return [(at, heal)]
    period, on = flap["period"], flap["period"] * flap["duty"]
    starts = itertools.takewhile(lambda s: s < heal, (at + k * period for k in itertools.count()))
    return [(start, min(start + on, heal)) for start in starts]


def _cut_links(
    cluster: MembershipCluster, fault: Mapping[str, Any], start: float, heal: float
) -> None:
    kind = fault["kind"]
    if kind == "cut":
        cluster.cut(fault["from"], fault["to"], start, heal)
        return
    groups = fault["groups"]
    if groups == "halves":
        half = cluster.n // 2
        groups = [list(range(half)), list(range(half, cluster.n))]
    if kind == "partition":
        cluster.partition(groups, start, heal)
        return
    # A bridge cuts every set from every other; a ring keeps each set's two
    # neighbours. Nodes in no set are not cut from anyone.
    count = len(groups)
    for i, j in itertools.permutations(range(count), 2):
        if kind == "bridge" or (j - i) % count not in (1, count - 1):
            cluster.cut(groups[i], groups[j], start, heal)


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


def _by_type(cluster: MembershipCluster) -> dict[str, dict[str, float]]:
    """Messages and bytes per node-second, by message type: bytes are exact
    with `network.count_bytes`, otherwise estimated from a sample
    (`simulations.network.BYTE_SAMPLE_EVERY`)."""
    node_seconds = cluster.n * cluster.now
    if node_seconds <= 0:
        return {}
    network = cluster.network
    sizes = network.estimated_bytes_by_type()
    return {
        kind: {
            "messages_per_node_second": count / node_seconds,
            "bytes_per_node_second": sizes.get(kind, 0.0) / node_seconds,
        }
        for kind, count in sorted(network.sent_by_type.items())
    }


def _split_report(cluster: MembershipCluster, split: Partition) -> dict[str, Any]:
    """How long the swarm took to see a partition and to heal from it.

    Over the pairs (observer, subject) on different sides: the split is
    detected for a pair at its first `dead` verdict while the partition
    holds, and reconverged at the first `alive` verdict after the heal.
    Times are the slowest pair's (None until every pair got there) and the
    median's, in seconds from the start or the heal.
    """
    n = cluster.n
    side = [len(split.groups)] * n
    for number, group in enumerate(split.groups):
        for node in group:
            side[node] = number
    # Which pairs were seen dead, and back, as one bit each: a 3-way split
    # of 1,000 nodes has 666,666 pairs, which as a dict of tuples took more
    # memory at the end of a run than the run itself.
    dead = bytearray((n * n + 7) // 8)
    back = bytearray(len(dead))
    detect_s = array("d")
    reconverge_s = array("d")
    for at, observer, kind, subject, _ in cluster.verdicts():
        if side[observer] == side[subject]:
            continue
        pair = observer * n + subject
        byte, bit = pair >> 3, 1 << (pair & 7)
        if kind == "dead" and split.start <= at < split.heal:
            if not dead[byte] & bit:
                dead[byte] |= bit
                detect_s.append(at - split.start)
        elif kind == "alive" and at >= split.heal and dead[byte] & bit and not back[byte] & bit:
            back[byte] |= bit
            reconverge_s.append(at - split.heal)
    sizes = Counter(side)
    pairs = n * n - sum(size * size for size in sizes.values())
    detected, reconverged = len(detect_s), len(reconverge_s)
    return {
        "start": split.start,
        "heal": None if split.heal == math.inf else split.heal,
        "cross_pairs": pairs,
        "detected_fraction": detected / pairs if pairs else 0.0,
        "time_to_detect_s": max(detect_s) if detect_s and detected == pairs else None,
        "median_detect_s": quantile(detect_s, 0.5),
        "reconverged_fraction": reconverged / detected if detected else None,
        "time_to_reconverge_s": (
            max(reconverge_s) if reconverge_s and reconverged == detected else None
        ),
        "median_reconverge_s": quantile(reconverge_s, 0.5),
    }


def _cut_report(cluster: MembershipCluster, cut: Cut) -> dict[str, Any]:
    """What each side came to believe of the other while a one-way cut held:
    distinct (observer, subject) pairs with a suspect or dead verdict."""
    end = min(cut.heal, cluster.now)
    seen: dict[str, set[tuple[int, int]]] = {}
    for at, observer, kind, subject, _ in cluster.verdicts():
        if kind not in ("suspect", "dead") or not cut.start <= at < end:
            continue
        if observer in cut.targets and subject in cut.sources:
            seen.setdefault(f"to_about_from.{kind}", set()).add((observer, subject))
        elif observer in cut.sources and subject in cut.targets:
            seen.setdefault(f"from_about_to.{kind}", set()).add((observer, subject))
    counts = {
        side: {kind: len(seen.get(f"{side}.{kind}", ())) for kind in ("suspect", "dead")}
        for side in ("to_about_from", "from_about_to")
    }
    return {
        "from": len(cut.sources),
        "to": len(cut.targets),
        "start": cut.start,
        "heal": None if cut.heal == math.inf else cut.heal,
        **counts,
    }


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
            **{
                key: traffic[key]
                for key in (
                    "messages_per_node_second",
                    "bytes_per_node_second",
                    "max_messages_per_node_second",
                    "max_bytes_per_node_second",
                )
            },
            "by_type": _by_type(cluster),
            "updates_sent": cluster.updates_sent,
            "updates_per_node_second": (
                cluster.updates_sent / (cluster.n * cluster.now) if cluster.now > 0 else 0.0
            ),
        },
        "drops": {where: dict(sorted(c.items())) for where, c in drops.items()},
        "publications": [_spread_report(cluster, p) for p in cluster.publications],
        "detections": _detection_reports(cluster),
        "false_positives": len(false_positives),
        "false_positives_per_node_hour": (
            len(false_positives) / node_hours if node_hours > 0 else 0.0
        ),
        "view_agreement": cluster.view_agreement(),
        "partitions": [_split_report(cluster, split) for split in cluster.splits()],
        "cuts": [_cut_report(cluster, cut) for cut in cluster.cuts()],
    }


def run_scenario(
    source: str | Path | Mapping[str, Any],
    seed: int,
    timeline: list[str] | None = None,
    plots: Path | None = None,
) -> dict[str, Any]:
    """Run a scenario (a TOML path or an already-loaded dict) with ``seed``.

    Returns the metrics dict (see ``metrics``) plus the scenario's name,
    the seed, the duration and its ``provenance``. Deterministic: no
    wall-clock figures in it; the trace digest covers the resolved scenario
    as well as every traced event.
    Given a ``timeline`` list, appends the run's trace lines to it (what the
    trace digest is computed over). Given a ``plots`` folder, writes the
    run's PNG plots there (``simulations.report``; needs matplotlib): the
    metrics are the same either way.
    """
    scenario, written = _read(source)
    resolved = resolve(scenario)
    duration = resolved["duration"]
    about = provenance(written, resolved, seed)
    header = {"scenario": resolved["name"], "seed": seed, "duration": duration}
    header["provenance"] = about
    digest = about["resolved_sha256"]
    if "placement" in resolved:
        placed = run_placement_scenario(resolved, seed, timeline, plots, scenario_digest=digest)
        return header | placed
    cluster = build_cluster(resolved, seed, keep_trace=timeline is not None)
    cluster.trace_scenario(digest)
    if plots is None:
        cluster.run_until(duration)
    else:
        samples = run_sampled(cluster, duration, sample_step(duration))
        write_plots(cluster, samples, plots)
    if timeline is not None and cluster.trace_lines is not None:
        timeline.extend(cluster.trace_lines)
    return header | metrics(cluster)


def provenance(written: bytes, resolved: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """What a reader needs to reproduce a run: the code (version and git
    commit, when run from a checkout, and whether its hot modules ran
    compiled: `simulations.compiled`), the scenario as written (the sha256
    of its file, or of a given dict's canonical JSON), and as it ran (every
    default filled in)."""
    canonical = _canonical(resolved)
    return {
        "shardmesh_version": _version(),
        "git_commit": _git_commit(),
        "core": "mypyc" if is_compiled() else "python",
        "scenario_sha256": hashlib.sha256(written).hexdigest(),
        "resolved_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
        "seed": seed,
        "resolved": json.loads(canonical),
    }


def _canonical(value: Any) -> str:
    """Sorted-key JSON, with "never" for infinite times (JSON has no infinity)."""

    def plain(item: Any) -> Any:
        if isinstance(item, Mapping):
            return {str(key): plain(inner) for key, inner in item.items()}
        if isinstance(item, list | tuple):
            return [plain(inner) for inner in item]
        if isinstance(item, float) and math.isinf(item):
            return "never"
        return item

    return json.dumps(plain(value), sort_keys=True, separators=(",", ":"))


@functools.cache
def _version() -> str:
    try:
        return importlib.metadata.version("shardmesh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def _git_commit() -> str | None:
    """The checkout's commit (with "+dirty" for uncommitted changes), or None;
    asked once per process, not once per run of a sweep."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")
