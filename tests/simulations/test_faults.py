"""Directed link faults: a one-way cut, and what each side comes to believe."""

from __future__ import annotations

from typing import Any

from simulations.scenario import build_cluster, load_scenario, run_scenario
from simulations.schema import resolve
from tests import REPO

SCENARIOS = REPO / "simulations" / "scenarios"


def cut_scenario(count: int, to: list[Any], **membership: Any) -> dict[str, Any]:
    cut = {"kind": "cut", "from": [0], "to": to, "at": 5.0, "heal": 20.0}
    return {
        "duration": 40.0,
        "nodes": {"count": count},
        "membership": membership,
        "faults": [cut],
    }


def test_one_way_cut_b_suspects_a_while_a_keeps_b_alive() -> None:
    """Node 0's messages to everyone are lost; theirs reach it. Everyone
    declares node 0 dead; node 0, Lifeguard telling it that it is the likely
    culprit, declares nobody dead."""
    result = run_scenario(cut_scenario(10, [{"range": [1, 10]}]), seed=1)
    (cut,) = result["cuts"]
    assert (cut["from"], cut["to"], cut["start"], cut["heal"]) == (1, 9, 5.0, 20.0)
    assert cut["to_about_from"] == {"suspect": 9, "dead": 9}
    assert cut["from_about_to"]["dead"] == 0
    assert result["drops"]["network"]["cut"] > 0
    # After the heal, node 0 refutes and the swarm agrees again.
    assert result["view_agreement"] == 1.0


def test_a_one_way_cut_between_two_nodes_is_routed_around() -> None:
    """SWIM's indirect probes go through a third node: neither side of a
    single cut link suspects the other. Without helpers both do."""
    helped = run_scenario(cut_scenario(10, [1]), seed=1)["cuts"][0]
    assert helped["to_about_from"] == helped["from_about_to"] == {"suspect": 0, "dead": 0}
    alone = run_scenario(cut_scenario(10, [1], indirect_checks=0), seed=1)["cuts"][0]
    assert alone["to_about_from"]["suspect"] == 1
    assert alone["from_about_to"]["suspect"] == 1


def test_the_shipped_one_way_example_shows_the_asymmetry() -> None:
    scenario = load_scenario(SCENARIOS / "one-way.toml")
    (cut,) = run_scenario(scenario, seed=2)["cuts"]
    assert cut["to_about_from"]["dead"] == cut["to"] == 29
    assert cut["from_about_to"]["dead"] == 0


def test_helpers_outside_the_cut_keep_the_muted_node_alive() -> None:
    """Cut node 0 off from half the swarm only: the other half relays its
    acks (indirect probes), so nobody declares it dead."""
    (cut,) = run_scenario(cut_scenario(20, [{"range": [1, 10]}]), seed=1)["cuts"]
    assert cut["to_about_from"]["dead"] == 0


def link_fault(kind: str, **keys: Any) -> dict[str, Any]:
    return {"duration": 60.0, "nodes": {"count": 12}, "faults": [{"kind": kind, **keys}]}


def test_a_flapping_partition_is_its_windows_written_out() -> None:
    flapping = link_fault(
        "partition", at=5.0, heal=45.0, flap={"period": 10.0, "duty": 0.5}, groups="halves"
    )
    written_out = {
        **flapping,
        "faults": [
            {"kind": "partition", "at": start, "heal": start + 5.0, "groups": "halves"}
            for start in (5.0, 15.0, 25.0, 35.0)
        ],
    }
    one: list[str] = []
    other: list[str] = []
    run_scenario(flapping, seed=4, timeline=one)
    run_scenario(written_out, seed=4, timeline=other)

    def events(lines: list[str]) -> list[str]:
        return [line for line in lines if " scenario " not in line]

    # The resolved scenarios differ (their digests are traced), and every
    # traced event is the same.
    assert set(one) - set(events(one)) != set(other) - set(events(other))
    assert events(one) == events(other)
    assert sum(" partition " in line for line in one) == 4


