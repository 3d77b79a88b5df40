"""The WAN benchmark (`benchmarks.wan`): the floor it divides by, and one
quick case of real processes in a lab, as `--quick --json` prints it (root
only: elsewhere it skips, saying why no lab can be built)."""

from __future__ import annotations

import json

import pytest

from benchmarks.wan import (
    HEADLINE,
    RELAY_WHY,
    TARGET_PER_TOKEN_VS_FLOOR,
    floor_ms,
    loop_ms,
    main,
    spec,
)
from runtime.lab.topology import load_topology
from tests.runtime.lab.fixtures import skip_without_lab


def test_the_loop_is_the_one_way_delays_back_to_the_entry() -> None:
    topology = load_topology(spec(40.0, 0.01))
    # The entry is the first hop: a -> a costs nothing, then a -> b -> c -> a.
    assert loop_ms(topology, ["a", "a", "b", "c"]) == 60.0
    # An entry of its own adds its way in and out.
    assert loop_ms(topology, ["a", "b", "c"]) == 60.0
    assert loop_ms(load_topology(spec(100.0, 0.0)), ["a", "b", "c"]) == 150.0


def test_the_floor_adds_each_hops_measured_compute() -> None:
    topology = load_topology(spec(10.0, 0.0))
    timing = {"hops": [{"decode_ms_per_step": ms} for ms in (0.5, 0.25, 0.25)]}
    assert floor_ms(topology, ["a", "a", "b", "c"], timing) == {
        "loop_ms": 15.0,
        "compute_ms": 1.0,
        "floor_ms": 16.0,
    }


def test_quick_mode_measures_the_headline_case_in_a_lab(
    capsys: pytest.CaptureFixture[str],
) -> None:
    skip_without_lab()
    assert main(["--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (case,) = result["cases"]
    assert (case["rtt_ms"], case["loss"]) == HEADLINE
    assert case["lab_ok"], case
    assert case["route_sites"] == ["a", "b", "c"]
    assert case["loop_ms"] == 60.0
    # Nothing beats the loop's own delays, and the figure is the headline.
    assert case["per_token_ms"] >= case["loop_ms"]
    assert result["wan_per_token_vs_floor"] == case["per_token_vs_floor"] > 1.0
    assert result["target_wan_per_token_vs_floor"] == TARGET_PER_TOKEN_VS_FLOOR
    assert 0 <= result["rtt_error_ms"] < 3.0
    assert result["relay_per_token_vs_direct"] is None
    assert result["relay_per_token_vs_direct_why"] == RELAY_WHY
