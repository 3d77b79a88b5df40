"""Consensus tuning profiles: `lan`, `wan` and `local`, like membership's.

A Raft tick is the leader's heartbeat interval; the election timeout is
drawn from [election_ticks, 2 * election_ticks) ticks. Each profile pairs
with `mesh.config.MembershipConfig`'s profile of the same name. Real
processes use timeouts longer than the thesis' 150-300 ms, because a Python
node's stalls (GC, imports, the model runtime) would cost needless
elections; why, and what that costs in failover, is in docs/design/raft.md
("Timing profiles").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from consensus.raft import RaftConfig
from consensus.voters import VoterPolicy

__all__ = ["ConsensusConfig"]


@dataclass(frozen=True)
class ConsensusConfig:
    """One profile: tick length, Raft's tick counts and the voter policy."""

    name: str
    tick_s: float
    """Seconds per Raft tick (= the leader's heartbeat interval)."""
    raft: RaftConfig
    voters: VoterPolicy
    voter_check_ticks: int = 10
    """The leader reconsiders the voter set every this many ticks. Changes
    wait for stabilization times of seconds anyway; checking every tick
    would only burn CPU building the member view."""
    compact_every: int = 1000
    """Snapshot the ledger and drop the log once this many entries are
    applied past the last snapshot: bounds the store and a restart's replay
    while keeping snapshots (a full ledger copy) rare."""
    proposal_timeout_s: float = field(default=5.0)
    """How long `propose` waits for its entry to commit before saying it
    does not know: several election timeouts, so a failover in the middle
    does not fail a proposal that would have committed."""

    @classmethod
    def lan(cls) -> ConsensusConfig:
        """50 ms heartbeats, 0.5-1 s election timeouts; voters need 10 s of
        stable membership and are replaced 30 s after being declared dead."""
        return cls(
            name="lan",
            tick_s=0.05,
            raft=RaftConfig(election_ticks=10),
            voters=VoterPolicy(
                stabilization_s=10.0, last_contact_threshold_s=0.25, dead_grace_s=30.0
            ),
        )

    @classmethod
    def wan(cls) -> ConsensusConfig:
        """200 ms heartbeats, 2-4 s election timeouts: internet round trips
        of 100-300 ms and their loss must not look like a dead leader."""
        return cls(
            name="wan",
            tick_s=0.2,
            raft=RaftConfig(election_ticks=10),
            voters=VoterPolicy(
                stabilization_s=30.0, last_contact_threshold_s=1.0, dead_grace_s=60.0
            ),
            proposal_timeout_s=15.0,
        )

    @classmethod
    def local(cls) -> ConsensusConfig:
        """One machine (tests, the demo): 30 ms heartbeats, 300-600 ms
        timeouts, voters promoted after 2 s and replaced 5 s after death so
        a test sees the whole life cycle in seconds."""
        return cls(
            name="local",
            tick_s=0.03,
            raft=RaftConfig(election_ticks=10),
            voters=VoterPolicy(stabilization_s=2.0, last_contact_threshold_s=0.3, dead_grace_s=5.0),
        )

    @classmethod
    def profile(cls, name: str) -> ConsensusConfig:
        """The profile called `name`; ValueError for an unknown one."""
        factories = {"lan": cls.lan, "wan": cls.wan, "local": cls.local}
        try:
            return factories[name]()
        except KeyError:
            raise ValueError(f"unknown profile {name!r}; use lan, wan or local") from None
