"""Whom a node names as leader: a node that cannot vote drops a gone or silent one, and says why."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.node.leadership import (
    SILENT_ELECTIONS,
    Leadership,
    judge,
    lost_leader_fix,
    silence_s,
)

ME, LEADER, VOTER = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
SILENCE = 1.8


def judged(**overrides: Any) -> Leadership:
    args: dict[str, Any] = {
        "named": LEADER,
        "this_node": ME,
        "votes": False,
        "member": ("alive", 0.0),
        "heard_at": 99.0,
        "silence": SILENCE,
        "now": 100.0,
    }
    return judge(**(args | overrides))


def test_a_live_leader_is_named_and_nobody_is_nobody() -> None:
    assert judged() == Leadership(LEADER, "following")
    assert judged(member=("suspect", 50.0)).leader == LEADER  # suspicion is not death
    assert judged(named=ME) == Leadership(ME, "leading")
    assert judged(named=None) == Leadership(None, "leaderless")


@pytest.mark.parametrize(
    ("state", "said"), [("dead", "was declared dead"), ("left", "left the swarm")]
)
def test_a_leader_membership_holds_gone_is_no_longer_named(state: str, said: str) -> None:
    verdict = judged(member=(state, 58.0), heard_at=None, silence=None)  # outside the configuration
    assert verdict.leader is None and verdict.state == "leaderless" and verdict.lost == LEADER
    assert verdict.why is not None
    assert f"the leader {LEADER.hex()[:12]} {said} 42 s ago" in verdict.why
    assert verdict.to_json() == {
        "state": "leaderless",
        "lost": LEADER.hex(),
        "why": verdict.why,
        "fix": None,
    }


def test_a_learner_drops_a_leader_silent_past_the_bound_and_keeps_one_just_inside() -> None:
    assert judged(heard_at=100.0 - SILENCE).leader == LEADER
    verdict = judged(heard_at=100.0 - SILENCE - 0.5)
    assert verdict.leader is None and verdict.lost == LEADER
    assert verdict.why is not None and "sent no Raft message for 2 s" in verdict.why
    # Outside the configuration no Raft messages come: silence proves nothing.
    assert judged(heard_at=0.0, silence=None).leader == LEADER


def test_a_voter_keeps_what_its_raft_says() -> None:
    """Its own election timer forgets a dead leader; membership does not overrule Raft."""
    assert judged(votes=True, member=("dead", 0.0), heard_at=0.0).leader == LEADER


def test_the_silence_bound_is_some_longest_election_timeouts() -> None:
    assert silence_s(0.03, 10) == pytest.approx(SILENT_ELECTIONS * 0.6)
    assert silence_s(0.2, 10) == pytest.approx(12.0)  # wan


def test_the_fix_names_the_surviving_eligible_nodes_or_says_restart_the_lost_one() -> None:
    refound = lost_leader_fix(LEADER, [LEADER, VOTER, ME])
    assert "`shardmesh voters refound --api URL`" in refound
    assert VOTER.hex()[:12] in refound and ME.hex()[:12] in refound
    assert LEADER.hex()[:12] not in refound  # the lost leader is no candidate
    restart = lost_leader_fix(LEADER, [LEADER])
    assert "voters refound" not in restart  # no node that could run it is alive
    assert f"restart {LEADER.hex()[:12]} with its own --state-dir" in restart
    assert "without --join" in restart
