"""Verified compute in the placement simulator (issue 18): liars serve
wrong answers until the entries' spot checks catch them and the leader's
verdict quarantines them, over many seeds; and the scenario keys that
declare liars and set the policy's `verify_fraction` are checked strictly."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from consensus.placement import ModelFacts
from consensus.settings import PlacementSettings, policy_json
from simulations.placement_cluster import GB, Lies, PlacementCluster, WorkerSpec
from simulations.report import write_verification_plot
from simulations.scenario import run_scenario
from simulations.schema import ScenarioError, resolve
from simulations.sweep import with_setting
from tests import REPO

MODELS = {"y": ModelFacts(32, GB // 2)}
"""16 GB: a copy takes two 8 GB workers, [0, 16) and [16, 32)."""
LATE_FROM_S = 60.0
LIARS = {1: Lies(1.0), 4: Lies(0.05), 6: Lies(1.0, from_s=LATE_FROM_S)}
"""Worker 1 lies on every step (it holds [16, 32) of the first copy, so it
serves alone, unchecked, until the second copy loads), worker 4 on 5% of
its steps, worker 6 on every step from a minute in."""
POLICY = PlacementSettings(demand_window_s=60.0, requests_per_copy_per_min=15.0)
"""Demand at 60 a minute reads as such within a minute and asks for four
copies: two to four replicas of every span."""
DETECTION_BOUND_S = 120.0
"""An always-liar is quarantined within this of its first lie. Once another
worker serves its span, every answer through it is wrong and checked with
probability 1/4: after the ~12 answers it gets in a few tens of seconds,
0.75**12 = 3% escape; two minutes leave several times that margin (the 20
seeds' slowest take about a minute)."""
RUN_S = LATE_FROM_S + DETECTION_BOUND_S
SEEDS = range(20)


def liar_swarm(seed: int, policy: PlacementSettings = POLICY) -> PlacementCluster:
    """Ten 8 GB workers with the liars above, one Raft voter (what is
    measured is the checks, not Raft: one voter runs many times faster),
    chat demand at 60 a minute throughout."""
    workers = [WorkerSpec(8, ("y",), lies=LIARS.get(i)) for i in range(10)]
    cluster = PlacementCluster(seed, workers, MODELS, voters=1, policy=policy)
    cluster.demand("y", 60, 0, RUN_S)
    cluster.run_until(RUN_S)
    cluster.check()
    return cluster


@pytest.fixture(scope="module")
def runs() -> dict[int, PlacementCluster]:
    return {seed: liar_swarm(seed) for seed in SEEDS}


def liar_reports(cluster: PlacementCluster) -> dict[int, dict[str, Any]]:
    verification = cluster.metrics()["verification"]
    assert isinstance(verification, dict)
    return {report["worker"]: report for report in verification["liars"]}


def test_every_always_liar_is_quarantined_soon_after_its_first_lie(
    runs: dict[int, PlacementCluster],
) -> None:
    for seed, cluster in runs.items():
        reports = liar_reports(cluster)
        for worker in (1, 6):
            report = reports[worker]
            assert report["detection_s"] is not None, f"seed {seed}: worker {worker} not caught"
            assert 0 < report["detection_s"] <= DETECTION_BOUND_S, (seed, report)
            assert report["first_lie_at"] >= LIARS[worker].from_s
            # Each answer it spoiled was routed through it before its quarantine.
            assert 1 <= report["wrong_answers"] <= report["requests_until_quarantine"]
            # The ledger benched it; coverage leaves it out of every route,
            # and placement released its managed shard.
            node = cluster.workers[worker].node
            standing = cluster.ledger().quarantine(node)
            assert standing is not None and standing.reason == "wrong_output"
            assert cluster.coverage().excluded[node] == "quarantined"
            assert cluster.ledger().assignment(node) is None


def test_no_honest_worker_is_ever_quarantined(runs: dict[int, PlacementCluster]) -> None:
    for seed, cluster in runs.items():
        metrics = cluster.metrics()
        verification = metrics["verification"]
        assert isinstance(verification, dict)
        assert verification["false_quarantines"] == 0, seed
        assert set(cluster.quarantined_at) <= set(LIARS), seed
        benched = cluster.ledger().quarantined(cluster.now)
        assert {i for i, w in enumerate(cluster.workers) if w.node in benched} <= set(LIARS)
        assert metrics["violations"] == 0  # no route through a quarantined node, among others


def test_answers_are_all_correct_after_the_last_quarantine(
    runs: dict[int, PlacementCluster],
) -> None:
    for seed, cluster in runs.items():
        reports = liar_reports(cluster)
        # Every liar that lied was caught (the 5% one may never have been routed).
        assert all(
            r["quarantined_at"] is not None
            for r in reports.values()
            if r["first_lie_at"] is not None
        ), seed
        last = max(cluster.quarantined_at.values())
        after = [correct for at, correct in cluster.answers if at >= last]
        assert after and all(after), f"seed {seed}: a wrong answer after {last}"
        verification = cluster.metrics()["verification"]
        assert isinstance(verification, dict)
        assert verification["served_correct_fraction"] < 1.0  # the liars did harm first


def test_the_same_seed_gives_the_same_run(runs: dict[int, PlacementCluster]) -> None:
    again = liar_swarm(3)
    assert again.metrics() == runs[3].metrics()
    assert again.answers == runs[3].answers
    assert runs[3].metrics()["trace_digest"] != runs[4].metrics()["trace_digest"]


def test_without_checks_liars_keep_serving() -> None:
    unchecked = liar_swarm(1, dataclasses.replace(POLICY, verify_fraction=0.0))
    metrics = unchecked.metrics()
    verification = metrics["verification"]
    assert isinstance(verification, dict)
    assert verification["checked"] == 0 and not unchecked.quarantined_at
    assert "Verdict" not in unchecked.committed
    assert verification["served_correct_fraction"] < 0.8


LIARS_SCENARIO = REPO / "simulations" / "scenarios" / "liars.toml"


def test_the_shipped_liars_scenario_tells_its_story() -> None:
    result = run_scenario(LIARS_SCENARIO, seed=1)
    assert result["violations"] == 0 and "invariant_failure" not in result
    verification = result["verification"]
    assert verification["false_quarantines"] == 0
    assert [liar["worker"] for liar in verification["liars"]] == [1, 4, 6]
    for liar in verification["liars"]:
        assert liar["detection_s"] is not None and liar["requests_until_quarantine"] >= 1
    # Worker 1 served its span alone at first: its lies then went unchecked.
    assert verification["unchecked"] >= 1 and verification["caught"] >= 3
    assert 0.8 < verification["served_correct_fraction"] < 1.0
    # Each verdict released the liar's managed shard.
    assert result["committed"]["Verdict"] >= 3 and result["committed"]["Release"] >= 3
    assert result["provenance"]["resolved"]["placement"]["policy"]["verify_fraction"] == 0.25


def test_the_plot_shows_the_served_correct_fraction_and_the_quarantines(
    runs: dict[int, PlacementCluster], tmp_path: Path
) -> None:
    cluster = runs[0]
    assert write_verification_plot(cluster, tmp_path) == tmp_path / "verification.png"
    assert (tmp_path / "verification.png").read_bytes().startswith(b"\x89PNG")
    header, *rows = (tmp_path / "verification.csv").read_text().splitlines()
    assert header == "time_s,served,correct"
    bins = [(float(start), int(served), int(correct)) for start, served, correct in
            (row.split(",") for row in rows)]  # fmt: skip
    assert sum(served for _, served, _ in bins) == len(cluster.answers)
    # Every bin after the last quarantine is all correct; some before it was not.
    last = max(cluster.quarantined_at.values())
    assert all(served == correct for start, served, correct in bins if start >= last)
    assert any(served > correct for start, served, correct in bins if start < last)


def scenario(worker: dict[str, Any] | None = None, **placement: Any) -> dict[str, Any]:
    """A small placement scenario: one worker (with `worker`'s keys), and
    `placement` merged into its table."""
    table = {
        "models": [{"name": "y", "layers": 4, "layer_gb": 1}],
        "workers": [{"memory_gb": 8, "models": ["y"]} | (worker or {})],
    }
    return {"duration": 30.0, "placement": table | placement}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            scenario({"lies": {"rate": 0}}),
            r"placement\.workers\[0\]\.lies\.rate: 0\.0 must be positive",
        ),
        (scenario({"lies": {"rate": 1.5}}), r"lies\.rate: 1\.5 is not in \(0, 1\.0\]"),
        (scenario({"lies": {"rate": "often"}}), r"lies\.rate: 'often' is not a number"),
        (scenario({"lies": {}}), r"lies\.rate: required"),
        (
            scenario({"lies": {"rate": 0.5, "from": 3.0}}),
            r"lies\.from: unknown key; placement\.workers\[0\]\.lies allows from_s, rate",
        ),
        (scenario({"lies": 0.5}), r"placement\.workers\[0\]\.lies must be a table"),
        (scenario({"lies": {"rate": 0.5, "from_s": -1}}), r"from_s: -1\.0 is not in \[0\.0, inf\)"),
        (
            scenario({"lies": {"rate": 0.5, "from_s": 30}}),
            r"lies\.from_s: 30\.0 is not before the run ends \(30\.0\): it would never lie",
        ),
        (
            scenario(policy={"verify_fraction": 1.5}),
            r"placement\.policy: verify_fraction must be in \[0, 1\]",
        ),
        (
            scenario(policy={"verify_fracton": 0.5}),
            r"placement\.policy\.verify_fracton: unknown key",
        ),
        (
            scenario(policy={"max_copies": 2.5}),
            r"placement\.policy\.max_copies: 2\.5 is not an integer",
        ),
    ],
)
def test_bad_liars_and_policies_are_errors_naming_the_key(
    bad: dict[str, Any], message: str
) -> None:
    with pytest.raises(ScenarioError, match=message):
        resolve(bad)


def test_liars_and_the_policy_resolve_with_their_defaults() -> None:
    resolved = resolve(scenario({"lies": {"rate": 0.5}}))
    assert resolved["placement"]["workers"][0]["lies"] == {"from_s": 0.0, "rate": 0.5}
    assert resolved["placement"]["policy"] == policy_json(PlacementSettings())
    assert resolve(scenario())["placement"]["workers"][0]["lies"] is None
    # A sweep sets a knob by its dotted path, as any other key.
    swept = resolve(with_setting(scenario(), "placement.policy.verify_fraction", 0.5))
    assert swept["placement"]["policy"]["verify_fraction"] == 0.5
