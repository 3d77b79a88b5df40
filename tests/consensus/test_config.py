"""Consensus profiles: each says what its docstring promises, and pairs with
membership's profile of the same name."""

from __future__ import annotations

import pytest

from consensus.config import ConsensusConfig
from consensus.raft import RaftConfig
from mesh.config import MembershipConfig

PROFILES = ("lan", "wan", "local")


def election_timeout_s(config: ConsensusConfig) -> tuple[float, float]:
    """The range an election timeout is drawn from, [ticks, 2 * ticks), in seconds."""
    ticks = config.raft.election_ticks
    return (ticks * config.tick_s, 2 * ticks * config.tick_s)


@pytest.mark.parametrize("name", PROFILES)
def test_a_profile_is_found_by_name_and_matches_membership(name: str) -> None:
    config = ConsensusConfig.profile(name)
    assert config == getattr(ConsensusConfig, name)()
    assert config.name == name == MembershipConfig.profile(name).name


def test_an_unknown_profile_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown profile 'lab'; use lan, wan or local"):
        ConsensusConfig.profile("lab")


@pytest.mark.parametrize(
    ("name", "timeouts"),
    [("lan", (0.5, 1.0)), ("wan", (2.0, 4.0)), ("local", (0.3, 0.6))],
)
def test_election_timeouts_are_the_documented_ones(name: str, timeouts: tuple) -> None:
    assert election_timeout_s(ConsensusConfig.profile(name)) == pytest.approx(timeouts)


@pytest.mark.parametrize("name", PROFILES)
def test_a_proposal_outlives_a_failover(name: str) -> None:
    """Several election timeouts: an election in the middle does not fail a
    proposal that would have committed."""
    config = ConsensusConfig.profile(name)
    assert config.proposal_timeout_s >= 3 * election_timeout_s(config)[1]


def test_the_lan_profile_heartbeats_every_50_ms_with_raft_defaults() -> None:
    config = ConsensusConfig.lan()
    assert config.tick_s == 0.05 and config.raft == RaftConfig(election_ticks=10)
    assert (config.voters.stabilization_s, config.voters.dead_grace_s) == (10.0, 30.0)
