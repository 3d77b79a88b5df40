"""Placement in the simulator: the real Raft cores, ledgers and policy under
a chat-demand workload, scenario by scenario and over many seeds."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consensus.placement import ModelFacts
from consensus.settings import PlacementSettings
from simulations.placement_cluster import PlacementCluster
from simulations.placement_workers import DOCTOR_S, GB, LOAD_BYTES_PER_S, WorkerSpec
from simulations.scenario import ScenarioError, run_scenario
from tests import REPO

MODELS = {"x": ModelFacts(32, GB // 2), "y": ModelFacts(32, GB // 2)}
"""32 layers of half a GB: a whole copy needs 16 GB."""
LOAD_Y_S = 16 * GB / LOAD_BYTES_PER_S["gpu"] + DOCTOR_S


def swarm(seed: int = 1, *extra: WorkerSpec, **options: object) -> PlacementCluster:
    """Worker 0 pinned to x; workers 1 and 2 spare, with y in their store."""
    workers = [
        WorkerSpec(24, ("x",), pinned="x"),
        WorkerSpec(24, ("y",)),
        WorkerSpec(24, ("y",)),
        *extra,
    ]
    return PlacementCluster(seed, workers, MODELS, **options)  # type: ignore[arg-type]


def serving(cluster: PlacementCluster, model: str) -> list[int]:
    ledger = cluster.ledger()
    return [
        i for i, worker in enumerate(cluster.workers)
        if (held := ledger.assignment(worker.node)) is not None and held.model == model
    ]  # fmt: skip


def test_demand_places_a_model_on_spare_capacity_and_it_is_served_after_its_load() -> None:
    cluster = swarm()
    cluster.demand("y", 60, start=5, stop=100)
    cluster.run_until(100)
    cluster.check()
    y = cluster.metrics()["models"]["y"]  # type: ignore[index]
    # The control plane answers within a second (the 1 s target);
    # serving waits for the load and the doctor.
    assert y["request_to_assigned_s"] < 1.0
    assert LOAD_Y_S <= y["request_to_served_s"] < LOAD_Y_S + 2.0
    assert serving(cluster, "y") in ([1], [2])
    assert serving(cluster, "x") == [0]  # pinned, recorded, untouched
    assert 0.5 < y["served_fraction"] < 1.0


def test_a_crashed_serving_worker_is_replaced_from_spare_capacity() -> None:
    cluster = swarm()
    cluster.demand("y", 60, start=5, stop=300)
    cluster.run_until(40)
    (first,) = serving(cluster, "y")
    cluster.crash(first, at=40)
    # Dead at the leader after detection, released after the dead grace,
    # the other spare worker loads it.
    cluster.run_until(40 + cluster.detect_s + PlacementSettings().dead_grace_s + LOAD_Y_S + 5)
    cluster.check()
    assert serving(cluster, "y") == [3 - first]
    assert cluster.committed["Release"] == 1 and cluster.committed["Assign"] == 3  # x, y, y again
    assert cluster.servable("y")


def test_a_worker_that_fails_its_doctor_is_passed_over() -> None:
    bad = PlacementCluster(
        1, [WorkerSpec(16, ("y",), fails_doctor=True), WorkerSpec(24, ("y",))], MODELS
    )
    bad.demand("y", 60, start=1, stop=120)
    bad.run_until(120)
    bad.check()
    # The smaller worker was tried first; each time its doctor failed it was
    # marked and released (after its back-off, demand for more copies may
    # try it again), and the other one serves.
    assert bad.committed["MarkAdmissionFailed"] >= 1
    assert bad.committed["Release"] == bad.committed["MarkAdmissionFailed"]
    assert 1 in serving(bad, "y") and bad.workers[1].verdict == "admitted"
    assert bad.workers[0].verdict != "admitted"
    assert bad.servable("y")


def test_a_leader_cut_off_from_the_voters_places_nothing_and_the_ledgers_agree_after() -> None:
    cluster = swarm(voters=5)
    cluster.run_until(5)
    leader = cluster.raft.leader()
    assert leader is not None
    others = [i for i in range(5) if i != leader]
    cluster.partition_voters([[leader], others], at=5, heal=60)
    cluster.demand("y", 60, start=6, stop=60)
    cluster.run_until(30)
    # The majority elected a new leader and placed y; the old one's entries never committed.
    assert cluster.raft.leader() in others
    assert serving(cluster, "y")
    assert cluster.ledgers[leader].assignment(cluster.workers[1].node) is None
    assert cluster.ledgers[leader].assignment(cluster.workers[2].node) is None
    cluster.run_until(90)
    cluster.check()  # includes: every replica's ledger equal at equal applied index
    assert len({ledger.snapshot() for ledger in cluster.ledgers}) == 1


def test_leaderless_time_is_nil_when_calm_and_an_election_when_the_leader_is_cut_off() -> None:
    calm, cut = swarm(), swarm()
    cut.isolate_leader(at=10, heal=20)
    calm.run_until(30)
    cut.run_until(30)
    cut.check()
    quiet, failover = calm.metrics(), cut.metrics()
    assert quiet["leaderless_s"] == 0.0 and quiet["leader_changes"] == 0
    assert quiet["first_leader_at"] < 1.0  # type: ignore[operator]
    # The cut-off leader keeps its role until CheckQuorum steps it down, but
    # from the cut on it reaches no quorum: the outage starts at 10 s and
    # lasts the others' election timeout (10-20 ticks) and a vote.
    timeout = cut.raft.config.election_ticks * cut.raft.tick_s
    assert timeout / 2 < failover["leaderless_s"] < 4 * timeout  # type: ignore[operator]
    assert failover["leader_changes"] == 1
    # One outage (a span per term it saw), from the cut to the new leader.
    first = failover["first_leader_at"]
    assert isinstance(first, float)
    outage = [(start, end) for start, end, voter, _ in cut.leader_spans()
              if voter is None and start >= first]  # fmt: skip
    assert outage[0][0] == 10 and all(a[1] == b[0] for a, b in itertools.pairwise(outage))
    assert outage[-1][1] - 10 == pytest.approx(failover["leaderless_s"], abs=1e-6)


def test_a_voter_partition_without_a_majority_is_leaderless_until_it_heals() -> None:
    cluster = swarm()
    cluster.partition_voters([[0], [1], [2]], at=10, heal=15)
    cluster.run_until(30)
    cluster.check()
    timeout = cluster.raft.config.election_ticks * cluster.raft.tick_s
    leaderless = cluster.metrics()["leaderless_s"]
    assert 5.0 < leaderless < 5.0 + 4 * timeout  # type: ignore[operator]
    assert cluster.committing_leader() is not None


def test_incomplete_chain_time_grows_while_no_worker_serves_y_and_stops_once_replaced() -> None:
    def incomplete() -> float:
        return cluster.metrics()["models"]["y"]["incomplete_chain_s"]  # type: ignore[index]

    cluster = swarm()
    cluster.demand("y", 60, start=5, stop=140)
    cluster.run_until(40)
    (first,) = serving(cluster, "y")
    # From the first request: the decision, the load and the doctor.
    assert LOAD_Y_S <= incomplete() < LOAD_Y_S + 2.0
    before = incomplete()
    cluster.crash(first, at=40)
    cluster.run_until(100)
    # The leader sees the crash after detection, then the replacement loads.
    outage = incomplete() - before
    assert cluster.detect_s + LOAD_Y_S <= outage < 60 - 2.0
    cluster.run_until(140)
    cluster.check()
    assert incomplete() == before + outage and cluster.servable("y")
    # Exact, not sampled: with no liar, a request is served exactly when a
    # complete chain exists as it arrives.
    spans = cluster.chain_spans("y")
    assert [(start, ok) for start, _, ok in spans] == [(0.0, False), (spans[1][0], True),
                                                      (40, False), (spans[3][0], True)]  # fmt: skip
    for at, model, served in cluster.requests:
        if model == "y":
            assert served == next(ok for start, end, ok in spans if start <= at < end), at


@pytest.mark.slow  # minutes of CPU: `make test` runs it, `make check` leaves it
@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    spares=st.lists(st.tuples(st.sampled_from([8, 12, 24]), st.booleans()), min_size=1, max_size=5),
    rate=st.floats(1, 120),
    crashes=st.lists(st.tuples(st.integers(0, 5), st.floats(1, 200)), max_size=3),
    cut=st.one_of(st.none(), st.tuples(st.floats(1, 150), st.floats(1, 60))),
)
def test_random_runs_keep_every_invariant_and_replay_from_their_seed(
    seed: int,
    spares: list[tuple[int, bool]],
    rate: float,
    crashes: list[tuple[int, float]],
    cut: tuple[float, float] | None,
) -> None:
    def run() -> PlacementCluster:
        extra = [WorkerSpec(gb, ("y",), fails_doctor=fails) for gb, fails in spares]
        cluster = swarm(seed, *extra)
        cluster.demand("y", rate, start=1, stop=200)
        cluster.demand("x", rate / 2, start=1, stop=200)
        for worker, at in crashes:
            cluster.crash(worker % len(cluster.workers), at)
            cluster.restart(worker % len(cluster.workers), at + 30)
        if cut is not None:
            cluster.partition_voters([[0], [1, 2]], cut[0], cut[0] + cut[1])
        cluster.run_until(250)
        cluster.check()
        return cluster

    first = run()
    assert first.metrics() == run().metrics()  # same seed, same run, same digest
    # The pinned shard of x is recorded once and never moves (check() holds
    # that too); x is served whenever its worker is up.
    assert serving(first, "x") == [0]


SCENARIO = REPO / "simulations" / "scenarios" / "demand-placement.toml"


@pytest.mark.slow  # ~7 s: left to `make test`
def test_the_shipped_placement_scenario_runs_and_replays(tmp_path: Path) -> None:
    result = run_scenario(SCENARIO, seed=2)
    timeline: list[str] = []
    # Again, keeping its timeline and drawing its plot: the same run.
    assert result == run_scenario(SCENARIO, seed=2, timeline=timeline, plots=tmp_path)
    assert (tmp_path / "placement.png").read_bytes().startswith(b"\x89PNG")
    times = [float(line.split()[0]) for line in timeline]
    assert times == sorted(times) and any(" commit Assign y" in line for line in timeline)
    assert result["scenario"] == "demand-placement" and result["violations"] == 0
    assert result["terms"] >= 2  # the cut-off leader was replaced
    assert "invariant_failure" not in result
    # Its story: the corrupt copy is marked and passed over, the crash is
    # relocated, and most requests are served.
    assert result["committed"]["MarkAdmissionFailed"] >= 1
    assert result["committed"]["Release"] >= 2
    y = result["models"]["y"]
    assert y["request_to_assigned_s"] < 1.0 and y["served_fraction"] > 0.5


@pytest.mark.parametrize(
    ("placement", "faults", "match"),
    [
        ({"models": [{"name": "y", "layers": 4}]}, [], "layer_gb"),
        ({"models": "y"}, [], "array of tables"),
        ({"workers": [{"memory_gb": 8, "models": ["nope"]}]}, [], "'nope', not in"),
        ({"workers": [{"memory_gb": 8, "hardware": "tpu"}]}, [], "hardware"),
        ({"workers": [{"memory_gb": 8}]}, [{"kind": "crash", "worker": 3}], "not in 0..0"),
        ({}, [{"kind": "meteor"}], "kind must be one of"),
        ({"models": [{"name": "y", "layers": 4, "layer_gb": 1}]}, [], None),  # valid
    ],
)
def test_placement_scenario_errors_name_the_problem(
    placement: dict[str, object], faults: list[object], match: str | None
) -> None:
    scenario = {"duration": 5.0, "placement": placement, "faults": faults}
    if match is None:
        assert run_scenario(scenario, seed=1)["violations"] == 0
        return
    with pytest.raises(ScenarioError, match=match):
        run_scenario(scenario, seed=1)
