"""A discrete-event loop with a virtual clock.

The simulator replaces the trio driver's wall clock with this loop: time only
moves when the next event is taken off the heap, so a 600-second run of 1,000
nodes costs whatever the events cost, not 600 seconds, and the same inputs
always give the same order of events (ties run in the order scheduled).
It is the simulator's innermost loop, built for a few microseconds per
event: why each choice (plain-list heap entries, lazy cancellation, handles
that are heap entries, full GCs deferred) is in docs/design/simulator.md.
"""

from __future__ import annotations

import gc
import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from heapq import heappop, heappush
from typing import Any

_NO_ARG: Any = object()
"""Marks an entry whose callback takes no argument (``fn()`` not ``fn(arg)``)."""

_WHEN, _SEQ, _FN, _ARG = range(4)

FULL_COLLECTIONS_WAIT = 1_000_000_000
"""The oldest generation's threshold while a loop runs: young collections
between full ones, so many that none comes (`_young_only`)."""


@contextmanager
def _young_only() -> Iterator[None]:
    """Run the body with CPython's full (oldest-generation) collections
    held back; the thresholds are restored after.

    A large run holds millions of objects for its whole length (member
    entries, queued updates, suspicions, events in flight). A full
    collection walks every one of them, and CPython makes one each time
    that population grows by a quarter: a 1,000-node run with a 3-way
    partition spent a third of its CPU in them (168 CPU-s on the compiled
    core, `simulations.compiled`, against 108 with the collector off), and
    they found next to nothing (270 objects in the whole run: the protocol
    cores make almost no reference cycles). Young collections go on, so
    short-lived cycles are still reclaimed; a cycle that lives long enough
    to reach the oldest generation waits for the run to end.
    """
    young, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTIONS_WAIT)
    try:
        yield
    finally:
        gc.set_threshold(young, middle, old)


class Timer(list):
    """A cancellable scheduled callback; also the heap entry itself.

    Being the entry (rather than pointing at one) saves an allocation and an
    indirection per timer, and lets ``cancel`` be a single store.
    """

    __slots__ = ()

    @property
    def when(self) -> float:
        """The virtual time at which the callback runs (or would have run)."""
        return self[_WHEN]

    @property
    def cancelled(self) -> bool:
        """True once cancelled or once it has fired (it cannot fire again)."""
        return self[_FN] is None

    def cancel(self) -> None:
        """Stop the callback from running; harmless if it already ran."""
        self[_FN] = None


class EventLoop:
    """A heap of ``(time, sequence, callback)`` driven by a virtual clock.

    ``now`` is the time of the event being run (or of the last one run);
    scheduling in the past runs the callback at ``now``, after everything
    already due at ``now``, which is what a protocol's overdue timer would
    see from a real driver.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now: float = start
        self.events_run: int = 0
        self._heap: list[list[Any]] = []
        self._next_seq = itertools.count().__next__
        self._stopped = False

    # --- scheduling -------------------------------------------------------

    def post(self, when: float, fn: Callable[[Any], object], arg: Any) -> None:
        """Run ``fn(arg)`` at ``when``; no handle, no cancel: the hot path.

        Used for message deliveries, which are never cancelled (a message in
        flight to a crashed node is dropped on arrival instead).
        """
        if when < self.now:
            when = self.now
        heappush(self._heap, [when, self._next_seq(), fn, arg])

    def call_at(self, when: float, fn: Callable[..., object], arg: Any = _NO_ARG) -> Timer:
        """Run ``fn()`` (or ``fn(arg)``) at virtual time ``when``; returns a
        cancellable handle. Passing ``arg`` saves a closure per timer."""
        if when < self.now:
            when = self.now
        timer = Timer((when, self._next_seq(), fn, arg))
        heappush(self._heap, timer)
        return timer

    def call_later(self, delay: float, fn: Callable[..., object], arg: Any = _NO_ARG) -> Timer:
        """Run ``fn()`` (or ``fn(arg)``) ``delay`` seconds of virtual time from now."""
        return self.call_at(self.now + delay, fn, arg)

    # --- running ----------------------------------------------------------

    def stop(self) -> None:
        """Make the current ``run_*`` call return after the running event."""
        self._stopped = True

    def pending(self) -> int:
        """Entries still on the heap, cancelled ones included (lazy deletion)."""
        return len(self._heap)

    def next_time(self) -> float:
        """Time of the earliest live event, or ``inf`` when there is none."""
        heap = self._heap
        while heap and heap[0][_FN] is None:
            heappop(heap)
        return heap[0][_WHEN] if heap else math.inf

    def run_until(self, until: float) -> None:
        """Run every event due at or before ``until``; then ``now = until``.

        Leaving the clock at ``until`` (not at the last event) lets a caller
        schedule "``dt`` after the end of this phase" and mean it.
        """
        heap = self._heap
        pop = heappop
        no_arg = _NO_ARG
        count = 0
        self._stopped = False
        try:
            with _young_only():
                while heap and heap[0][0] <= until:
                    entry = pop(heap)
                    fn = entry[2]
                    if fn is None:
                        continue
                    entry[2] = None  # a fired Timer reads as done
                    self.now = entry[0]
                    count += 1
                    arg = entry[3]
                    if arg is no_arg:
                        fn()
                    else:
                        fn(arg)
                    if self._stopped:
                        return
        finally:
            self.events_run += count
        if until > self.now and until != math.inf:
            self.now = until

    def run_while(
        self,
        predicate: Callable[[], bool],
        until: float,
        check_every: float | None = None,
    ) -> bool:
        """Run while ``predicate()`` holds, but not past ``until``.

        Returns the predicate's last value (False: it stopped holding). With
        ``check_every`` the predicate is evaluated only at that virtual-time
        step, for predicates that are too costly to evaluate per event.
        """
        if check_every is not None:
            if check_every <= 0:
                raise ValueError("check_every must be positive")
            while self.now < until:
                if not predicate():
                    return False
                self.run_until(min(until, self.now + check_every))
            return predicate()
        heap = self._heap
        with _young_only():
            while heap and heap[0][_WHEN] <= until:
                if not predicate():
                    return False
                entry = heappop(heap)
                fn = entry[_FN]
                if fn is None:
                    continue
                entry[_FN] = None
                self.now = entry[_WHEN]
                self.events_run += 1
                arg = entry[_ARG]
                if arg is _NO_ARG:
                    fn()
                else:
                    fn(arg)
        holds = predicate()
        if holds and until > self.now and until != math.inf:
            self.now = until
        return holds
