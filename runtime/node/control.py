"""The control side of a node: membership, Raft, the ledger follower and
the reachability check.

Raft payloads ride the membership driver's plane (signed by their sender),
and each driver needs the other: membership hands consensus payloads to
Raft, Raft sends through membership and asks it who is alive, and the
ledger follower (for members outside the Raft configuration) reads records
through the swarm view; the reachability driver asks members, through
membership, to dial this node back. `wire_control` builds them and ties those
knots, so the composition root wires one control side, not its internals.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import trio

from consensus.config import ConsensusConfig
from consensus.storage import RaftStorage
from mesh.config import MembershipConfig
from mesh.identity import Identity
from mesh.transport import Plane
from runtime.node.ledger_follower import LedgerFollower
from runtime.node.membership_driver import MembershipDriver
from runtime.node.raft_driver import RaftDriver
from runtime.node.reachability_driver import ReachabilityDriver
from runtime.node.state_dir import StateDir
from runtime.node.swarm_view import SwarmView


@dataclass(frozen=True)
class Control:
    """One node's control-side drivers, wired to each other."""

    membership: MembershipDriver
    raft: RaftDriver
    swarm: SwarmView
    follower: LedgerFollower
    reachability: ReachabilityDriver

    def start(self, nursery: trio.Nursery) -> None:
        """Run every driver's loop in `nursery`."""
        for run in (self.membership.run, self.raft.run, self.follower.run, self.reachability.run):
            nursery.start_soon(run)


def wire_control(
    *,
    identity: Identity,
    state: StateDir,
    profile: str,
    plane: Plane,
    address: str,
    incarnation: int,
    storage: RaftStorage,
    seeds: list[tuple[bytes, str]],
    encrypted: bool,
    on_reach_change: Callable[[], None],
) -> Control:
    """The control side on `plane` (advertised as `address`), its Raft log
    in `storage`; `seeds` are the (node id, control address) it joins
    through (none: this node founds the swarm, so Raft bootstraps);
    `on_reach_change` hears of a new reachability verdict."""
    built: list[RaftDriver] = []  # Raft, once built: membership delivers nothing before it runs
    membership = MembershipDriver(
        identity=identity,
        state=state,
        config=MembershipConfig.profile(profile),
        plane=plane,
        address=address,
        incarnation=incarnation,
        on_consensus=lambda sender, payload: built[0].deliver(sender, payload),
    )
    raft = RaftDriver(
        node_id=identity.node_id,
        storage=storage,
        config=ConsensusConfig.profile(profile),
        bootstrap=not seeds,
        send=membership.send_consensus,
        members=membership.peer_states,
        rng=random.Random(int.from_bytes(os.urandom(16), "big")),
    )
    built.append(raft)
    swarm = SwarmView(membership, lambda: raft.ledger)
    follower = LedgerFollower(
        node_id=identity.node_id,
        seeds=[node for node, _ in seeds],
        in_configuration=raft.in_configuration,
        record=swarm.record,
        api_of=swarm.member_api,
        install=raft.follow,
        held=lambda: raft.ledger.applied_index,
    )
    raft.followed_leader = follower.leader
    raft.member_of = membership.member_state
    raft.heard_up_to_date = follower.caught_up
    reachability = ReachabilityDriver(
        membership=membership,
        keys=identity.plane_keys(),
        encrypted=encrypted,
        seeds=seeds,
        record_of=swarm.signed_record,
        on_change=on_reach_change,
    )
    return Control(membership, raft, swarm, follower, reachability)
