"""`shardmesh simulate` as a user runs it: a real subprocess on a scenario file."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SCENARIO = """
name = "tiny"
duration = 30.0
[nodes]
count = 20
[network]
loss = 0.05
[[faults]]
kind = "crash"
node = 3
at = 5.0
[[faults]]
kind = "publish"
node = 1
at = 8.0
"""
PLOTS = ("membership.png", "traffic.png", "spread.png")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def simulate(
    *args: str, python: Sequence[str] = ("-m", "runtime.cli")
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *python, "simulate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_same_seed_gives_the_same_metrics_and_digest(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    first = simulate(str(scenario), "--seed", "4", "--json", "--out", str(tmp_path / "out"))
    again = simulate(str(scenario), "--seed", "4", "--json")
    other = simulate(str(scenario), "--seed", "5", "--json")
    assert first.returncode == again.returncode == other.returncode == 0, first.stderr
    one, two, three = (json.loads(r.stdout) for r in (first, again, other))
    assert one == two
    assert one["trace_digest"] != three["trace_digest"]
    assert one["detections"][0]["detected_fraction"] == 1.0
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == one
    # The timeline is exactly what the trace digest covers.
    timeline = (tmp_path / "out" / "timeline.txt").read_bytes()
    assert timeline.count(b"\n") == one["trace_lines"]
    assert hashlib.sha256(timeline).hexdigest() == one["trace_digest"]
    # The --out run drew its plots by running in sampled steps, and its
    # metrics and digest equal the plain run's (`one == two` above).
    for name in PLOTS:
        image = (tmp_path / "out" / name).read_bytes()
        assert image.startswith(PNG_SIGNATURE) and len(image) > 10_000, name


def test_without_matplotlib_the_metrics_are_written_and_plots_skipped(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    hide_matplotlib = (
        "import sys; sys.modules['matplotlib'] = None; from runtime.cli.main import main; "
        "sys.argv[0] = 'shardmesh'; sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "out"
    result = simulate(str(scenario), "--json", "--out", str(out), python=("-c", hide_matplotlib))
    assert result.returncode == 0, result.stderr
    assert "warning: no plots: matplotlib is not installed" in result.stderr
    assert json.loads((out / "metrics.json").read_text()) == json.loads(result.stdout)
    assert not any((out / name).exists() for name in PLOTS)


def test_a_bad_scenario_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[nodes]\ncount = 'many'\n")
    result = simulate(str(broken))
    assert result.returncode == 1
    assert "broken.toml" in result.stderr
    missing = simulate(str(tmp_path / "absent.toml"))
    assert missing.returncode == 1 and "no scenario file" in missing.stderr
