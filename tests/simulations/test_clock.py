"""A simulated node's own clock: its reading at a virtual time, the virtual
time it reaches a reading, and skews that change its rate or leap ahead."""

from __future__ import annotations

import pytest

from simulations.clock import NodeClock


def test_a_clock_reads_linearly_from_its_last_change() -> None:
    clock = NodeClock(since=10.0, reading=10.0, rate=2.0)
    assert clock.local(10.0) == 10.0
    assert clock.local(13.0) == 16.0


def test_virtual_is_the_first_time_the_clock_reads_at_least_the_reading() -> None:
    for rate in (0.5, 1.0, 3.0, 1e-9):
        clock = NodeClock(since=5.0, reading=7.0, rate=rate)
        for reading in (7.0, 7.1, 8.0, 123.456):
            when = clock.virtual(reading)
            assert clock.local(when) >= reading  # a tick then finds its deadline due
            assert when == pytest.approx(5.0 + (reading - 7.0) / rate, rel=1e-9)


def test_a_reading_from_before_the_last_change_maps_to_before_it() -> None:
    clock = NodeClock(since=20.0, reading=30.0, rate=1.0)
    assert clock.virtual(25.0) <= 20.0


def test_a_skew_leaps_ahead_and_changes_the_rate_from_now_on() -> None:
    clock = NodeClock(since=0.0, reading=0.0, rate=1.0)
    clock.skew(10.0, rate=0.5, jump=5.0)
    assert clock.local(10.0) == 15.0
    assert clock.local(20.0) == 20.0
    clock.skew(20.0, rate=1.0, jump=0.0)  # set right: counts true seconds again
    assert clock.local(25.0) == 25.0


@pytest.mark.parametrize(("rate", "jump"), [(0.0, 0.0), (-1.0, 0.0), (1.0, -0.5)])
def test_a_clock_never_stops_runs_backwards_or_steps_back(rate: float, jump: float) -> None:
    clock = NodeClock(since=0.0, reading=0.0, rate=1.0)
    with pytest.raises(ValueError, match="positive rate"):
        clock.skew(1.0, rate=rate, jump=jump)
