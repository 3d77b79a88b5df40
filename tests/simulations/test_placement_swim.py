"""Placement over real SWIM membership (`membership = "swim"`): the leader
learns who is dead from its own membership core, entries route by their
own views, and voter or worker partitions split the membership network too."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from consensus.placement import ModelFacts
from consensus.settings import PlacementSettings
from mesh.config import MembershipConfig
from simulations.placement_cluster import PlacementCluster
from simulations.placement_membership import DETECT_S
from simulations.placement_routing import ENTRIES
from simulations.placement_workers import GB, WorkerSpec
from simulations.scenario import run_scenario
from simulations.schema import ScenarioError, resolve
from tests import REPO

ROOT = REPO
SCENARIO = ROOT / "simulations" / "scenarios" / "placement-swim.toml"
MODELS = {"y": ModelFacts(32, GB // 2)}
"""32 layers of half a GB: a whole copy needs 16 GB, one 24 GB worker."""
VOTERS = 3
WORKERS = 6
MEMBERS = VOTERS + WORKERS + ENTRIES
"""Voters, then workers, then entries: the SWIM members, numbered so."""
LAN = MembershipConfig.lan()
GRACE_S = PlacementSettings().dead_grace_s


def swarm(seed: int) -> PlacementCluster:
    """Six spare workers with y in their store, over SWIM, under demand for y."""
    workers = [WorkerSpec(24, ("y",)) for _ in range(WORKERS)]
    cluster = PlacementCluster(seed, workers, MODELS, voters=VOTERS, membership=LAN)
    cluster.demand("y", 30, start=5, stop=400)
    return cluster


def serving(cluster: PlacementCluster) -> list[int]:
    ledger = cluster.ledger()
    return [i for i, w in enumerate(cluster.workers) if ledger.assignment(w.node) is not None]


def state(cluster: PlacementCluster, observer: int, worker: int) -> str:
    """What SWIM member `observer`'s own core believes of `worker`."""
    assert cluster.swim is not None
    view = cluster.swim.membership(observer).member(cluster.swim.node_id(VOTERS + worker))
    assert view is not None
    return str(view.state)


def releases(cluster: PlacementCluster) -> list[float]:
    return [at for at, kind, _ in cluster.commits if kind == "Release"]


def crash_the_server(seed: int) -> tuple[PlacementCluster, int]:
    cluster = swarm(seed)
    cluster.run_until(40)
    (first,) = serving(cluster)
    cluster.crash(first, at=40)
    cluster.run_until(40 + LAN.detection_bound(MEMBERS) + GRACE_S + 30)
    cluster.check()
    return cluster, first


def test_a_crash_reaches_the_leader_after_swim_detection_and_its_shard_moves() -> None:
    delays = []
    for seed in (1, 2):
        cluster, crashed = crash_the_server(seed)
        report: Any = cluster.metrics()["membership"]
        (detection,) = report["detections"]
        assert detection["worker"] == crashed and detection["crashed_at"] == 40
        delay = detection["detect_s"]
        # Probes, then a suspicion that confirmations shrink toward its
        # minimum: never quicker than that minimum, never slower than SWIM's
        # worst case, and not the oracle's fixed delay.
        assert LAN.suspicion_min_timeout(MEMBERS) <= delay <= LAN.detection_bound(MEMBERS)
        assert delay != DETECT_S
        delays.append(delay)
        # The leader released the shard once its own core had held the worker
        # dead for the grace (not `detect_s` after the crash), and a spare
        # worker serves it now.
        (released,) = releases(cluster)
        dead_at = detection["leader_dead_at"]
        assert dead_at + GRACE_S <= released < dead_at + GRACE_S + 1.0
        assert serving(cluster) and crashed not in serving(cluster)
        assert cluster.servable("y")
        # Entries kept routing into the crashed worker until their own
        # cores held it dead, and routed around it.
        assert report["rerouted"] > 0
        assert report["false_dead"] == 0 and report["live_held_dead_s"] == 0
    assert delays[0] != delays[1]  # a real protocol's timing, not a constant


