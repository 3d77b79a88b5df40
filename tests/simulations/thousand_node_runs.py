"""The 1,000-node runs of tests/simulations/test_swarm_1000.py, as functions a
fresh process can run on the compiled core.

`simulations` is imported first, so `SHARDMESH_SIM_CORE` takes effect
before any hot module loads (simulations/__init__.py); a pool process
started with the variable set unpickles these functions by importing this
module, and so runs them on the build."""

from __future__ import annotations

import simulations  # noqa: F401  # first: honours SHARDMESH_SIM_CORE
from mesh.config import MembershipConfig
from mesh.membership import MemberState
from simulations.cluster import MembershipCluster
from simulations.compiled import is_compiled
from simulations.network import NetworkConfig

NODES = 1000
FALSE_POSITIVE_SECONDS = 40.0
"""Long enough for every suspicion raised in the first half of the run to be
decided with confirmations (9 s at 1,000 nodes) and for several thousand
suspicions in all; the 50-node test in tests/simulations/test_cluster.py covers the
lone, unconfirmed suspicions that run to the maximum timeout."""


def lossy_run(seed: int) -> tuple[int, bool, int, list[tuple[float, int, int]]]:
    """Seed, compiled or not, suspicions raised, (time, observer, subject)
    wrongly declared dead, over a 40 s run at 10% loss."""
    cluster = MembershipCluster(NODES, seed, network=NetworkConfig.lan(loss=0.1))
    cluster.run_until(FALSE_POSITIVE_SECONDS)
    return seed, is_compiled(), cluster.event_counts["suspect"], cluster.false_positives()


def _holds_dead(cluster: MembershipCluster, observer: int, subject: int) -> bool:
    view = cluster.membership(observer).member(cluster.node_id(subject))
    return view is not None and view.state is MemberState.DEAD


def partition_run(seed: int) -> dict[str, object]:
    """A 50/50 cut at 5 s, kept until every node holds every node across it
    dead (or the bound), then healed: what the test asserts on."""
    half = NODES // 2
    lan = MembershipConfig.lan()
    start = 5.0
    cluster = MembershipCluster(NODES, seed)
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
    cluster.heal()
    cluster.run_for(4 * lan.reconnect_interval)
    return {
        "compiled": is_compiled(),
        "undecided_at_end": undecided_at_end,
        "view_agreement": cluster.view_agreement(observers=range(NODES)),
        "false_positives": cluster.false_positives(),
    }
