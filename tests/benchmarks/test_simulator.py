"""The simulator benchmark's arithmetic (`benchmarks.simulator`): the
growth exponent, a stopped case's figures, and the two cores side by side.
The cases themselves are minutes of CPU; `--quick` is their smoke test."""

from __future__ import annotations

import math

import pytest

from benchmarks.simulator import _figure, growth_exponent, side_by_side


def test_the_growth_exponent_is_the_log_log_slope() -> None:
    linear = [{"nodes": n, "cpu_s": 0.01 * n} for n in (1000, 3000, 10_000)]
    assert growth_exponent(linear) == pytest.approx(1.0)
    quadratic = [{"nodes": n, "cpu_s": 1e-6 * n * n} for n in (250, 500, 1000)]
    assert growth_exponent(quadratic) == pytest.approx(2.0)
    n_log_n = [{"nodes": n, "cpu_s": n * math.log(n)} for n in (1000, 3000, 10_000)]
    assert 1.0 < growth_exponent(n_log_n) < 1.2  # what the target calls "about N log N"


def test_a_stopped_case_has_no_figures() -> None:
    assert _figure({"cpu_s": 12.345}, "cpu_s", 1) == 12.3
    assert _figure({"cpu_s": 99.0, "stopped": "cpu"}, "cpu_s", 1) is None


def test_side_by_side_gives_the_speedup_and_whether_the_runs_were_the_same() -> None:
    run = {"cpu_s": 10.0, "trace_digest": "ab", "loop_events": 5, "view_agreement": 1.0}
    compiled = {**run, "cpu_s": 4.0}
    both = side_by_side(run, compiled)
    assert both["speedup"] == 2.5 and both["same_run"] is True
    assert both["python"] is run and both["mypyc"] is compiled
    assert side_by_side(run, {**compiled, "trace_digest": "cd"})["same_run"] is False
    stopped = side_by_side(run, {**compiled, "stopped": "memory"})
    assert set(stopped) == {"python", "mypyc"}
