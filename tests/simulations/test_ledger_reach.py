"""Issue acceptance, in the simulator: the ledger reaches a 1,000-member swarm
without 1,000 learners.

Only eligible nodes enter Raft, at most 5 voters and 4 learners, so the
leader's Raft traffic stays within twice a 5-voter cluster's; every other
member learns of an assignment from the leader's notice in its gossiped
record, within a gossip spread. Real cores throughout
(`simulations.ledger_reach`); `benchmarks.ledger_reach` runs the same at
10,000 members too.
"""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from consensus.codec import MAX_ENTRY_DATA_BYTES, MAX_RAFT_MESSAGE_BYTES, decode_raft, encode_raft
from consensus.config import ConsensusConfig
from consensus.log import Entry, EntryKind
from consensus.raft import AppendEntries, decode_config, encode_config
from consensus.voters import MemberInfo, VoterPolicy, next_change
from mesh.fields import MAX_UINT
from mesh.identity import NODE_ID_BYTES, node_id_text
from mesh.member_table import MemberStateName
from mesh.records import MAX_NOTICE_CHANGES
from mesh.wire import MAX_CONTROL_MESSAGE_BYTES
from simulations.ledger_reach import (
    PolicySwarm,
    await_leader,
    leader_traffic,
    notice_spread,
    voters_only_cluster,
    workload,
)

MEMBERS = 1000
ELIGIBLE = 12
"""A dozen trusted nodes: more than the 5 voters and 4 learners Raft takes."""
GOSSIP_TARGET_S = 2.0
"""The spread target: an update reaches 99.9% of 1,000 nodes in <= 2.0 s
(serf's convergence model of memberlist, docs/benchmarks.md)."""
POLICY = ConsensusConfig.lan().voters


def _settled_swarm(seed: int, members: int = MEMBERS, eligible: int = ELIGIBLE) -> PolicySwarm:
    swarm = PolicySwarm(members, eligible, seed)
    swarm.found()
    swarm.settle()
    return swarm


def test_an_assignment_reaches_its_node_and_999_of_1000_by_the_leaders_notice() -> None:
    seed = 5
    swarm = _settled_swarm(seed)
    target = MEMBERS - 1  # a member outside Raft
    for command in workload(swarm.ids[ELIGIBLE:target], 40):  # earlier placements
        swarm.commit(command)
    previous = swarm.notice()
    proposal = swarm.assign(swarm.ids[target])
    assert swarm.raft.is_committed(proposal)
    notice = swarm.notice()
    assert notice.index > previous.index
    # The notice names the node whose assignment changed, newest last, so
    # that node pulls at once; the list is full, the record at its largest.
    assert notice.changed[-1] == (node_id_text(swarm.ids[target]), proposal.index)
    assert len(notice.changed) == MAX_NOTICE_CHANGES
    # Whichever trusted replica it pulls from, the ledger it gets matches the
    # digest the leader signed.
    voters, _ = swarm.configuration()
    for i, node_id in enumerate(swarm.ids[:ELIGIBLE]):
        ledger = swarm.ledgers[i]
        if node_id in voters and ledger.applied_index == notice.index:
            assert hashlib.sha256(ledger.snapshot()).hexdigest() == notice.digest

    spread = notice_spread(MEMBERS, seed, notice, previous=previous, target=target)
    assert spread.verified == MEMBERS  # every copy decodes to exactly this notice
    assert spread.target_s is not None and spread.target_s <= GOSSIP_TARGET_S
    assert spread.quantile(0.999) <= GOSSIP_TARGET_S


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_leaders_raft_traffic_is_within_twice_a_5_voter_clusters(seed: int) -> None:
    swarm = _settled_swarm(seed)
    voters, learners = swarm.configuration()
    assert (len(voters), len(learners)) == (POLICY.max_voters, POLICY.max_learners)
    assert voters | learners <= swarm.ledgers[0].eligible_voters()
    swarm.raft.run_for(2.0)  # the last learner catches up
    commands = workload(swarm.ids[ELIGIBLE:], 40)
    swarm_run = leader_traffic(swarm.raft, commands)

    alone = voters_only_cluster(seed, voters=POLICY.max_voters)
    await_leader(alone)
    alone_run = leader_traffic(alone, commands)

    for run in (swarm_run, alone_run):
        assert run.leaders == 1 and run.leader_s == run.window_s
        assert run.committed == run.proposed == len(commands)
    # The leader talks to its configuration and nobody else, however many
    # members the swarm has.
    assert swarm_run.peers_messaged == len(voters) + len(learners) - 1
    assert alone_run.peers_messaged == POLICY.max_voters - 1
    ratio = swarm_run.per_s / alone_run.per_s
    assert 1.5 < ratio <= 2.0, ratio


