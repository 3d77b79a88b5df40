"""Issue acceptance at full size: 1,000 simulated nodes running the real core.

These are the expensive runs (minutes of wall time in all), so they live in
the slow tier; `make test` still runs them. Seeds run in parallel processes,
one per core this test may take: each run is deterministic, so where it runs changes nothing.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from mesh.config import MembershipConfig
from mesh.membership import MemberState
from simulations.cluster import MembershipCluster
from simulations.network import NetworkConfig

# The suite's 300 s guard is for hangs; these runs are known long: on 2
# cores the twenty seeds take about 200-250 s on a quiet machine and 370 s
# beside one busy process (a fresh-clone CI run), so they get three times
# the guard until the simulator's speed work (issue 17, item 7) lands.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NODES = 1000
FALSE_POSITIVE_SEEDS = range(2000, 2020)
FALSE_POSITIVE_SECONDS = 40.0
"""Long enough for every suspicion raised in the first half of the run to be
decided with confirmations (9 s at 1,000 nodes) and for several thousand
suspicions in all; the 50-node test in tests/simulations/test_cluster.py covers the
lone, unconfirmed suspicions that run to the maximum timeout."""


def _cores_for_this_worker() -> int:
    """The cores this test may take: all of them, or its share when `make
    test` runs the suite on several xdist workers (the others are busy)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)


def _lossy_run(seed: int) -> tuple[int, int, list[tuple[float, int, int]]]:
    cluster = MembershipCluster(NODES, seed, network=NetworkConfig.lan(loss=0.1))
    cluster.run_until(FALSE_POSITIVE_SECONDS)
    return seed, cluster.event_counts["suspect"], cluster.false_positives()


def test_twenty_seeds_at_10_percent_loss_declare_nobody_dead() -> None:
    workers = max(1, min(len(FALSE_POSITIVE_SEEDS), _cores_for_this_worker()))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_lossy_run, FALSE_POSITIVE_SEEDS))
    assert len(results) == 20
    for seed, suspicions, false_positives in results:
        assert suspicions > 0, f"seed {seed}: 10% loss should cause suspicions"
        assert false_positives == [], f"seed {seed}: (time, observer, subject) wrongly dead"


def _holds_dead(cluster: MembershipCluster, observer: int, subject: int) -> bool:
    view = cluster.membership(observer).member(cluster.node_id(subject))
    return view is not None and view.state is MemberState.DEAD


def test_a_50_50_partition_is_declared_dead_across_and_heals_to_full_membership() -> None:
    half = NODES // 2
    lan = MembershipConfig.lan()
    start = 5.0
    cluster = MembershipCluster(NODES, 31)
    # Heals only once every node holds every node across as dead (checked
    # below), or at the bound: the slowest verdict is an observer whose copy
    # of the others' `dead` gossip never arrived and that decides alone, at
    # the maximum suspicion timeout plus a last look slowed by local health.
    bound = start + lan.detection_bound(NODES) / 4
    cluster.partition([range(half), range(half, NODES)], start=start, heal=1e9)

    across = [
        (observer, subject)
        for observer in range(NODES)
        for subject in range(NODES)
        if (observer < half) != (subject < half)
    ]
    # Pairs (observer, subject) where the observer does not yet hold the
    # subject dead. While the cut lasts a verdict stands, so the periodic
    # check re-reads only the open pairs; the final one reads them all.
    open_pairs = across

    def undecided() -> list[tuple[int, int]]:
        nonlocal open_pairs
        open_pairs = [pair for pair in open_pairs if not _holds_dead(cluster, *pair)]
        return open_pairs

    cluster.run_until(start + lan.suspicion_min_timeout(NODES))
    cluster.loop.run_while(lambda: bool(undecided()), until=bound, check_every=5.0)
    undecided_at_end = [pair for pair in across if not _holds_dead(cluster, *pair)]
    assert undecided_at_end == [], "pairs (observer, subject) across the cut not declared dead"
    cluster.heal()
    cluster.run_for(4 * lan.reconnect_interval)
    assert cluster.view_agreement(observers=range(NODES)) == 1.0
    # Every verdict came from the partition: none is a false positive.
    assert cluster.false_positives() == []