def test_bridge_and_ring_topologies_are_built_from_cuts() -> None:
    groups = [[{"range": [0, 5]}], [{"range": [5, 10]}]]  # nodes 10 and 11: the bridge
    bridged = run_scenario(link_fault("bridge", at=5.0, heal=40.0, groups=groups), seed=1)
    split = run_scenario(link_fault("partition", at=5.0, heal=40.0, groups=groups), seed=1)
    assert [(c["from"], c["to"]) for c in bridged["cuts"]] == [(5, 5), (5, 5)]
    assert bridged["drops"]["network"]["cut"] > 0
    # The bridge relays indirect probes: far fewer deaths than a clean split.
    bridged_dead = sum(c["to_about_from"]["dead"] for c in bridged["cuts"])
    assert bridged_dead < split["events"].get("dead", 0)

    ring = [[{"range": [3 * i, 3 * i + 3]}] for i in range(4)]
    cuts = run_scenario(link_fault("ring", at=5.0, heal=40.0, groups=ring), seed=1)["cuts"]
    assert len(cuts) == 4  # sets 0-2 and 1-3, both ways: neighbours stay linked
    assert all((c["from"], c["to"]) == (3, 3) for c in cuts)


def test_partition_metrics_time_the_split_and_the_reconvergence() -> None:
    scenario = load_scenario(SCENARIOS / "partition-halves.toml")
    scenario["nodes"]["count"] = 30
    (split,) = run_scenario(scenario, seed=1)["partitions"]
    assert (split["start"], split["heal"], split["cross_pairs"]) == (10.0, 70.0, 2 * 15 * 15)
    assert split["detected_fraction"] == 1.0 and split["reconverged_fraction"] == 1.0
    # Each side declares the other dead within the LAN profile's bound, and
    # the heal is noticed within a few push-pull rounds.
    assert 0 < split["median_detect_s"] <= split["time_to_detect_s"] < 60.0
    assert 0 < split["median_reconverge_s"] <= split["time_to_reconverge_s"] < 30.0
    # A partition that never heals reports no reconvergence time.
    scenario["faults"][0].pop("heal")
    (forever,) = run_scenario(scenario, seed=1)["partitions"]
    assert forever["heal"] is None and forever["time_to_reconverge_s"] is None


def halves_link(**link: Any) -> dict[str, Any]:
    halves = {"from": [{"range": [0, 10]}], "to": [{"range": [10, 20]}]}
    return {"duration": 60.0, "nodes": {"count": 20}, "network": {"links": [halves | link]}}


def test_links_slower_than_the_probe_timeout_raise_suspicion_only_across() -> None:
    """LAN probes time out after 0.5 s: a 0.3 s link between the halves is
    slow but fine; a 0.6 s one makes each half suspect the other (and the
    refutations keep everyone alive)."""
    assert run_scenario(halves_link(base_latency=0.3), seed=1)["events"] == {}
    slow = run_scenario(halves_link(base_latency=0.6), seed=1)
    assert slow["events"]["suspect"] > 0 and "dead" not in slow["events"]
    assert slow["view_agreement"] == 1.0


def test_a_lossy_one_way_link_is_counted_as_loss() -> None:
    muted = halves_link(loss=1.0, both=False)
    muted["network"]["links"][0] |= {"from": [0], "to": [{"range": [1, 20]}]}
    result = run_scenario(muted, seed=1)
    assert result["drops"]["network"]["loss"] > 0  # the profile itself loses nothing
    assert result["events"]["dead"] > 0  # node 0 cannot be heard: declared dead


def test_a_lognormal_link_has_a_tail_its_uniform_twin_lacks() -> None:
    """The same 0.2 s scale between the halves: uniform, every round trip
    beats the 0.5 s probe timeout and nobody is suspected; lognormal with
    that median and sigma 1.5, the tail does not, and the halves suspect
    each other (and are refuted: nobody dies). A narrow lognormal has no
    such tail."""
    assert run_scenario(halves_link(jitter=0.2), seed=1)["events"] == {}
    tail = run_scenario(halves_link(jitter=0.2, jitter_kind="lognormal", jitter_sigma=1.5), seed=1)
    assert tail["events"]["suspect"] > 0 and "dead" not in tail["events"]
    assert tail["view_agreement"] == 1.0
    narrow = halves_link(jitter=0.2, jitter_kind="lognormal", jitter_sigma=0.1)
    assert run_scenario(narrow, seed=1)["events"] == {}


