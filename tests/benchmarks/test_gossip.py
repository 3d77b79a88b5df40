"""The gossip benchmark's runs (`benchmarks.gossip`) on a small swarm: a
record reaches every node, a crash is detected by every survivor, and a
lossy network declares nobody healthy dead. The figures at 1,000 and 10,000
nodes are the benchmark's own (minutes)."""

from __future__ import annotations

import pytest

from benchmarks.gossip import detection_run, false_positive_run, spread_run
from mesh.config import MembershipConfig

NODES = 50


def test_a_record_reaches_every_node_within_a_few_rounds() -> None:
    run = spread_run(NODES, 0.0, seed=1)
    assert run["reached_fraction"] == 1.0
    assert 0 < run["spread_p999_s"] < 2.0
    lan_round_s = MembershipConfig.lan().gossip_interval
    assert run["rounds_p999"] == pytest.approx(run["spread_p999_s"] / lan_round_s, abs=0.01)
    assert run["memberlist_model_p999_s"] is None  # the model is given at 1,000 and 10,000
    assert 0 < run["bytes_per_node_per_s"] <= run["max_bytes_per_node_per_s"]


def test_every_survivor_detects_a_crash_after_its_suspicion_timeout() -> None:
    run = detection_run(NODES, seed=1)
    assert run["detected_fraction"] == 1.0
    minimum = MembershipConfig.lan().suspicion_min_timeout(NODES)
    assert run["suspicion_min_timeout_s"] == minimum
    assert minimum < run["detect_median_s"] <= run["detect_max_s"]


def test_loss_alone_declares_nobody_dead() -> None:
    run = false_positive_run(NODES, 0.1, 60.0, seed=1)
    assert run["false_dead_verdicts"] == 0
    assert run["false_positives_per_node_hour"] == 0.0