def test_workers_cut_off_from_the_leader_are_dead_to_it_and_their_shard_moves_until_the_heal() -> (
    None
):
    cluster = swarm(3)
    cluster.run_until(40)
    (cut,) = serving(cluster)
    cluster.cut_off_workers([cut], at=40, heal=160)
    leader = cluster.raft.leader()
    assert leader is not None
    entries = range(VOTERS + WORKERS, MEMBERS)

    def someone_holds_it_live() -> bool:
        observers = [leader, *entries]
        return any(state(cluster, i, cut) in ("alive", "suspect") for i in observers)

    assert not cluster.loop.run_while(someone_holds_it_live, 40 + LAN.detection_bound(MEMBERS))
    # The leader and every entry hold it dead, though it runs and serves: the
    # entries' coverage has left it out, the truth's has not.
    assert cluster.now > 40 + LAN.suspicion_min_timeout(MEMBERS)
    node = cluster.workers[cut].node
    assert cluster.workers[cut].alive and serving(cluster) == [cut]
    assert all(cluster.coverage(entry).excluded.get(node) == "dead" for entry in entries)
    assert cluster.coverage().best("y") is not None and node not in cluster.coverage().excluded
    # The leader releases it after the grace and places y elsewhere.
    dead_at = cluster.now
    cluster.run_until(160)
    (released,) = releases(cluster)
    assert dead_at + GRACE_S - 10 <= released < dead_at + GRACE_S + 1.0
    assert serving(cluster) and cut not in serving(cluster)
    # After the heal the swarm sees it alive again: it is spare capacity.
    cluster.run_until(200)
    cluster.check()
    assert state(cluster, leader, cut) == "alive"
    assert all(state(cluster, entry, cut) == "alive" for entry in entries)
    report: Any = cluster.metrics()["membership"]
    assert report["live_held_dead_s"] > 60  # held dead through most of the cut
    assert report["false_dead"] == 0  # every such verdict was the partition's
    assert report["detections"] == []


def test_a_voter_partition_splits_membership_with_the_workers_on_the_majority_side() -> None:
    cluster = swarm(4)
    cluster.run_until(30)
    old = cluster.raft.leader()
    assert old is not None
    others = [i for i in range(VOTERS) if i != old]
    cluster.partition_voters([[old], others], at=30, heal=90)
    cluster.run_until(85)
    new = cluster.raft.leader()
    assert new in others and cluster.swim is not None
    network = cluster.swim.network
    assert not any(network.can_reach(old, VOTERS + w) for w in range(WORKERS))
    assert all(network.can_reach(new, VOTERS + w) for w in range(WORKERS))
    # The cut-off voter's view decays: it suspects workers it cannot reach
    # (slowly: Lifeguard slows a node whose own probes go unanswered, and
    # nobody on its side confirms its suspicions). The new leader, on the
    # workers' side, holds them all alive, and placement goes on undisturbed.
    assert any(state(cluster, old, w) != "alive" for w in range(WORKERS))
    assert all(state(cluster, new, w) == "alive" for w in range(WORKERS))
    cluster.run_until(130)
    cluster.check()
    assert all(state(cluster, old, w) == "alive" for w in range(WORKERS))
    assert releases(cluster) == [] and serving(cluster)


def test_the_oracle_has_no_membership_network_to_cut_workers_off() -> None:
    oracle = PlacementCluster(1, [WorkerSpec(24, ("y",))], MODELS)
    with pytest.raises(ValueError, match="needs SWIM"):
        oracle.cut_off_workers([0], at=1, heal=2)
    with pytest.raises(ValueError, match="needs SWIM"):
        oracle.partition_voters([[0], [1, 2]], at=1, heal=2, workers=[0])
    with pytest.raises(ValueError, match="needs SWIM"):
        oracle.isolate_leader(at=1, heal=2, workers=[0])
    oracle.run_until(5)
    assert oracle.swim is None and "membership" not in oracle.metrics()