def spread(scenario: dict[str, Any]) -> dict[int, float | None]:
    cluster = build_cluster(resolve(scenario), seed=1)
    cluster.run_until(scenario["duration"])
    (publication,) = cluster.publications
    return cluster.spread_times(publication)


def test_a_low_bandwidth_link_holds_a_big_record_back_by_its_transmission_time() -> None:
    """An 8 KiB record published on node 0: across a 4,000 B/s link it
    cannot arrive before its 2 s of transmission, while node 0's own half
    has it sooner. Unlimited, everyone has it within 0.1 s."""
    record = 8192
    bandwidth = 4000.0
    scenario = halves_link(bandwidth=bandwidth)
    scenario["nodes"]["record_size"] = record
    scenario["faults"] = [{"kind": "publish", "node": 0, "at": 5.0}]
    slow = spread(scenario)
    assert None not in slow.values()
    own_half = [t for node, t in slow.items() if node < 10]
    across = [t for node, t in slow.items() if node >= 10]
    assert max(own_half) < record / bandwidth < min(across)  # type: ignore[type-var]
    scenario["network"]["links"] = []
    fast = spread(scenario)
    assert all(t is not None and t < 0.1 for t in fast.values())


def skewed(*faults: dict[str, Any], **network: Any) -> dict[str, Any]:
    return {"duration": 30.0, "nodes": {"count": 10}, "network": network, "faults": list(faults)}


def test_a_fast_clock_times_its_probes_out_early_and_accuses_healthy_peers() -> None:
    """Round trips take 0.2 s against a 0.5 s probe timeout: nobody is
    suspected. Node 0's clock running 8 times fast from t=5 gives it a
    0.0625 s timeout and 0.125 s probe rounds: it accuses its peers (who
    refute), and it is the first to. The same clock running 8 times slow
    accuses nobody."""
    slow_links = {"base_latency": 0.1, "jitter": 0.0}
    assert run_scenario(skewed(**slow_links), seed=1)["events"] == {}
    fast = skewed({"kind": "skew", "node": 0, "at": 5.0, "rate": 8.0}, **slow_links)
    cluster = build_cluster(resolve(fast), seed=1)
    cluster.run_until(fast["duration"])
    suspicions = [
        (at, observer) for at, observer, kind, _, _ in cluster.verdicts() if kind == "suspect"
    ]
    assert suspicions and min(suspicions)[1] == 0 and min(suspicions)[0] > 5.0
    assert cluster.view_agreement() == 1.0 and cluster.false_positives() == []
    slow = skewed({"kind": "skew", "node": 0, "at": 5.0, "rate": 1 / 8}, **slow_links)
    assert run_scenario(slow, seed=1)["events"] == {}


def first_dead(scenario: dict[str, Any]) -> tuple[float, int]:
    cluster = build_cluster(resolve(scenario), seed=1)
    cluster.run_until(scenario["duration"])
    return min((at, observer) for at, observer, kind, _, _ in cluster.verdicts() if kind == "dead")


def test_a_clock_jump_expires_a_suspicion_at_once() -> None:
    """Node 5 crashes at t=5; the swarm suspects it at about 6.4 and, with
    the suspicion's timeout, declares it dead after 9. Node 0's clock
    leaping a minute ahead at t=7 expires its suspicion then: it takes a
    last look (twice the 0.5 s probe timeout) and declares node 5 dead
    first, before t=8."""
    crash = {"kind": "crash", "node": 5, "at": 5.0}
    at, _ = first_dead(skewed(crash))
    assert at > 9.0
    at, observer = first_dead(skewed(crash, {"kind": "skew", "node": 0, "at": 7.0, "jump": 60.0}))
    assert observer == 0 and 7.0 <= at <= 8.0


def test_skews_bandwidth_and_lognormal_links_are_deterministic() -> None:
    scenario = halves_link(bandwidth=20_000.0, jitter_kind="lognormal", jitter=0.05)
    scenario["faults"] = [
        {"kind": "skew", "nodes": [3, 12], "at": 10.0, "rate": 3.0, "jump": 2.0},
        {"kind": "publish", "node": 0, "at": 5.0},
    ]
    once = run_scenario(scenario, seed=7)
    assert once == run_scenario(scenario, seed=7)
    assert once["trace_digest"] != run_scenario(scenario, seed=8)["trace_digest"]
