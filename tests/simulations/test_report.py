"""Simulation reports: the plotted series are computed from the run, and
sampling a run for them changes nothing in it."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consensus.placement import ModelFacts
from simulations.cluster import MembershipCluster
from simulations.network import NetworkConfig
from simulations.placement_cluster import GB, PlacementCluster, WorkerSpec
from simulations.report import (
    FORMATS,
    SERVED_BIN_S,
    beliefs,
    run_sampled,
    sample_step,
    write_placement_plot,
    write_plots,
)


def crashing_cluster(seed: int) -> MembershipCluster:
    cluster = MembershipCluster(30, seed, network=NetworkConfig.lan(loss=0.05))
    cluster.crash(4, at=2.0)
    cluster.partition([list(range(15)), list(range(15, 30))], 6.0, 12.0)
    cluster.publish(7, at=8.0)
    return cluster


def test_beliefs_count_each_pair_by_its_latest_verdict() -> None:
    verdicts = [
        (1.0, 0, "suspect", 5, 1),
        (1.0, 1, "suspect", 5, 1),  # same instant: one point, final counts
        (2.0, 0, "dead", 5, 1),  # replaces 0's suspicion of 5
        (3.0, 1, "alive", 5, 2),  # 1 was refuted to
        (4.0, 2, "left", 6, 1),  # neither suspect nor dead
        (5.0, 0, "alive", 5, 3),
    ]
    assert beliefs(verdicts) == (
        [1.0, 2.0, 3.0, 4.0, 5.0],
        [2, 1, 0, 0, 0],
        [0, 1, 1, 1, 0],
    )
    assert beliefs([]) == ([], [], [])


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), step=st.floats(0.05, 7.0))
def test_a_sampled_run_is_the_same_run(seed: int, step: float) -> None:
    plain, sampled = crashing_cluster(seed), crashing_cluster(seed)
    plain.run_until(20.0)
    samples = run_sampled(sampled, 20.0, step)
    assert sampled.trace_digest() == plain.trace_digest()
    assert sampled.loop.events_run == plain.loop.events_run
    assert samples.times[-1] == 20.0 and len(samples.times) == -(-20.0 // step)
    # The steps' traffic adds up to the whole run's.
    total = plain.traffic()["messages_per_node_second"] * 20.0
    stepped = sum(
        rate * (end - start)
        for rate, start, end in zip(
            samples.mean_messages, [0.0, *samples.times], samples.times, strict=False
        )
    )
    assert abs(stepped - total) < 1e-6 * max(1.0, total)


def test_the_sample_step_keeps_long_runs_to_a_bounded_number_of_points() -> None:
    assert sample_step(150.0) == 1.0
    assert sample_step(100_000.0) == 50.0


def test_figures_come_in_every_format_with_their_data(tmp_path: Path) -> None:
    """PNG, SVG and PDF of each figure, the same bytes for the same run, and
    the plotted series as CSV beside them."""
    runs = []
    for out in (tmp_path / "one", tmp_path / "two"):
        cluster = crashing_cluster(3)
        samples = run_sampled(cluster, 20.0, 1.0)
        written = write_plots(cluster, samples, out)
        assert {path.name for path in written} == {
            f"{name}.{suffix}"
            for name in ("membership", "traffic", "spread")
            for suffix in (*FORMATS, "csv")
        }
        runs.append((cluster, samples))
    for path in sorted((tmp_path / "one").iterdir()):
        assert path.read_bytes() == (tmp_path / "two" / path.name).read_bytes(), path.name
    cluster, samples = runs[0]
    times, suspect, dead = beliefs(cluster.verdicts())
    with (tmp_path / "one" / "membership.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [float(row["time_s"]) for row in rows] == times
    assert [int(row["suspect_pairs"]) for row in rows] == suspect
    assert [int(row["dead_pairs"]) for row in rows] == dead
    assert float(rows[-1]["dead_fraction"]) == dead[-1] / (30 * 29)
    with (tmp_path / "one" / "traffic.csv").open() as handle:
        traffic = list(csv.DictReader(handle))
    assert [float(row["mean_messages"]) for row in traffic] == samples.mean_messages
    assert (tmp_path / "one" / "membership.svg").read_text().startswith("<?xml")
    assert (tmp_path / "one" / "membership.pdf").read_bytes().startswith(b"%PDF")


def test_traffic_by_message_type_adds_up_to_the_total() -> None:
    from simulations.scenario import run_scenario

    scenario = {"duration": 30.0, "nodes": {"count": 20}, "network": {"count_bytes": True}}
    traffic = run_scenario(scenario, seed=1)["traffic"]
    by_type = traffic["by_type"]
    assert {"Ping", "Ack", "Gossip", "SyncDigest"} <= set(by_type)
    for unit in ("messages_per_node_second", "bytes_per_node_second"):
        total = sum(kind[unit] for kind in by_type.values())
        assert abs(total - traffic[unit]) < 1e-9 * traffic[unit]
    assert by_type["Ping"]["messages_per_node_second"] > 0


def test_the_placement_figure_tracks_leadership_and_chains_as_the_metrics_count_them(
    tmp_path: Path,
) -> None:
    """The leader and availability series in `placement.csv` add up to the
    metrics: leaderless spans to `leaderless_s`, chain gaps from the first
    request to `incomplete_chain_s`, and each bin's served fraction to the
    requests beside it."""
    workers = [WorkerSpec(24, ("y",)), WorkerSpec(24, ("y",))]
    cluster = PlacementCluster(1, workers, {"y": ModelFacts(32, GB // 2)})
    cluster.demand("y", 60, start=5, stop=100)
    cluster.isolate_leader(at=30, heal=35)
    cluster.run_until(35)
    cluster.crash(next(i for i, w in enumerate(cluster.workers) if w.serving), at=35)
    cluster.run_until(100)
    cluster.check()
    metrics = cluster.metrics()
    write_placement_plot(cluster, tmp_path)
    for suffix in (*FORMATS, "csv"):
        assert (tmp_path / f"placement.{suffix}").stat().st_size > 0, suffix
    with (tmp_path / "placement.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    series: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        series.setdefault(row["series"], []).append(row)

    leaders = [(float(r["start_s"]), float(r["end_s"]), r["voter"]) for r in series["leader"]]
    assert leaders[0][0] == 0.0 and leaders[-1][1] == 100.0
    assert all(a[1] == b[0] for a, b in itertools.pairwise(leaders))
    first = metrics["first_leader_at"]
    assert isinstance(first, float)
    leaderless = sum(end - start for start, end, voter in leaders if not voter and start >= first)
    counted = metrics["leaderless_s"]
    assert isinstance(counted, float) and counted > 0
    assert leaderless == pytest.approx(counted, abs=1e-6)
    terms = {(r["voter"], r["term"]) for r in series["leader"] if r["voter"]}
    assert len(terms) - 1 == metrics["leader_changes"] == 1

    y = metrics["models"]["y"]  # type: ignore[index]
    since = y["first_request_at"]
    gaps = sum(
        float(r["end_s"]) - max(float(r["start_s"]), since)
        for r in series["chain"]
        if r["value"] == "0" and float(r["end_s"]) > since
    )
    assert y["incomplete_chain_s"] > cluster.detect_s  # the first load and the crash
    assert gaps == pytest.approx(y["incomplete_chain_s"], abs=1e-6)

    requests = [(float(r["start_s"]), r["value"] == "1") for r in series["request"]]
    assert len(requests) == y["requests"]
    for row in series["served_fraction"]:
        start = float(row["start_s"])
        inside = [ok for at, ok in requests if start <= at < start + SERVED_BIN_S]
        expected = sum(inside) / len(inside) if inside else None
        assert (float(row["value"]) if row["value"] else None) == expected, start
