"""The simulator's event loop: ordering, ties, cancellation, clock."""

from __future__ import annotations

import gc
import math

import pytest

from simulations.loop import EventLoop


def test_events_run_in_time_order_and_ties_in_insertion_order() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    for name, when in [("c", 3.0), ("a", 1.0), ("b1", 2.0), ("b2", 2.0), ("b3", 2.0)]:
        loop.call_at(when, lambda name=name: seen.append((loop.now, name)))
    loop.post(2.0, lambda arg: seen.append((loop.now, arg)), "b4")
    loop.run_until(10.0)
    assert seen == [(1.0, "a"), (2.0, "b1"), (2.0, "b2"), (2.0, "b3"), (2.0, "b4"), (3.0, "c")]
    assert loop.now == 10.0
    assert loop.events_run == 6


def test_run_until_stops_at_the_bound_and_keeps_later_events() -> None:
    loop = EventLoop()
    seen: list[float] = []
    for when in (0.5, 1.0, 1.5):
        loop.call_at(when, lambda: seen.append(loop.now))
    loop.run_until(1.0)
    assert seen == [0.5, 1.0]
    assert loop.now == 1.0
    loop.run_until(2.0)
    assert seen == [0.5, 1.0, 1.5]


def test_cancelled_timers_do_not_run_and_report_cancelled() -> None:
    loop = EventLoop()
    seen: list[str] = []
    keep = loop.call_later(1.0, lambda: seen.append("keep"))
    drop = loop.call_later(1.0, lambda: seen.append("drop"))
    drop.cancel()
    assert drop.cancelled and not keep.cancelled
    assert keep.when == 1.0
    loop.run_until(5.0)
    assert seen == ["keep"]
    assert keep.cancelled  # fired timers read as done
    keep.cancel()  # harmless after firing


def test_callbacks_can_schedule_and_cancel_during_the_run() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    later = loop.call_at(3.0, lambda: seen.append((loop.now, "cancelled")))

    def first() -> None:
        seen.append((loop.now, "first"))
        later.cancel()
        loop.call_later(0.5, lambda: seen.append((loop.now, "chained")))
        loop.call_at(0.0, lambda: seen.append((loop.now, "past")))

    loop.call_at(1.0, first)
    loop.run_until(10.0)
    # Scheduling in the past runs at "now", after what was already due.
    assert seen == [(1.0, "first"), (1.0, "past"), (1.5, "chained")]


def test_run_while_stops_when_the_predicate_fails() -> None:
    loop = EventLoop()
    counter = [0]

    def bump() -> None:
        counter[0] += 1
        loop.call_later(1.0, bump)

    loop.call_at(0.0, bump)
    assert loop.run_while(lambda: counter[0] < 5, until=100.0) is False
    assert counter[0] == 5
    assert loop.now == 4.0
    # With a coarse check interval the predicate is only seen every 10 s.
    assert loop.run_while(lambda: counter[0] < 20, until=100.0, check_every=10.0) is False
    assert counter[0] == 25
    assert loop.run_while(lambda: True, until=50.0) is True
    assert loop.now == 50.0


def test_stop_and_next_time() -> None:
    loop = EventLoop()
    loop.call_at(1.0, loop.stop)
    skipped = loop.call_at(0.5, lambda: None)
    skipped.cancel()
    loop.call_at(2.0, lambda: None)
    assert loop.next_time() == 1.0
    loop.run_until(math.inf)
    assert loop.now == 1.0
    assert loop.next_time() == 2.0
    loop.run_until(math.inf)
    assert loop.next_time() == math.inf
    with pytest.raises(ValueError):
        loop.run_while(lambda: True, until=3.0, check_every=0.0)


def test_many_posted_events_all_run_in_order() -> None:
    """200k chained events (~0.2 s): every one runs, the clock ends at the last."""
    loop = EventLoop()
    hits = [0]

    def hop(step: int) -> None:
        hits[0] += 1
        if step:
            loop.post(loop.now + 0.001, hop, step - 1)

    for _ in range(100):
        loop.post(0.0, hop, 1999)
    loop.run_until(math.inf)
    assert hits[0] == 200_000
    assert loop.events_run == 200_000
    assert loop.now == pytest.approx(1.999)


def test_a_run_makes_no_full_collection_yet_reclaims_young_cycles() -> None:
    """Objects that live through a run would each be walked by every full
    collection CPython makes (`simulations.loop._young_only`): none comes
    while the loop runs, young collections still free short-lived cycles,
    and the process's thresholds are what they were once it returns."""
    kept: list[list[int]] = []

    def allocate(i: int) -> None:
        kept.extend([i, j] for j in range(5000))  # survive the whole run
        for _ in range(50):
            cycle: list[object] = []
            cycle.append(cycle)  # garbage only a collection can free

    def freed() -> int:
        return sum(generation["collected"] for generation in gc.get_stats()[:2])

    loop = EventLoop()
    for i in range(300):
        loop.post(float(i), allocate, i)
    thresholds = gc.get_threshold()
    full_before, young_before, freed_before = (
        gc.get_stats()[2]["collections"],
        gc.get_stats()[0]["collections"],
        freed(),
    )
    loop.run_until(300.0)
    assert len(kept) == 1_500_000
    assert gc.get_stats()[2]["collections"] == full_before
    assert gc.get_stats()[0]["collections"] > young_before
    assert freed() - freed_before >= 10_000  # of the 15,000 cycles
    assert gc.get_threshold() == thresholds
