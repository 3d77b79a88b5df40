"""Sweeps: a grid of seeds x settings, one CSV row per run, reproducible row for row."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from simulations.scenario import load_scenario, run_scenario
from simulations.schema import ScenarioError
from simulations.sweep import Setting, grid, parse_seeds, run_sweep, with_setting, write_csv
from tests import REPO

SCENARIO = """
name = "tiny-sweep"
duration = 10.0
[nodes]
count = 6
[[faults]]
kind = "crash"
node = 3
at = 2.0
"""
ROOT = REPO


def sweep_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=cwd,
    )


def test_three_values_by_ten_seeds_write_thirty_reproducible_rows(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    args = ["--seeds", "1..10", "--set", "membership.suspicion_mult=2,3,4"]
    serial = sweep_cli(str(scenario), *args, "--csv", "one.csv", cwd=tmp_path)
    parallel = sweep_cli(str(scenario), *args, "--jobs", "2", "--csv", "two.csv", cwd=tmp_path)
    assert serial.returncode == parallel.returncode == 0, serial.stderr + parallel.stderr
    one = (tmp_path / "one.csv").read_text()
    assert one == (tmp_path / "two.csv").read_text()  # row for row, whatever the jobs
    rows = list(csv.DictReader(one.splitlines()))
    assert len(rows) == 30
    assert [(r["membership.suspicion_mult"], r["seed"]) for r in rows[:11]] == [
        *(("2", str(seed)) for seed in range(1, 11)),
        ("3", "1"),
    ]
    # A row is the run of that one scenario, seed and setting alone.
    alone = run_scenario(
        with_setting(load_scenario(scenario), "membership.suspicion_mult", 4), seed=7
    )
    row = next(r for r in rows if r["seed"] == "7" and r["membership.suspicion_mult"] == "4")
    assert row["trace_digest"] == alone["trace_digest"]
    assert float(row["view_agreement"]) == alone["view_agreement"]
    # The swept key reached the runs: a longer suspicion, a later death.
    digests = {r["trace_digest"] for r in rows if r["seed"] == "1"}
    assert len(digests) == 3


def test_the_python_api_and_its_errors(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    settings = [Setting.parse("network.loss=0.0,0.05"), Setting.parse("nodes.join=seed")]
    assert settings[1].values == ("seed",)  # a bare word is a string
    assert grid([1, 2], settings) == [
        (1, {"network.loss": 0.0, "nodes.join": "seed"}),
        (2, {"network.loss": 0.0, "nodes.join": "seed"}),
        (1, {"network.loss": 0.05, "nodes.join": "seed"}),
        (2, {"network.loss": 0.05, "nodes.join": "seed"}),
    ]
    rows = run_sweep(scenario, [1, 2], settings)
    write_csv(rows, tmp_path / "out.csv")
    assert len(list(csv.DictReader((tmp_path / "out.csv").open()))) == 4
    assert parse_seeds("3..5") == [3, 4, 5] and parse_seeds("1,9") == [1, 9]
    with pytest.raises(ScenarioError, match="--seeds"):
        parse_seeds("one..two")
    with pytest.raises(ScenarioError, match=r"KEY\.PATH=VALUE"):
        Setting.parse("membership.suspicion_mult")
    # Every setting is checked before any run starts, naming the key.
    with pytest.raises(ScenarioError, match=r"network\.los: unknown key"):
        run_sweep(scenario, [1], [Setting.parse("network.los=0.1")])
    with pytest.raises(ScenarioError, match=r"network\.loss: 'lots' is not a number"):
        run_sweep(scenario, [1], [Setting.parse("network.loss=lots")])
