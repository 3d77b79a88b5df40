"""`runtime.lab.shaper`: each packet's release is its two links' delay,
jitter stays in bounds and never reorders a path, loss comes at its
configured rate, and the same seed gives every packet the same fate."""

from __future__ import annotations

import random

import pytest

from runtime.lab.shaper import Shaper
from runtime.lab.topology import load_topology

TOPOLOGY = load_topology(
    {
        "sites": [
            {"name": "a", "up": {"delay_ms": 10}, "down": {"delay_ms": 5}},
            {"name": "b", "up": {"delay_ms": 20}, "down": {"delay_ms": 1}},
            {"name": "j", "delay_ms": 10, "jitter_ms": 4},
            {"name": "l", "loss": 0.2},
        ]
    }
)


def test_release_is_the_uplink_then_the_downlink() -> None:
    shaper = Shaper(TOPOLOGY, random.Random(1))
    assert shaper.admit("a", "b", now=100.0) == pytest.approx(100.0 + 0.010 + 0.001)
    assert shaper.admit("b", "a", now=100.0) == pytest.approx(100.0 + 0.020 + 0.005)


def test_jitter_stays_within_its_bounds_and_never_reorders_a_path() -> None:
    shaper = Shaper(TOPOLOGY, random.Random(2))
    releases = [shaper.admit("j", "a", now=i * 0.001) for i in range(2000)]
    assert all(r is not None for r in releases)
    times = [r for r in releases if r is not None]
    assert times == sorted(times)  # FIFO: a later packet never leaves first
    delays = [t - i * 0.001 for i, t in enumerate(times)]
    # uplink 10 ± 4 ms, downlink 5 ms; the FIFO may only add to a draw
    assert min(delays) >= 0.011 - 1e-9 and max(delays) <= 0.019 + 1e-9
    sparse = Shaper(TOPOLOGY, random.Random(2))
    spread = [sparse.admit("j", "a", now=i * 1.0) for i in range(2000)]
    sparse_delays = [r - i * 1.0 for i, r in enumerate(spread) if r is not None]
    assert sum(sparse_delays) / len(sparse_delays) == pytest.approx(0.015, abs=0.0005)
    assert sum(delays) / len(delays) > 0.015  # packets 1 ms apart queue behind the jitter


def test_paths_are_independent_fifos() -> None:
    shaper = Shaper(TOPOLOGY, random.Random(3))
    slow = shaper.admit("b", "a", now=0.0)  # 25 ms
    fast = shaper.admit("a", "b", now=0.0)  # 11 ms, another path: not held behind it
    assert slow is not None and fast is not None and fast < slow


def test_loss_comes_at_the_configured_rate_and_is_counted() -> None:
    shaper = Shaper(TOPOLOGY, random.Random(4))
    fates = [shaper.admit("l", "a", now=float(i)) for i in range(5000)]
    lost = sum(f is None for f in fates)
    assert lost / 5000 == pytest.approx(0.2, abs=0.02)  # 3.5 sigma
    counters = shaper.paths[("l", "a")]
    assert (counters.sent, counters.lost) == (5000, lost)
    both = [shaper.admit("l", "l", now=float(i)) for i in range(5000)]  # up and down both lossy
    assert sum(f is None for f in both) / 5000 == pytest.approx(1 - 0.8 * 0.8, abs=0.025)


def test_the_same_seed_gives_the_same_fates() -> None:
    def fates(seed: int) -> list[float | None]:
        shaper = Shaper(TOPOLOGY, random.Random(seed))
        return [shaper.admit(src, "j", now=i * 0.003) for i in range(300) for src in ("l", "j")]

    assert fates(5) == fates(5)
    assert fates(5) != fates(6)
