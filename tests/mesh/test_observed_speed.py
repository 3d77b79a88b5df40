"""What entries observed hops take per decode step: the cross-check of the
hops' own reports with the entry's clock, smoothing, and bounded memory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.observed_speed import (
    MAX_OBSERVED_NODES,
    NETWORK_ALLOWANCE_S,
    OBSERVATION_WEIGHT,
    ObservedSpeeds,
)

A, B, C = b"\x0a" * 32, b"\x0b" * 32, b"\x0c" * 32


def test_an_honest_one_hop_chain_is_charged_its_wall_time_less_the_network() -> None:
    speeds = ObservedSpeeds()
    # 10 steps of 4 ms reported compute; the entry saw 5 ms per step.
    assert speeds.observe([A], [40_000], 10, wall_s=0.05, wall_steps=10)
    assert speeds.step_s()[A] == pytest.approx(0.005 - 2 * NETWORK_ALLOWANCE_S)


def test_network_within_the_allowance_is_not_charged() -> None:
    speeds = ObservedSpeeds()
    # Two hops, 3 messages per step: 1 ms unexplained is within 1.5 ms.
    speeds.observe([A, B], [20_000, 30_000], 10, wall_s=0.06, wall_steps=10)
    assert speeds.step_s() == {A: pytest.approx(0.002), B: pytest.approx(0.003)}


def test_an_under_reporting_liar_in_a_one_hop_chain_is_charged_by_the_wall_clock() -> None:
    speeds = ObservedSpeeds()
    # It says its steps took no time at all; the entry saw 50 ms each.
    speeds.observe([A], [0], 20, wall_s=1.0, wall_steps=20)
    assert speeds.step_s()[A] == pytest.approx(0.05 - 2 * NETWORK_ALLOWANCE_S)


def test_unexplained_time_is_split_evenly_over_the_hops() -> None:
    speeds = ObservedSpeeds()
    # B hides 30 ms per step: the entry saw 40 ms, the hops account for 10.
    speeds.observe([A, B], [100_000, 0], 10, wall_s=0.4, wall_steps=10)
    share = (0.04 - 0.01 - 3 * NETWORK_ALLOWANCE_S) / 2
    assert speeds.step_s() == {A: pytest.approx(0.01 + share), B: pytest.approx(share)}


def test_reports_beyond_the_entry_clock_are_scaled_down_to_it() -> None:
    """A hop that inflates a predecessor's figure cannot push it past what
    the entry saw pass."""
    speeds = ObservedSpeeds()
    speeds.observe([A, B], [300_000, 100_000], 10, wall_s=0.02, wall_steps=10)
    assert speeds.step_s() == {A: pytest.approx(0.0015), B: pytest.approx(0.0005)}


def test_figures_are_smoothed_over_generations() -> None:
    speeds = ObservedSpeeds()
    allowance = 2 * NETWORK_ALLOWANCE_S
    speeds.observe([A], [100_000], 10, wall_s=0.1 + 10 * allowance, wall_steps=10)
    assert speeds.step_s()[A] == pytest.approx(0.01)
    speeds.observe([A], [200_000], 10, wall_s=0.2 + 10 * allowance, wall_steps=10)
    assert speeds.step_s()[A] == pytest.approx(0.01 + OBSERVATION_WEIGHT * 0.01)


def test_timing_of_other_steps_than_the_wall_time_is_skipped() -> None:
    speeds = ObservedSpeeds()
    # A failover restarted the chain's timing: 4 steps timed, 9 on the clock.
    assert not speeds.observe([A], [4_000], 4, wall_s=0.5, wall_steps=9)
    # One token only: no decode step at all.
    assert not speeds.observe([A], [0], 0, wall_s=0.0, wall_steps=0)
    assert speeds.step_s() == {}
    assert speeds.to_json() == {}


def test_malformed_timing_is_refused() -> None:
    speeds = ObservedSpeeds()
    with pytest.raises(ValueError):
        speeds.observe([A, B], [1], 1, wall_s=0.1, wall_steps=1)
    with pytest.raises(ValueError):
        speeds.observe([], [], 1, wall_s=0.1, wall_steps=1)
    with pytest.raises(ValueError):
        speeds.observe([A], [1], 1, wall_s=-0.1, wall_steps=1)
    with pytest.raises(ValueError):
        ObservedSpeeds(capacity=0)


def test_memory_is_bounded_and_the_least_recently_observed_goes_first() -> None:
    speeds = ObservedSpeeds(capacity=2)
    for node in (A, B):
        speeds.observe([node], [1_000], 1, wall_s=0.01, wall_steps=1)
    speeds.observe([A], [1_000], 1, wall_s=0.01, wall_steps=1)  # A is now the freshest
    speeds.observe([C], [1_000], 1, wall_s=0.01, wall_steps=1)
    assert set(speeds.step_s()) == {A, C}
    assert ObservedSpeeds().capacity == MAX_OBSERVED_NODES


def test_status_shows_milliseconds_by_hex_node_id() -> None:
    speeds = ObservedSpeeds()
    speeds.observe([A], [0], 1, wall_s=0.0125 + 2 * NETWORK_ALLOWANCE_S, wall_steps=1)
    assert speeds.to_json() == {A.hex(): 12.5}


@settings(max_examples=300, deadline=None)
@given(
    reported=st.lists(st.integers(0, 10**7), min_size=1, max_size=6),
    steps=st.integers(1, 500),
    wall_s=st.floats(0, 100, allow_nan=False),
)
def test_the_entry_clock_bounds_what_one_generation_charges(
    reported: list[int], steps: int, wall_s: float
) -> None:
    """The hops of one generation are charged, together, the entry's wall time
    per step less at most the network allowance; never more, never less,
    whatever they report."""
    nodes = [bytes([i]) * 32 for i in range(len(reported))]
    speeds = ObservedSpeeds()
    assert speeds.observe(nodes, reported, steps, wall_s=wall_s, wall_steps=steps)
    charged = speeds.step_s()
    wall = wall_s / steps
    total = sum(reported) / 1e6 / steps
    assert all(charged[node] >= 0 for node in nodes)
    allowance = NETWORK_ALLOWANCE_S * (len(nodes) + 1)
    expected = max(min(total, wall), wall - allowance)
    assert sum(charged.values()) == pytest.approx(expected, rel=1e-9, abs=1e-12)


# --- prefill ------------------------------------------------------------------------


def test_a_prefill_gives_each_hop_its_own_seconds_per_prompt_token() -> None:
    speeds = ObservedSpeeds()
    # 100 tokens: A reported 50 ms, B 2 s; the entry saw 2.2 s (the rest is
    # network and the step's fixed costs, which the decode figure covers).
    assert speeds.observe_prefill([A, B], [50_000, 2_000_000], 100, wall_s=2.2)
    assert speeds.prefill_s_per_token() == {A: pytest.approx(0.0005), B: pytest.approx(0.02)}
    assert speeds.step_s() == {}  # routes price decode steps only


def test_prefill_reports_beyond_the_entry_clock_are_scaled_down_to_it() -> None:
    speeds = ObservedSpeeds()
    # Inflated reports (8 s in all) for a step the entry saw take 2 s.
    speeds.observe_prefill([A, B], [2_000_000, 6_000_000], 100, wall_s=2.0)
    assert speeds.prefill_s_per_token() == {A: pytest.approx(0.005), B: pytest.approx(0.015)}


def test_prefill_figures_are_smoothed_and_bounded_like_decode_ones() -> None:
    speeds = ObservedSpeeds(capacity=2)
    speeds.observe_prefill([A], [100_000], 10, wall_s=1.0)
    speeds.observe_prefill([A], [200_000], 10, wall_s=1.0)
    assert speeds.prefill_s_per_token()[A] == pytest.approx(0.01 + OBSERVATION_WEIGHT * 0.01)
    speeds.observe_prefill([B], [1_000], 1, wall_s=1.0)
    speeds.observe_prefill([C], [1_000], 1, wall_s=1.0)
    assert set(speeds.prefill_s_per_token()) == {B, C}


def test_a_prefill_without_tokens_is_skipped_and_malformed_ones_refused() -> None:
    speeds = ObservedSpeeds()
    # The chain's timing had no report of its first step (a hop did not report).
    assert not speeds.observe_prefill([A], [0], 0, wall_s=0.0)
    assert speeds.prefill_s_per_token() == {}
    with pytest.raises(ValueError):
        speeds.observe_prefill([A, B], [1], 1, wall_s=0.1)
    with pytest.raises(ValueError):
        speeds.observe_prefill([A], [-1], 1, wall_s=0.1)
    with pytest.raises(ValueError):
        speeds.observe_prefill([A], [1], 1, wall_s=-0.1)
