"""How the ledger reach benchmark reports a run (`benchmarks.ledger_reach`):
a leader's traffic beside the baseline, and a notice's spread against its
target. The runs themselves are `simulations.ledger_reach`'s, tested in
tests/simulations/test_ledger_reach.py."""

from __future__ import annotations

import math

from benchmarks.ledger_reach import SPREAD_TARGET_S, _spread, _traffic
from simulations.ledger_reach import LeaderTraffic, NoticeSpread


def traffic(sent: int, received: int, leader_s: float) -> LeaderTraffic:
    return LeaderTraffic(
        window_s=20.0,
        sent=sent,
        received=received,
        proposed=80,
        committed=80,
        leader_s=leader_s,
        leaders=1,
        peers_messaged=8,
        queue_drops=0,
    )


def test_traffic_is_per_second_of_leading_and_its_ratio_to_the_baseline() -> None:
    baseline = traffic(2000, 2480, 20.0)  # 224 messages a second
    policy = traffic(4000, 4960, 20.0)
    detail = _traffic(policy, baseline)
    assert detail["msgs_per_s"] == 448.0
    assert detail["ratio"] == 2.0
    assert "ratio" not in _traffic(baseline, None)
    assert _traffic(traffic(10, 10, 0.0), baseline)["msgs_per_s"] == 0.0  # never led
    assert set(detail) >= {"sent_per_s", "received_per_s", "leaders", "queue_drops"}


def test_a_spread_is_judged_at_999_of_all_nodes() -> None:
    times = tuple(0.001 * i for i in range(1, 1001))
    spread = NoticeSpread(1000, 1800, times, target_s=0.5, verified=1000)
    figures = _spread(spread, SPREAD_TARGET_S[1000])
    assert figures["p999_s"] == 0.999 and figures["max_s"] == 1.0
    assert figures["within_target"] is True
    assert figures["reached_fraction"] == 1.0 and figures["verified_fraction"] == 1.0
    assert figures["assigned_node_s"] == 0.5
    short = NoticeSpread(1000, 1800, times[:998], target_s=None, verified=998)
    missed = _spread(short, SPREAD_TARGET_S[1000])
    assert math.isinf(missed["p999_s"]) and missed["within_target"] is False
    assert missed["assigned_node_s"] is None


def test_the_targets_are_the_gossip_models() -> None:
    assert SPREAD_TARGET_S == {1000: 2.0, 10000: 2.2}
