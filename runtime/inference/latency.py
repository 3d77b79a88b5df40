"""Latency histograms: what the entry and the hops record per request, token and step.

`Histogram` is sans-IO: the caller measures with its own clock and hands in
a duration; `observe` is a bisect into fixed buckets and two additions,
cheap enough for every decode step and token. It is read as Prometheus
reads a histogram (`runtime.api.metrics`). The buckets are fixed (1, 2.5
and 5 per decade, up to a minute) so every node's series can be summed
across a swarm.

One writer per histogram, readers in between, and the buckets:
docs/design/inference-protocol.md#latency-histograms.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from itertools import pairwise
from typing import Any, Final


def one_two_five(low: float, high: float) -> tuple[float, ...]:
    """1, 2.5 and 5 times each power of ten from `low` (a power of ten) up
    to `high`: (0.001, 10.0) is 0.001, 0.0025, 0.005, 0.01, ..., 5.0, 10.0."""
    bounds: list[float] = []
    exponent = round(math.log10(low))
    while True:
        for mantissa in (1.0, 2.5, 5.0):
            bound = round(mantissa * 10.0**exponent, 12)  # 0.00025, not 0.00025000000000000006
            if bound > high:
                return tuple(bounds)
            bounds.append(bound)
        exponent += 1


TTFT_BUCKETS_S: Final = (*one_two_five(0.01, 10.0), 30.0, 60.0)
"""Time to first token, at the entry: from accepting a request to its first
token (routing, tokenizing, the prefill through every hop, the token back).
A tiny model on loopback answers in 10-30 ms; a long prompt on volunteers'
CPUs or a first request that fetches the model's tokenizer takes seconds,
a long one through a slow hop tens of seconds; past a minute is +Inf."""

INTER_TOKEN_BUCKETS_S: Final = (*one_two_five(0.001, 10.0), 30.0)
"""Time between two tokens of one completion, at the entry: one decode step
through the whole chain, plus detokenizing and sending the last token. A
tiny model on loopback takes 1-3 ms; a healthy chain over a LAN or WAN tens
to hundreds of ms; a fast chain's step is declared failed after about 2 s
(`runtime.inference.deadlines`), and a failover (a replay on another
chain) shows as one gap of seconds to tens of seconds."""

STEP_BUCKETS_S: Final = (*one_two_five(0.0001, 10.0), 30.0, 60.0)
"""One forward of this node's shard (with sampling on the last hop), by the
hop's own clock: a decode step of a few layers takes ~0.1 ms on a GPU and
up to a second for many layers on a slow CPU; a prefill of thousands of
tokens on a CPU takes tens of seconds. Prefill and decode share the bounds
(one family, told apart by a `phase` label)."""


class Histogram:
    """Counts of values per bucket (see the module docstring)."""

    __slots__ = ("_counts", "bounds", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        """`bounds`: the buckets' upper bounds, finite and strictly
        increasing; values above the last fall in the implicit `+Inf` one."""
        if not bounds:
            raise ValueError("a histogram needs at least one bucket bound")
        if not all(math.isfinite(b) for b in bounds):
            raise ValueError(f"bucket bounds must be finite: {list(bounds)}")
        if any(a >= b for a, b in pairwise(bounds)):
            raise ValueError(f"bucket bounds must increase strictly: {list(bounds)}")
        self.bounds: tuple[float, ...] = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf's
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one value (seconds, >= 0)."""
        self._counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        """Values observed."""
        return sum(self._counts)

    def cumulative(self) -> list[int]:
        """Values <= each bound, in order, then the count (`le="+Inf"`)."""
        counts = list(self._counts)  # one copy: a consistent snapshot
        total = 0
        for i, n in enumerate(counts):
            total += n
            counts[i] = total
        return counts

    def to_json(self) -> dict[str, Any]:
        """`{"buckets": [[le, values <= le], ...], "count": n, "sum": s}`:
        the finite bounds with their cumulative counts, then the count (the
        `+Inf` bucket, which JSON cannot write) and the sum."""
        cumulative = self.cumulative()
        return {
            "buckets": [[le, n] for le, n in zip(self.bounds, cumulative, strict=False)],
            "count": cumulative[-1],
            "sum": round(self.sum, 6),
        }
