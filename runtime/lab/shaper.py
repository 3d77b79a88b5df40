"""When a packet crossing the lab's core comes out, or whether it is lost.

The delayer (`runtime.lab.delayer`) asks `Shaper.admit` about each packet
it reads: from site A to site B at `now`, it crosses A's uplink then B's
downlink (`runtime.lab.topology`), each with its delay, uniform jitter and
loss. Sans-IO: time comes in as `now`, randomness as a `random.Random`, so
the same seed and arrivals give the same fate to every packet.

Jitter never reorders a flow: on each directed path (A to B) a packet
leaves no earlier than the one before it (`release = max(previous release,
now + delay + jitter)`), as on a real FIFO link. The price: packets closer
together than the jitter's spread queue behind each other, so their mean
delay rises towards delay + jitter, where a netem-style independent draw
would keep the mean and reorder them. Rate is not shaped here but by TBF
qdiscs in the kernel (`runtime.lab.netns`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from runtime.lab.topology import Link, Topology


@dataclass
class PathCounters:
    """What one directed path has seen: packets admitted and lost."""

    sent: int = 0
    lost: int = 0


class Shaper:
    """The fate of every packet between the sites of one topology."""

    def __init__(self, topology: Topology, rng: random.Random) -> None:
        self._rng = rng
        self._links = {s.name: (s.up, s.down) for s in topology.sites}
        self._last_release: dict[tuple[str, str], float] = {}
        self.paths: dict[tuple[str, str], PathCounters] = {}

    def admit(self, src: str, dst: str, now: float) -> float | None:
        """The time (same clock as `now`, seconds) the packet from `src` to
        `dst` leaves the core, or None when one of its links loses it."""
        up = self._links[src][0]
        down = self._links[dst][1]
        counters = self.paths.setdefault((src, dst), PathCounters())
        counters.sent += 1
        if self._lost(up) or self._lost(down):
            counters.lost += 1
            return None
        delay_s = (self._delay_ms(up) + self._delay_ms(down)) / 1000.0
        release = max(self._last_release.get((src, dst), now), now + delay_s)
        self._last_release[(src, dst)] = release
        return release

    def _lost(self, link: Link) -> bool:
        return link.loss > 0.0 and self._rng.random() < link.loss

    def _delay_ms(self, link: Link) -> float:
        if link.jitter_ms == 0.0:
            return link.delay_ms
        return max(0.0, link.delay_ms + self._rng.uniform(-link.jitter_ms, link.jitter_ms))
