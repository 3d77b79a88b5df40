"""Whom a node names as the swarm's leader, and what it says once that leader is lost.

A voter's own Raft timer forgets a leader it stops hearing from: it
campaigns. A node that cannot vote never does, so it would name a dead
leader for as long as it remembers it: a learner the leader Raft last
followed, a member outside the configuration the trusted voter whose
ledger notice has the highest term (`runtime.node.ledger_follower`), whose
record membership keeps for a day after its death. `judge` stops naming a
leader that membership holds dead or left, or that a learner has had no
Raft message from for `SILENT_ELECTIONS` election timeouts, and says why;
`lost_leader_fix` says what an operator can do. Pure: callers pass the
clock and the views. What a user sees: docs/operations.md#after-the-leader-is-lost.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Final, Literal

from mesh.identity import node_id_text
from mesh.member_table import GONE_STATES, MemberState

SILENT_ELECTIONS: Final = 3
"""A learner stops naming a leader it has had no Raft message from for this
many of the longest election timeouts (`silence_s`). The leader heartbeats
every member of its configuration each tick, and one timeout of silence is
what makes a voter campaign; three leave room for a slow snapshot or a
burst of loss, and still say so in seconds (under 2 s on the local profile,
12 s on wan) rather than only once membership declares the leader dead.
A member outside the configuration gets no Raft messages, and a quiet
leader republishes no notice, so there membership's verdict is the bound."""

SHORT: Final = 12
"""Characters of a node id in a sentence (as `shardmesh status` shows ids)."""

State = Literal["leading", "following", "leaderless"]


def silence_s(tick_s: float, election_ticks: int) -> float:
    """The silence after which a learner stops naming its leader: `SILENT_ELECTIONS`
    of the longest election timeouts (`2 * election_ticks` ticks)."""
    return SILENT_ELECTIONS * 2 * election_ticks * tick_s


@dataclass(frozen=True, slots=True)
class Leadership:
    """Whom this node names as leader (None: nobody), and, when nobody, why and what to do."""

    leader: bytes | None
    state: State
    lost: bytes | None = None
    """The leader this node no longer names (None: it named none)."""
    why: str | None = None
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The status document's "leadership" (its "leader" is `leader`)."""
        return {
            "state": self.state,
            "lost": None if self.lost is None else node_id_text(self.lost),
            "why": self.why,
            "fix": self.fix,
        }


def judge(
    *,
    named: bytes | None,
    this_node: bytes,
    votes: bool,
    member: tuple[str, float] | None,
    heard_at: float | None,
    silence: float | None,
    now: float | None,
) -> Leadership:
    """Whether to name `named`, the leader Raft follows (a voter or learner)
    or the follower heard of (outside the configuration).

    `votes`: this node is a voter, whose Raft timer is the judge. `member`:
    membership's (state, since) of `named` (None: not a member it knows).
    `heard_at`: its last Raft message to this node; `silence`: how long
    that may be (None outside the configuration: no Raft messages come).
    `now`: the driver's clock, None when read outside its event loop (a
    tool or test reading status): then no age is known and none is judged."""
    if named is None:
        return Leadership(None, "leaderless")
    if named == this_node:
        return Leadership(named, "leading")
    if votes:
        return Leadership(named, "following")
    who = f"the leader {node_id_text(named)[:SHORT]}"
    cannot = "this node cannot vote, so it names no leader until a voter leads"
    if member is not None and member[0] in GONE_STATES:
        state, since = member
        what = "was declared dead" if state == MemberState.DEAD else "left the swarm"
        ago = "" if now is None else f" {max(0.0, now - since):.0f} s ago"
        return Leadership(None, "leaderless", named, f"{who} {what}{ago}; {cannot}")
    if (
        now is not None
        and silence is not None
        and heard_at is not None
        and now - heard_at > silence
    ):
        return Leadership(
            None,
            "leaderless",
            named,
            f"{who} sent no Raft message for {now - heard_at:.0f} s (over {silence:g} s); {cannot}",
        )
    return Leadership(named, "following")


def lost_leader_fix(lost: bytes, alive_eligible: Collection[bytes]) -> str:
    """What an operator can do once `lost` is gone, given the nodes that may
    vote and that membership holds alive (this node among them if it may)."""
    others = sorted(node_id_text(n)[:SHORT] for n in alive_eligible if n != lost)
    if others:
        return (
            "the surviving voters elect a leader within seconds if a quorum of them is alive; "
            "if none is elected, the voters are gone for good: run "
            "`shardmesh voters refound --api URL` (with that node's operator token) on the "
            "surviving eligible node with the longest log (raft.last_index), one of "
            f"{', '.join(others)}; it refuses until it has had no leader for the "
            "dead-voter grace"
        )
    return (
        f"no node that may vote is alive: restart {node_id_text(lost)[:SHORT]} with its own "
        "--state-dir, as it was started (`shardmesh node --state-dir DIR ...`): it keeps its "
        "id and its log and leads again. If that state dir is lost, no node left may refound "
        "this swarm: found a new one (a node started without --join) and start the others "
        "again with fresh state dirs and --join to it"
    )
