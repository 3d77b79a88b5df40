"""How close a built lab comes to its configuration: `shardmesh lab check`.

`run_check` measures a lab the way a test would: UDP round trips between
every pair of sites that can reach each other (the median against the
configured RTT, none much below it, the fraction lost against the four
links' loss), the rate of the first capped uplink against its cap, and the
delayer's own lateness.
Each figure sits beside its configured value and a tolerance; `ok` says
whether all of them held. `DEFAULT_SPEC` is the lab it builds when given
none: two public sites and one home behind a port-preserving NAT, 40 ms
apart, 1% loss on every link, the home's uplink capped at 1 MB/s.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Final

from runtime.lab.netns import Lab, RttSample
from runtime.lab.topology import Topology

DEFAULT_SPEC: Final[dict[str, Any]] = {
    "seed": 1,
    "link": {"delay_ms": 10, "jitter_ms": 0, "loss": 0.01},
    "sites": [
        {"name": "a"},
        {"name": "b"},
        {"name": "c", "nat": "port-preserving", "up": {"rate": 1_000_000}},
    ],
}
RTT_TOLERANCE_MS: Final = 3.0
"""Median RTT within this of the configuration. Measured on 2 cores
(docs/lab.md): +0.3 to +0.6 ms idle or beside CPU hogs, up to +1.3 ms
beside a swarm test's loopback traffic, whose softirq load delays every
veth, delayer or not; more than 3 ms says the lab is broken, not busy."""
EARLY_TOLERANCE_MS: Final = 0.2
"""No round trip beats the configuration by more than this (the delayer
releases 50 µs early, twice per round trip): a smaller one is a bug."""
RATE_TOLERANCE: Final = 0.15
"""Measured rate within 15% of a TBF cap less the path's loss (TBF counts
Ethernet frames, 14 bytes more than the IPv4 packets the sink counts)."""
LOSS_SIGMAS: Final = 4.0
"""Measured loss within this many binomial standard deviations (plus one
probe) of the configured fraction: about 1 run in 15,000 fails by chance."""
RATE_OFFER: Final = 2.0
"""The rate check offers twice the cap, so the cap is what limits it."""


def run_check(lab: Lab, count: int = 100, interval_s: float = 0.01) -> dict[str, Any]:
    """Every pair's RTT and loss, one capped link's rate, the delayer's
    lateness; `ok` when each is within its tolerance."""
    topology = lab.topology
    pairs = [_pair(lab, a, b, count, interval_s) for a, b in _reachable_pairs(topology)]
    rate = _rate(lab, topology)
    errors = [abs(pair["rtt_error_ms"]) for pair in pairs]
    checks = [pair["ok"] for pair in pairs] + ([rate["ok"]] if rate else [])
    return {
        "prefix": lab.plan.prefix,
        "delayer_priority": lab.priority,
        "pairs": pairs,
        "rtt_error_ms": max(errors) if errors else None,
        "rate": rate,
        "delayer": lab.delayer_stats(),
        "ok": all(checks),
    }


def _reachable_pairs(topology: Topology) -> list[tuple[str, str]]:
    return [
        (a.name, b.name)
        for a, b in itertools.combinations(topology.sites, 2)
        if not (a.behind_nat and b.behind_nat)
    ]


def _pair(lab: Lab, a: str, b: str, count: int, interval_s: float) -> dict[str, Any]:
    topology = lab.topology
    sample: RttSample = lab.rtt(a, b, count, interval_s)
    configured_rtt = topology.rtt_ms(a, b)
    survives = (1 - topology.path_loss(a, b)) * (1 - topology.path_loss(b, a))
    configured_loss = 1 - survives
    error = sample.median - configured_rtt if sample.rtt_ms else math.inf
    early = configured_rtt - min(sample.rtt_ms, default=configured_rtt)
    loss_bound = LOSS_SIGMAS * math.sqrt(configured_loss * survives / count) + 1 / count
    return {
        "sites": [a, b],
        "configured_rtt_ms": configured_rtt,
        "measured": sample.summary(),
        "rtt_error_ms": round(error, 3),
        "configured_loss": round(configured_loss, 4),
        "ok": abs(error) <= RTT_TOLERANCE_MS
        and early <= EARLY_TOLERANCE_MS
        and abs(sample.loss - configured_loss) <= loss_bound,
    }


def _rate(lab: Lab, topology: Topology) -> dict[str, Any] | None:
    """The first capped uplink's rate, sent to a public site other than it."""
    for site in topology.sites:
        cap = site.up.rate
        dst = next((s.name for s in topology.sites if s != site and not s.behind_nat), None)
        if cap is None or dst is None or topology.site(dst).down.rate is not None:
            continue
        measured = lab.throughput(site.name, dst, int(cap * RATE_OFFER))
        rate = measured.get("rate")
        expected = cap * (1 - topology.path_loss(site.name, dst))  # lost after the cap
        error = rate / expected - 1 if rate else -1.0
        return {
            "site": site.name,
            "to": dst,
            "configured": cap,
            "expected": round(expected),
            "measured": round(rate) if rate else None,
            "error": round(error, 4),
            "ok": abs(error) <= RATE_TOLERANCE,
        }
    return None