def test_many_seeds_of_a_real_swarm_never_configure_more_than_5_voters_and_4_learners() -> None:
    """Every CONFIG entry the leader ever wrote, over swarms of any number of
    eligible nodes, stays within the caps and names only eligible nodes."""
    rng = random.Random(14)
    for seed in range(20):
        eligible = rng.randint(1, 24)
        swarm = _settled_swarm(seed, members=200, eligible=eligible)
        leader = await_leader(swarm.raft)
        core = swarm.raft.node(leader)
        assert core is not None
        trusted = swarm.ledgers[leader].eligible_voters()
        configs = [
            decode_config(e.data)
            for e in core.entries(core.first_index, core.last_index)
            if e.kind == EntryKind.CONFIG
        ]
        assert configs, f"seed {seed}: no configuration written"
        for voters, learners in configs:
            assert len(voters) <= POLICY.max_voters and len(learners) <= POLICY.max_learners
            assert voters | learners <= trusted
        target = (
            POLICY.max_voters
            if eligible >= POLICY.max_voters
            else min(POLICY.small_swarm_voters, eligible)
        )
        assert len(configs[-1][0]) == target


POOL = [bytes([i]) * NODE_ID_BYTES for i in range(1, 41)]
FOUNDER = POOL[0]
STATES: list[MemberStateName] = ["alive", "alive", "alive", "alive", "suspect", "dead", "left"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 40.0),  # time until the next event
            st.sampled_from(POOL[1:]),  # whose state changes
            st.sampled_from(STATES),
            st.sampled_from([True, True, False]),  # an operator makes it eligible
            st.integers(0, 6),  # voter checks after it
        ),
        max_size=80,
    )
)
def test_the_policy_never_builds_more_than_5_voters_and_4_learners(
    history: list[tuple[float, bytes, MemberStateName, bool, int]],
) -> None:
    voters, learners = frozenset({FOUNDER}), frozenset[bytes]()
    eligible = {FOUNDER}
    members: dict[bytes, MemberInfo] = {}
    now = 0.0
    most = (1, 0)
    for delay, node, state, made_eligible, checks in history:
        now += delay
        if made_eligible:
            eligible.add(node)
        members[node] = MemberInfo(
            state, alive_since=now if state == "alive" else None, state_since=now
        )
        # The checks come once the member has had time to become stable, and
        # the leader has just heard from every live member (Raft heartbeats).
        check_at = now + POLICY.stabilization_s
        view = {
            n: MemberInfo(
                i.state, i.alive_since, check_at if i.state == "alive" else None,
                i.state_since,
            )
            for n, i in members.items()
        }  # fmt: skip
        for _ in range(checks):
            change = next_change(
                voters=voters,
                learners=learners,
                leader=FOUNDER,
                members=view,
                eligible=frozenset(eligible),
                now=check_at,
                policy=POLICY,
            )
            if change is None:
                break
            if change.kind == "add_learner":
                learners |= {change.node}
            elif change.kind == "promote":
                learners -= {change.node}
                voters |= {change.node}
            else:
                voters -= {change.node}
                learners -= {change.node}
            assert len(voters) <= POLICY.max_voters
            assert len(learners) <= POLICY.max_learners
            assert voters | learners <= eligible
            most = max(most[0], len(voters)), max(most[1], len(learners))
    event(f"most voters={most[0]} learners={most[1]}")  # --hypothesis-show-statistics


def test_the_largest_configuration_entry_is_far_below_the_frame_caps() -> None:
    """5 voters and 4 learners, full-size ids: the CONFIG entry, and the
    AppendEntries that carries it, against the Raft entry cap (the 64 KiB
    a ~1,900-learner configuration used to exceed) and the control plane's
    message cap."""
    policy = VoterPolicy()
    voters = frozenset(bytes([0xFF - i]) * NODE_ID_BYTES for i in range(policy.max_voters))
    learners = frozenset(bytes([i]) * NODE_ID_BYTES for i in range(policy.max_learners))
    data = encode_config(voters, learners)
    assert decode_config(data) == (voters, learners)
    assert len(data) * 100 < MAX_ENTRY_DATA_BYTES
    top = MAX_UINT - 1  # the widest integers the codec takes
    append = AppendEntries(
        to=min(voters), term=top, leader=max(voters), prev_index=top - 1, prev_term=top,
        entries=(Entry(term=top, index=top, kind=EntryKind.CONFIG, data=data),), commit=top,
    )  # fmt: skip
    frame = encode_raft(append)
    assert decode_raft(frame) == append
    assert len(frame) * 100 < MAX_RAFT_MESSAGE_BYTES
    assert len(frame) * 1000 < MAX_CONTROL_MESSAGE_BYTES
