"""Autopilot-style voter management: which ONE configuration change to make next.

Only a handful of members vote (every voter adds a round trip to every
commit's quorum; 3 of 5 survives two failures). The leader calls
`next_change` whenever no configuration change is in flight and proposes
what it returns as a CONFIG entry: Raft's single-server change is only safe
one at a time, so it never returns more than one. Only nodes the ledger
makes eligible are ever promoted. It is a pure function of membership's
view, the leader's contact times and `now`. The rules in priority order,
and what eligible, stable, failed and target mean, are in
docs/design/voters.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from mesh.member_table import MemberState, MemberStateName

__all__ = [
    "ChangeKind",
    "ConfigChange",
    "MemberInfo",
    "VoterPolicy",
    "describe_rules",
    "next_change",
]

ChangeKind = Literal["add_learner", "promote", "remove"]

# Reasons on a ConfigChange: fixed strings, so a driver can count them.
REASON_REPLACE_FAILED_VOTER: Final = "replace_failed_voter"
REASON_FAILED_VOTER: Final = "failed_voter"
REASON_STABLE_LEARNER: Final = "stable_learner"
REASON_NEW_MEMBER: Final = "new_member"
REASON_FAILED_LEARNER: Final = "failed_learner"
REASON_NOT_ELIGIBLE: Final = "not_eligible"


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What the leader knows about one member, from membership and from Raft."""

    state: MemberStateName
    """Membership's (SWIM's) verdict."""
    alive_since: float | None = None
    """When the member last became alive and has stayed alive since; reset by
    every suspect/dead episode, so a flapping member never looks stable."""
    last_contact: float | None = None
    """When the leader last heard from it through Raft (an append or snapshot
    response). None: never, e.g. not yet in the configuration."""
    state_since: float | None = None
    """When membership entered `state`. Used for the dead grace period; None
    means unknown, and then only `last_contact` can start the grace."""


@dataclass(frozen=True, slots=True)
class VoterPolicy:
    """Knobs and their defaults (Consul Autopilot's, where it has one)."""

    max_voters: int = 5
    """Consul's recommendation: 5 voters survive 2 failures; 7 would add a
    round trip's worth of quorum latency for a third failure that a swarm of
    volunteers rarely has at once, since dead voters are replaced anyway."""
    max_learners: int = 4
    """Learners at most: only eligible nodes waiting to be promoted are
    learners (every other member follows the ledger by the leader's notice,
    `runtime.node.ledger_follower`). The leader sends a learner what it
    sends a voter, so 4 learners beside 4 followers keep its Raft traffic
    within twice a 5-voter cluster's, and the configuration entry small,
    however many members the swarm has."""
    small_swarm_voters: int = 3
    """Voters while fewer than `max_voters` stable members exist: 3 survive
    one failure, and an odd count never wastes a voter (4 tolerate 1 too)."""
    stabilization_s: float = 10.0
    """Autopilot's ServerStabilizationTime: a member must be continuously
    alive this long before it votes, so a node that is still starting, or
    flapping, never joins a quorum."""
    last_contact_threshold_s: float = 0.2
    """Autopilot's LastContactThreshold (200 ms). With a 15 ms heartbeat and
    150-300 ms election timeouts, a member not heard from in 200 ms has
    missed ~13 heartbeats: promoting it would raise the quorum size without
    adding a member able to acknowledge."""
    dead_grace_s: float = 30.0
    """How long membership must say "dead" before the voter is removed. SWIM
    has already waited out its suspicion timeout; this further covers a
    crash and restart from the durable store (back in seconds), which keeps
    its vote instead of costing two configuration changes and a catch-up.
    A 5-voter cluster still tolerates another failure meanwhile."""

    def __post_init__(self) -> None:
        if not 1 <= self.small_swarm_voters <= self.max_voters:
            raise ValueError("need 1 <= small_swarm_voters <= max_voters")
        if self.max_learners < 0:
            raise ValueError("max_learners must be >= 0")
        if min(self.stabilization_s, self.last_contact_threshold_s, self.dead_grace_s) < 0:
            raise ValueError("durations must be >= 0")


@dataclass(frozen=True, slots=True)
class ConfigChange:
    """One single-server configuration change for the leader to propose."""

    kind: ChangeKind
    node: bytes
    reason: str


