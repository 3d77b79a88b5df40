"""Membership tuning profiles (`mesh.config`): each profile is consistent,
its derived timings follow their formulas, and nonsense is refused."""

from __future__ import annotations

import math

import pytest

from mesh.config import MembershipConfig


@pytest.mark.parametrize("profile", ["lan", "wan", "local"])
def test_profiles_document_consistent_timings(profile: str) -> None:
    config = MembershipConfig.profile(profile)
    assert config.probe_timeout < config.probe_interval
    assert config.suspicion_min_timeout(1000) < config.suspicion_max_timeout(1000)
    assert config.detection_bound(5) > config.suspicion_max_timeout(5)
    assert config.retransmit_limit(1000) == config.retransmit_mult * 4  # ceil(log10 1001)
    assert config.retransmit_limit(999) == config.retransmit_mult * 3
    with pytest.raises(ValueError, match="unknown profile"):
        MembershipConfig.profile("moon")


@pytest.mark.parametrize("profile", ["lan", "wan", "local"])
def test_every_profile_bounds_newcomers_and_local_stays_permissive(profile: str) -> None:
    config = MembershipConfig.profile(profile)
    assert 1 <= config.newcomers_per_address <= config.newcomers_per_prefix
    if profile == "local":  # every node of a loopback swarm is 127.0.0.1
        assert config.newcomers_per_address >= 40  # more real nodes than any test starts
    with pytest.raises(ValueError, match="newcomers"):
        config.with_overrides(newcomers_per_address=0)


@pytest.mark.parametrize("profile", ["lan", "wan", "local"])
def test_every_profile_bounds_introductions_and_one_key_cannot_vouch_alone(profile: str) -> None:
    config = MembershipConfig.profile(profile)
    assert 1 <= config.introductions_per_member <= config.introductions_total
    assert config.vouches_to_verify >= 2  # one admitted key is one voice
    # Forty nodes started at once on one host get in (test_membership_trust.py).
    assert profile == "wan" or config.introductions_per_member >= 40


def test_lan_suspects_for_9_s_at_1000_nodes_and_at_most_six_times_that() -> None:
    lan = MembershipConfig.lan()
    assert lan.suspicion_min_timeout(1000) == pytest.approx(9.0)
    assert lan.suspicion_max_timeout(1000) == pytest.approx(54.0)
    assert lan.suspicion_min_timeout(1) == lan.suspicion_min_timeout(10) == 3.0  # log10 floor 1


def test_confirmations_needed_grow_with_the_swarm_up_to_the_multiplier() -> None:
    lan = MembershipConfig.lan()  # suspicion_mult 3
    assert [lan.suspicion_confirmations(n) for n in (1, 2, 3, 100)] == [0, 0, 1, 1]
    wan = MembershipConfig.wan()  # suspicion_mult 4
    assert wan.suspicion_confirmations(1000) == 2


def test_syncs_slow_down_above_32_nodes_so_their_total_stays_flat() -> None:
    lan = MembershipConfig.lan()
    assert lan.push_pull_period(32) == 30.0
    assert lan.push_pull_period(33) == 30.0 * 2
    assert lan.push_pull_period(1000) == 30.0 * (math.ceil(math.log2(1000) - 5) + 1)


def test_the_detection_bound_adds_its_parts() -> None:
    local = MembershipConfig.local()
    n = 5
    expected = (
        2 * (n - 1) * local.probe_interval
        + local.probe_interval
        + local.suspicion_max_timeout(n)
        + 10 * local.gossip_interval
        + local.probe_interval
    )
    assert local.detection_bound(n) == pytest.approx(expected)
    assert local.detection_bound(1) == local.detection_bound(2)  # at least one peer


@pytest.mark.parametrize(
    "changes",
    [
        {"probe_timeout": 1.0},  # not shorter than the interval
        {"probe_interval": 0.0, "probe_timeout": -1.0},
        {"gossip_interval": 0.0},
        {"push_pull_interval": -1.0},
        {"reconnect_interval": 0.0},
        {"gossip_fanout": 0},
        {"retransmit_mult": 0},
        {"suspicion_mult": 0},
        {"newcomers_per_prefix": 0},
        {"introductions_per_member": 0},
        {"introductions_total": 0},
        {"vouches_to_verify": 0},
    ],
)
def test_nonsense_is_refused(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        MembershipConfig.lan().with_overrides(**changes)


def test_overrides_keep_everything_else_and_the_protocol_switches_default_on() -> None:
    lan = MembershipConfig.lan()
    tuned = lan.with_overrides(probe_interval=2.0, eager_gossip=True)
    assert tuned.probe_interval == 2.0 and tuned.eager_gossip
    assert tuned.with_overrides(probe_interval=1.0, eager_gossip=False) == lan
    assert (lan.local_health, lan.dynamic_suspicion, lan.nacks, lan.buddy) == (True,) * 4
    assert lan.refute_to_accuser and not lan.eager_gossip
    assert MembershipConfig.profile("wan") == MembershipConfig.wan()
