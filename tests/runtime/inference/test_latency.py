"""`runtime.inference.latency.Histogram`: fixed buckets, cumulative counts, sum."""

from __future__ import annotations

import pytest

from runtime.inference.hop_server import HopStats
from runtime.inference.latency import (
    INTER_TOKEN_BUCKETS_S,
    STEP_BUCKETS_S,
    TTFT_BUCKETS_S,
    Histogram,
    one_two_five,
)


def test_a_value_on_a_bound_falls_in_that_bounds_bucket() -> None:
    histogram = Histogram((0.1, 1.0, 10.0))
    for value in (0.0, 0.1, 0.10001, 1.0, 9.99, 10.0, 10.5, 1e9):
        histogram.observe(value)
    # le=0.1: 0.0 and 0.1; le=1: and 0.10001, 1.0; le=10: and 9.99, 10.0; +Inf: all.
    assert histogram.cumulative() == [2, 4, 6, 8]
    assert histogram.count == 8
    assert histogram.sum == pytest.approx(0.1 + 0.10001 + 1.0 + 9.99 + 10.0 + 10.5 + 1e9)


def test_an_empty_histogram_counts_nothing() -> None:
    histogram = Histogram((0.5,))
    assert histogram.cumulative() == [0, 0]
    assert histogram.to_json() == {"buckets": [[0.5, 0]], "count": 0, "sum": 0.0}


def test_the_json_has_the_finite_bounds_cumulative_then_count_and_sum() -> None:
    histogram = Histogram((1, 2, 4))
    for value in (0.5, 1.5, 1.5, 3.0, 8.0):
        histogram.observe(value)
    assert histogram.to_json() == {
        "buckets": [[1.0, 1], [2.0, 3], [4.0, 4]],
        "count": 5,  # the +Inf bucket
        "sum": 14.5,
    }


@pytest.mark.parametrize("bounds", [(), (1.0, 1.0), (2.0, 1.0), (1.0, float("inf"))])
def test_bounds_must_be_finite_and_strictly_increasing(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match=r"bucket|at least one"):
        Histogram(bounds)


@pytest.mark.parametrize("bounds", [TTFT_BUCKETS_S, INTER_TOKEN_BUCKETS_S, STEP_BUCKETS_S])
def test_the_fixed_buckets_are_valid_and_span_milliseconds_to_a_minute(
    bounds: tuple[float, ...],
) -> None:
    Histogram(bounds)
    assert bounds[0] <= 0.01 and bounds[-1] >= 30.0
    # Prometheus' `le` labels read as written: no float noise (0.00025, not 0.000250...06).
    assert all(float(repr(b)) == b and len(repr(b)) <= 7 for b in bounds)


def test_one_two_five_steps_through_decades() -> None:
    assert one_two_five(0.0001, 0.001) == (0.0001, 0.00025, 0.0005, 0.001)
    assert one_two_five(1.0, 7.0) == (1.0, 2.5, 5.0)


def test_a_hop_records_each_step_by_phase() -> None:
    stats = HopStats()
    for seconds in (0.0004, 0.002, 0.002):
        stats.count(1, seconds)  # decode steps
    stats.count(12, 0.3)  # a prefill
    step_s = stats.to_json()["step_s"]
    assert step_s["decode"]["count"] == stats.decode_steps == 3
    assert step_s["prefill"]["count"] == stats.prefill_steps == 1
    decode = dict(step_s["decode"]["buckets"])
    assert (decode[0.0005], decode[0.001], decode[0.0025]) == (1, 1, 3)
    assert step_s["prefill"]["sum"] == 0.3
