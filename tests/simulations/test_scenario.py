"""Scenario files run to metrics: reading TOML or a dict, nearest-rank
quantiles, flapping windows, provenance, and the same run for the same seed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from simulations.scenario import (
    load_scenario,
    provenance,
    quantile,
    run_scenario,
    windows,
)
from simulations.schema import ScenarioError, resolve

SMALL = {"name": "small", "duration": 5.0, "nodes": {"count": 8}}


def test_a_quantile_is_a_value_some_node_actually_had() -> None:
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([3.0, 1.0, 2.0], 0.999) == 3.0
    assert quantile([3.0, 1.0, 2.0], 0.0) == 1.0
    assert quantile([0.1 * i for i in range(1, 1001)], 0.999) == pytest.approx(99.9)


def test_a_link_fault_is_on_once_or_for_its_duty_of_every_period() -> None:
    assert windows(10.0, 30.0, None) == [(10.0, 30.0)]
    assert windows(10.0, 30.0, {"period": 10.0, "duty": 0.5}) == [(10.0, 15.0), (20.0, 25.0)]
    assert windows(0.0, 12.0, {"period": 5.0, "duty": 0.6}) == [
        (0.0, 3.0),
        (5.0, 8.0),
        (10.0, 12.0),  # cut short by the heal
    ]


def test_a_scenario_loads_from_toml_or_a_dict(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('name = "small"\nduration = 5.0\n[nodes]\ncount = 8\n')
    assert load_scenario(path) == SMALL
    assert load_scenario(str(path)) == SMALL
    assert load_scenario(SMALL) == SMALL and load_scenario(SMALL) is not SMALL
    path.write_text("name = = 1\n")
    with pytest.raises(ScenarioError, match="invalid TOML"):
        load_scenario(path)


def test_provenance_hashes_the_scenario_as_written_and_as_it_ran() -> None:
    resolved = resolve(SMALL)
    about = provenance(b"written", resolved, seed=3)
    assert about["scenario_sha256"] == hashlib.sha256(b"written").hexdigest()
    canonical = json.dumps(about["resolved"], sort_keys=True, separators=(",", ":"))
    assert about["resolved_sha256"] == hashlib.sha256(canonical.encode()).hexdigest()
    assert about["seed"] == 3 and about["core"] in ("python", "mypyc")
    assert about["resolved"]["nodes"]["count"] == 8


def test_the_same_seed_gives_the_same_run_and_the_timeline_is_what_the_digest_covers() -> None:
    scenario = SMALL | {"duration": 20.0, "faults": [{"kind": "crash", "random": 1, "at": 2.0}]}
    timeline: list[str] = []
    first = run_scenario(scenario, seed=1, timeline=timeline)
    assert first == run_scenario(scenario, seed=1)
    assert first["scenario"] == "small" and first["seed"] == 1 and first["duration"] == 20.0
    resolved = first["provenance"]["resolved_sha256"]
    assert f"0.000000 -1 scenario -1 {resolved}" in timeline
    text = "".join(line + "\n" for line in timeline)
    assert hashlib.sha256(text.encode()).hexdigest() == first["trace_digest"]
    # The seed picks the node that crashes, and everything after it.
    assert run_scenario(scenario, seed=2)["trace_digest"] != first["trace_digest"]


def test_a_scenario_with_a_placement_table_runs_placement() -> None:
    scenario = {
        "duration": 10.0,
        "placement": {
            "models": [{"name": "y", "layers": 32, "layer_gb": 0.5}],
            "workers": [{"memory_gb": 24, "models": ["y"]}],
        },
    }
    metrics = run_scenario(scenario, seed=1)
    assert "verification" in metrics and "committed" in metrics
    assert metrics["provenance"]["resolved"]["placement"]["voters"] == 3
