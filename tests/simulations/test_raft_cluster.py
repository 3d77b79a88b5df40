"""The real Raft core on the simulated network (`simulations.raft_cluster`).

The core's own tests step messages by hand; these run it the way a driver
does, with wall-like tick intervals and link latency, so they catch what only
timing shows: an election that never settles, a failover slower than the
design's target, a driver that sends before it persists, nondeterminism.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.failover import failover_run
from simulations.network import NetworkConfig
from simulations.raft_cluster import RaftCluster, SafetyViolation


def _settled(cluster: RaftCluster) -> bool:
    """A leader exists and has committed in its own term (it can take writes)."""
    i = cluster.leader()
    return i is not None and cluster.term(i) in cluster.first_commit_in_term


def _elect(cluster: RaftCluster, timeout: float = 3.0) -> int:
    assert not cluster.run_while(lambda: not _settled(cluster), timeout), "no leader"
    leader = cluster.leader()
    assert leader is not None
    return leader


def test_five_voters_elect_exactly_one_leader() -> None:
    cluster = RaftCluster(5, seed=7)
    leader = _elect(cluster)
    cluster.run_for(2.0)  # heartbeats keep it in place: no spurious elections
    assert cluster.leader() == leader
    assert sum(1 for i in range(5) if cluster.node(i).is_leader) == 1  # type: ignore[union-attr]
    assert len(cluster.leader_of_term) == 1
    cluster.check_safety()


@pytest.mark.parametrize("seed", range(10))
def test_leader_crash_new_leader_commits_within_one_second(seed: int) -> None:
    cluster = RaftCluster(5, seed)
    old = _elect(cluster)
    first = cluster.propose(b"before")
    assert first is not None
    cluster.run_for(0.1)
    assert cluster.is_committed(first)
    cluster.crash(old)
    crashed_at = cluster.now
    assert not cluster.run_while(lambda: not _settled(cluster), 1.0)
    new = cluster.leader()
    assert new is not None and new != old
    assert cluster.now - crashed_at <= 1.0
    # The entry committed before the crash survives in the new leader's log.
    assert cluster.node(new).entries(first.index, first.index)[0].data == b"before"  # type: ignore[union-attr]
    after = cluster.propose(b"after")
    assert after is not None and after.node == new
    cluster.run_for(0.1)
    assert cluster.is_committed(after)
    cluster.restart(old)
    cluster.run_for(0.5)
    assert cluster.commit_index(old) == cluster.commit_index(new)
    cluster.check_safety()


def _scripted_run(seed: int) -> tuple[str, list[tuple[int, int, bytes]]]:
    cluster = RaftCluster(5, seed, network=NetworkConfig.lan(loss=0.05, duplicate=0.05))
    _elect(cluster)
    for n in range(20):
        cluster.propose(b"cmd-%d" % n)
        cluster.run_for(0.02)
    leader = cluster.leader()
    assert leader is not None
    cluster.crash(leader)
    cluster.run_for(1.0)
    cluster.restart(leader)
    cluster.run_for(1.0)
    cluster.check_safety()
    commits = [
        (c.index, c.term, cluster.applied(c.node)[c.index - 1].data)
        for c in cluster.committed.values()
    ]
    return cluster.trace_digest(), commits


def test_same_seed_same_trace_and_commits() -> None:
    first = _scripted_run(3)
    assert first == _scripted_run(3)
    assert first[0] != _scripted_run(4)[0]
    assert len(first[1]) > 20


@pytest.mark.parametrize("seed", range(20))
def test_safety_under_loss_partitions_and_crashes(seed: int) -> None:
    """Lossy links, a minority/majority split with the leader on either side,
    crashes and restarts, proposals throughout; safety is checked as it runs."""
    cluster = RaftCluster(5, seed, network=NetworkConfig.lan(loss=0.2, duplicate=0.1))
    rng = random.Random(seed)
    proposed = 0
    for step in range(40):
        action = rng.random()
        if action < 0.15:
            members = rng.sample(range(5), 2)
            cluster.partition([members], duration=rng.uniform(0.1, 1.0))
        elif action < 0.25:
            cluster.crash(rng.randrange(5))
        elif action < 0.4:
            for i in range(5):
                cluster.restart(i)
        for _ in range(3):
            if cluster.propose(b"s%d-%d" % (seed, proposed)) is not None:
                proposed += 1
        cluster.run_for(rng.uniform(0.02, 0.3))
        if step % 5 == 0:
            cluster.check_safety()
    cluster.heal()
    for i in range(5):
        cluster.restart(i)
    _elect(cluster, timeout=5.0)
    cluster.run_for(1.0)
    cluster.check_safety()
    assert proposed > 0 and cluster.committed
    assert len({cluster.commit_index(i) for i in range(5)}) == 1


def test_safety_check_catches_a_forged_second_leader() -> None:
    """The checker itself must be able to fail, or a green run proves nothing."""
    cluster = RaftCluster(3, seed=1)
    _elect(cluster)
    cluster.violations.append("two leaders in term 1: 0 and 1")
    with pytest.raises(SafetyViolation, match="seed 1"):
        cluster.check_safety()


def test_fsync_delay_still_elects_and_commits() -> None:
    cluster = RaftCluster(5, seed=2, fsync_s=0.002)
    _elect(cluster)
    proposal = cluster.propose(b"slow-disk")
    assert proposal is not None
    cluster.run_for(0.1)
    assert cluster.is_committed(proposal)
    cluster.check_safety()


def test_failover_benchmark_run_meets_target() -> None:
    result = failover_run(0)
    assert 0 < result["failover_ms"] <= 600