def small(**placement: Any) -> dict[str, Any]:
    """A short SWIM placement scenario: a crash, then a worker cut off."""
    table = {
        "membership": "swim",
        "models": [{"name": "y", "layers": 32, "layer_gb": 0.5}],
        "workers": [{"count": WORKERS, "memory_gb": 24, "models": ["y"]}],
        "demand": [{"model": "y", "per_minute": 30}],
    }
    faults = [
        {"kind": "crash", "worker": 0, "at": 30.0},
        {"kind": "partition", "workers": [1, 2], "at": 60.0, "heal": 100.0},
    ]
    return {"duration": 120.0, "placement": table | placement, "faults": faults}


def test_same_seed_same_swim_run_in_another_process() -> None:
    here = run_scenario(small(), seed=5)
    code = (
        "import json, sys; from simulations.scenario import run_scenario; "
        "print(json.dumps(run_scenario(json.loads(sys.argv[1]), seed=5), sort_keys=True))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code, json.dumps(small())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(there.stdout) == json.loads(json.dumps(here, sort_keys=True))
    assert here["violations"] == 0 and "invariant_failure" not in here
    assert here["membership"]["detections"][0]["worker"] == 0
    assert here["trace_digest"] != run_scenario(small(), seed=6)["trace_digest"]


def test_the_shipped_swim_scenario_tells_its_story() -> None:
    result = run_scenario(SCENARIO, seed=1)
    assert result["violations"] == 0 and "invariant_failure" not in result
    assert result["terms"] >= 2  # the cut-off leader was replaced
    membership = result["membership"]
    (crash,) = membership["detections"]
    assert LAN.suspicion_min_timeout(MEMBERS) <= crash["detect_s"] <= LAN.detection_bound(MEMBERS)
    assert membership["live_held_dead_s"] > 0 and membership["false_dead"] == 0
    assert result["committed"]["Release"] >= 2  # the crashed shard, then the cut-off one
    assert result["models"]["y"]["served_fraction"] > 0.5


def test_oracle_scenarios_resolve_as_before_with_the_oracle_filled_in() -> None:
    oracle = small() | {"faults": [], "duration": 10.0}
    del oracle["placement"]["membership"]
    resolved = resolve(oracle)
    assert resolved["placement"]["membership"] == "oracle"
    assert resolved["placement"]["swim"] is None
    assert "membership" not in run_scenario(oracle, seed=1)


@pytest.mark.parametrize(
    ("placement", "faults", "message"),
    [
        ({"membership": "raft"}, [], "placement.membership: 'raft' is not one of oracle, swim"),
        (
            {"membership": "oracle", "swim": {"profile": "lan"}},
            [],
            'placement.swim: only used with placement.membership = "swim"',
        ),
        ({"detect_s": 5.0}, [], r"placement\.detect_s: unused with placement\.membership"),
        ({"swim": {"suspicion_multt": 4}}, [], r"placement\.swim\.suspicion_multt: unknown key"),
        (
            {"swim": {"probe_timeout": 2.0}},
            [],
            "placement.swim: probe_timeout must be shorter than probe_interval",
        ),
        (
            {"membership": "oracle"},
            [{"kind": "partition", "workers": [1], "at": 5.0}],
            r'faults\[0\]\.workers: cutting workers off needs placement\.membership = "swim"',
        ),
        (
            {},
            [{"kind": "partition", "workers": [9], "at": 5.0}],
            r"faults\[0\]\.workers\[0\]: worker 9 is not in 0\.\.5",
        ),
        ({}, [{"kind": "partition", "at": 5.0}], r"faults\[0\]: a partition names `voters`"),
    ],
)
def test_swim_mistakes_are_errors_naming_the_key(
    placement: dict[str, Any], faults: list[dict[str, Any]], message: str
) -> None:
    scenario = small(**placement) | {"faults": faults}
    with pytest.raises(ScenarioError, match=message):
        resolve(scenario)