def _stable(info: MemberInfo | None, now: float, policy: VoterPolicy) -> bool:
    return (
        info is not None
        and info.state == MemberState.ALIVE
        and info.alive_since is not None
        and now - info.alive_since >= policy.stabilization_s
        and info.last_contact is not None
        and now - info.last_contact <= policy.last_contact_threshold_s
    )


def _failed(info: MemberInfo | None, now: float, policy: VoterPolicy) -> bool:
    if info is None:
        return False  # unknown is not failed (module doc)
    if info.state == MemberState.LEFT:
        return True
    if info.state != MemberState.DEAD:
        return False
    known = [t for t in (info.state_since, info.last_contact) if t is not None]
    return bool(known) and now - max(known) >= policy.dead_grace_s


def next_change(
    *,
    voters: frozenset[bytes],
    learners: frozenset[bytes],
    leader: bytes,
    members: Mapping[bytes, MemberInfo],
    eligible: frozenset[bytes],
    now: float,
    policy: VoterPolicy | None = None,
) -> ConfigChange | None:
    """The one change to propose next (rules in the module doc), or None.

    `eligible`: the nodes the ledger lets vote; no one else is promoted.

    Call only while no configuration change is uncommitted. A `leader` that
    is not a voter gets None: it is being removed and is about to step down.
    """
    policy = policy or VoterPolicy()
    if voters & learners:
        raise ValueError("voters and learners must be disjoint")
    if leader not in voters:
        return None

    def stable(node: bytes) -> bool:
        return _stable(members.get(node), now, policy)

    def failed(node: bytes) -> bool:
        return _failed(members.get(node), now, policy)

    failed_voters = sorted(v for v in voters if v != leader and failed(v))
    candidates = sorted(n for n in learners & eligible if stable(n))
    stable_count = 1 + sum(1 for v in voters if v != leader and stable(v)) + len(candidates)
    target = policy.max_voters if stable_count >= policy.max_voters else policy.small_swarm_voters
    live_voters = len(voters) - len(failed_voters)

    if failed_voters:
        if candidates and live_voters < target and len(voters) < policy.max_voters:
            return ConfigChange("promote", candidates[0], REASON_REPLACE_FAILED_VOTER)
        if len(voters) > 1:
            return ConfigChange("remove", failed_voters[0], REASON_FAILED_VOTER)
    if len(voters) < target and candidates:
        return ConfigChange("promote", candidates[0], REASON_STABLE_LEARNER)
    ineligible = sorted(learners - eligible)
    if ineligible:
        return ConfigChange("remove", ineligible[0], REASON_NOT_ELIGIBLE)
    failed_learners = sorted(n for n in learners if failed(n))
    if failed_learners:
        return ConfigChange("remove", failed_learners[0], REASON_FAILED_LEARNER)
    newcomers = sorted(
        n
        for n, info in members.items()
        if info.state == MemberState.ALIVE and n in eligible and n not in voters | learners
    )
    if newcomers and len(learners) < policy.max_learners:
        return ConfigChange("add_learner", newcomers[0], REASON_NEW_MEMBER)
    return None


def describe_rules(policy: VoterPolicy | None = None) -> str:
    """The rules with this policy's numbers, for the README and `doctor` output."""
    p = policy or VoterPolicy()
    return "\n".join(
        [
            "Voter management (Autopilot-style; one change at a time, lowest node id first):",
            "  only eligible nodes are promoted: the founder and those an operator made eligible",
            "  1. replace a failed voter: promote a stable learner first while live voters"
            f" < target and voters < {p.max_voters}",
            "  2. remove a failed voter (never the leader, never the last voter)",
            "  3. promote a stable learner while voters < target",
            "  4. remove learners that are not eligible",
            "  5. remove failed learners",
            f"  6. add alive eligible members as learners, at most {p.max_learners} at a time",
            f"  stable: alive for >= {p.stabilization_s:g} s and heard from by the leader"
            f" within {p.last_contact_threshold_s * 1000:g} ms; never a suspect",
            f"  failed: left, or dead for >= {p.dead_grace_s:g} s",
            f"  target: {p.max_voters} voters once {p.max_voters} members are stable,"
            f" else {p.small_swarm_voters}; live voters are never removed to reach it",
        ]
    )
