"""A simulated node's own clock, when it disagrees with virtual time.

The membership core never reads a clock: every call passes it ``now``. A
node whose clock is wrong is modelled by handing its core its own reading
and running its ``tick`` at the virtual moment that clock reaches the
core's next deadline: a fast clock fires timers early, a slow one late, a
jump forward fires everything due in the gap at once. Only rate and steps
forward are modelled, never a step back, as the real driver's clock is
monotonic (docs/design/simulator.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class NodeClock:
    """A clock that read ``reading`` at virtual time ``since`` and has
    counted ``rate`` seconds per virtual second since: piecewise linear,
    each skew starting a new piece from the current reading."""

    since: float
    reading: float
    rate: float

    def local(self, now: float) -> float:
        """What the clock reads at virtual time ``now`` (not before ``since``)."""
        return self.reading + (now - self.since) * self.rate

    def virtual(self, local: float) -> float:
        """The first virtual time at which the clock reads ``local`` or
        later; a reading from before the last change maps to before it (so,
        to "now").

        Rounded up to a float where the clock has got there: a tick an ulp
        early would find its deadline not yet due, re-arm at the same time,
        and spin forever. The step doubles, so a very slow clock, whose
        reading moves less than an ulp per ulp of virtual time, gets there
        in a few dozen steps too.
        """
        when = self.since + (local - self.reading) / self.rate
        step = math.ulp(when)
        while self.local(when) < local:
            when += step
            step *= 2
        return when

    def skew(self, now: float, rate: float, jump: float) -> None:
        """From ``now`` on: read ``jump`` seconds ahead of where the clock
        was, and count ``rate`` seconds per virtual second."""
        if rate <= 0 or jump < 0:
            raise ValueError("a clock runs at a positive rate and only jumps forward")
        self.reading = self.local(now) + jump
        self.since = now
        self.rate = rate
