"""Route finding over the coverage map, failover re-routing, and peer back-off."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.coverage import ModelCoverage, ServingNode, build_coverage
from mesh.records import Addresses, Assignment, BackendInfo, CapabilityReport, NodeRecord
from mesh.relay import RELAY_BYTES_PER_S
from mesh.routes import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    CLAIM_CEILING_FACTOR,
    DEFAULT_HOP_LATENCY_S,
    NEWCOMER_SPEEDUP,
    OVERCLAIM_PENALTY_S,
    SUSPECT_PENALTY_S,
    Backoff,
    NoRoute,
    Route,
    RouteHop,
    RouteInputs,
    chain_cost_s,
    claim_ceiling,
    find_route,
    hop_cost_s,
    network_inputs,
    overclaims,
    reroute,
)

NOW = 10_000.0
MODEL = "qwen3-8l"
DIGEST = "aa" * 32
ENTRY = b"\xee" * 32


def nid(index: int) -> bytes:
    return index.to_bytes(32, "big")


@dataclass(frozen=True)
class Spec:
    """A node as a test describes it."""

    index: int
    layers: tuple[int, int]
    decode: float = 100.0
    state: str = "alive"
    result: str = "admitted"
    expires_at: float = NOW + 600


def record(spec: Spec) -> NodeRecord:
    capability = CapabilityReport(
        result=spec.result,  # type: ignore[arg-type]
        model=MODEL,
        manifest_digest=DIGEST,
        layers=spec.layers,
        recipe="fp32",
        backend="torch",
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=spec.decode,
        validated_at=NOW - 60,
        expires_at=spec.expires_at,
        failure=None if spec.result == "admitted" else "probe mismatch",
    )
    return NodeRecord(
        addresses=Addresses("tcp://n:1", "tcp://n:2"),
        started_at=0.0,
        backend=BackendInfo("torch", "cpu", 2**30),
        assignment=Assignment(MODEL, spec.layers, "fp32", "operator", False, 1),
        capability=capability,
    )


def coverage(specs: Sequence[Spec], num_layers: int = 8) -> ModelCoverage:
    """The coverage the real builder makes from these nodes' records."""
    cmap = build_coverage(
        [(nid(s.index), s.state, record(s)) for s in specs], NOW, {MODEL: num_layers}
    )
    entry = cmap.best(MODEL)
    assert entry is not None
    return entry


def inputs(**kwargs: object) -> RouteInputs:
    kwargs.setdefault("entry", ENTRY)
    return RouteInputs(**kwargs)  # type: ignore[arg-type]


def ids(route: Route | NoRoute) -> list[int]:
    assert isinstance(route, Route), route
    return [int.from_bytes(hop.node_id, "big") for hop in route.hops]


def assert_tiles(route: Route, num_layers: int) -> None:
    assert route.hops[0].layers[0] == 0
    assert route.hops[-1].layers[1] == num_layers
    for before, after in zip(route.hops, route.hops[1:], strict=False):
        assert before.layers[1] == after.layers[0]


# --- basics -----------------------------------------------------------------


def test_three_shards_make_one_chain() -> None:
    cov = coverage([Spec(1, (0, 3)), Spec(2, (3, 6)), Spec(3, (6, 8))])
    route = find_route(cov, inputs(latency_s={nid(1): 0.001, nid(2): 0.002, nid(3): 0.003}))
    assert isinstance(route, Route)
    assert route.hops == (
        RouteHop(nid(1), (0, 3)),
        RouteHop(nid(2), (3, 6)),
        RouteHop(nid(3), (6, 8)),
    )
    # Three compute steps of 10 ms, three incoming links, one return from the last hop.
    assert route.cost_s == pytest.approx(3 * 0.01 + 0.001 + 0.002 + 2 * 0.003)


def test_faster_replica_wins_and_slow_whole_model_node_loses() -> None:
    cov = coverage(
        [
            Spec(1, (0, 8), decode=10.0),  # one hop, but 100 ms per token
            Spec(2, (0, 4), decode=200.0),
            Spec(3, (4, 8), decode=100.0),
            Spec(4, (4, 8), decode=400.0),
        ]
    )
    route = find_route(cov, inputs(latency_s={nid(i): 0.001 for i in range(1, 5)}))
    assert ids(route) == [2, 4]


def test_latency_can_outweigh_throughput() -> None:
    cov = coverage([Spec(1, (0, 8), decode=100.0), Spec(2, (0, 8), decode=1000.0)])
    # Node 2 computes 9 ms faster but sits 50 ms away (twice: there and back).
    route = find_route(cov, inputs(latency_s={nid(1): 0.001, nid(2): 0.05}))
    assert ids(route) == [1]


def test_entry_hop_has_no_network_latency() -> None:
    cov = coverage([Spec(1, (0, 8)), Spec(2, (0, 8))])
    route = find_route(cov, inputs(entry=nid(2), latency_s={nid(1): 0.001, nid(2): 0.5}))
    assert ids(route) == [2]
    assert isinstance(route, Route)
    assert route.cost_s == pytest.approx(0.01)


def test_unmeasured_latency_uses_the_default() -> None:
    cov = coverage([Spec(1, (0, 8))])
    route = find_route(cov, inputs())
    assert isinstance(route, Route)
    assert route.cost_s == pytest.approx(0.01 + 2 * DEFAULT_HOP_LATENCY_S)


def test_zero_throughput_does_not_divide_by_zero() -> None:
    cov = coverage([Spec(1, (0, 8), decode=0.0), Spec(2, (0, 8), decode=5.0)])
    assert ids(find_route(cov, inputs())) == [2]
    only_unmeasured = coverage([Spec(1, (0, 8), decode=0.0)])
    route = find_route(only_unmeasured, inputs())
    assert isinstance(route, Route) and math.isfinite(route.cost_s)


def test_ties_go_to_the_lowest_node_ids() -> None:
    cov = coverage([Spec(3, (0, 4)), Spec(1, (4, 8)), Spec(2, (0, 4)), Spec(4, (4, 8))])
    assert ids(find_route(cov, inputs())) == [2, 1]


def test_load_penalises_and_full_or_busy_nodes_are_excluded() -> None:
    cov = coverage([Spec(1, (0, 8)), Spec(2, (0, 8), decode=60.0)])
    assert ids(find_route(cov, inputs())) == [1]
    # Half full: 10 ms becomes 20 ms, worse than node 2's 16.7 ms.
    assert ids(find_route(cov, inputs(load={nid(1): 0.5}))) == [2]
    assert ids(find_route(cov, inputs(load={nid(2): 1.0}))) == [1]
    assert ids(find_route(cov, inputs(busy={nid(1)}))) == [2]


def test_suspects_are_used_only_when_needed() -> None:
    cov = coverage([Spec(1, (0, 8), state="suspect"), Spec(2, (0, 8), decode=10.0)])
    assert ids(find_route(cov, inputs())) == [2]
    alone = coverage([Spec(1, (0, 8), state="suspect")])
    route = find_route(alone, inputs())
    assert isinstance(route, Route)
    assert route.cost_s == pytest.approx(0.01 + 2 * DEFAULT_HOP_LATENCY_S + SUSPECT_PENALTY_S)


def test_bad_estimates_are_rejected() -> None:
    with pytest.raises(ValueError, match="latency_s"):
        inputs(latency_s={nid(1): -1.0})
    with pytest.raises(ValueError, match="load"):
        inputs(load={nid(1): math.nan})
    with pytest.raises(ValueError, match="observed_step_s"):
        inputs(observed_step_s={nid(1): math.inf})


# --- the network: delays between hops, relays, bandwidth ---------------------


def test_a_relayed_hop_of_equal_compute_loses_to_a_direct_one() -> None:
    cov = coverage([Spec(1, (0, 4)), Spec(2, (4, 8)), Spec(3, (4, 8))])
    near = {nid(i): 0.02 for i in (1, 2, 3)}
    # Node 2 has the smaller id, so it wins a tie; relayed, it loses it.
    assert ids(find_route(cov, inputs(latency_s=near))) == [1, 2]
    route = find_route(cov, inputs(latency_s=near, relayed={nid(2)}))
    assert ids(route) == [1, 3]
    # A direct hop 15 ms slower per step loses to the relayed one: "similar cost" only.
    slow = coverage([Spec(1, (0, 4)), Spec(2, (4, 8)), Spec(3, (4, 8), decode=40.0)])
    assert ids(find_route(slow, inputs(latency_s=near, relayed={nid(2)}))) == [1, 2]


def test_a_far_hop_loses_to_a_near_one_by_the_delay_from_the_hop_before() -> None:
    cov = coverage([Spec(1, (0, 4)), Spec(2, (4, 8)), Spec(3, (4, 8))])
    # The entry sees 2 and 3 alike; node 1 measured 2 at 80 ms and 3 at 10 ms.
    alike = {nid(i): 0.02 for i in (1, 2, 3)}
    rtts = {nid(1): {nid(2): 0.08, nid(3): 0.01}}
    route = find_route(cov, inputs(latency_s=alike, peer_rtt_s=rtts))
    assert ids(route) == [1, 3]
    assert isinstance(route, Route)
    # In 20 ms, compute, 1 -> 3 in 5 ms, compute, 3 back to the entry 20 ms.
    assert route.cost_s == pytest.approx(0.02 + 0.01 + 0.005 + 0.01 + 0.02)
    # The same measurement from the other end counts as well.
    rtts_back = {nid(2): {nid(1): 0.08}, nid(3): {nid(1): 0.01}}
    assert ids(find_route(cov, inputs(latency_s=alike, peer_rtt_s=rtts_back))) == [1, 3]


def test_bandwidth_matters_for_a_long_prompt_only() -> None:
    cov = coverage([Spec(1, (0, 8)), Spec(2, (0, 8), decode=90.0)])
    # Node 1 computes 1 ms faster per step but sits behind 1 MB/s; node 2 100 MB/s.
    rates = {nid(1): 1e6, nid(2): 1e8}
    short = inputs(bandwidth_bytes_per_s=rates, prefill_bytes=8 * 4096, decode_steps=64)
    assert ids(find_route(cov, short)) == [1]
    long = inputs(bandwidth_bytes_per_s=rates, prefill_bytes=4000 * 4096, decode_steps=64)
    assert ids(find_route(cov, long)) == [2]


def test_reroute_prices_the_replacement_from_the_hops_around_it() -> None:
    cov = coverage([Spec(1, (0, 4)), Spec(2, (4, 6)), Spec(3, (4, 6)), Spec(4, (6, 8))])
    alike = {nid(i): 0.02 for i in (1, 2, 3, 4)}
    rtts = {nid(1): {nid(3): 0.01}, nid(3): {nid(4): 0.01}}
    network = inputs(latency_s=alike, peer_rtt_s=rtts)
    first = find_route(cov, network)
    assert ids(first) == [1, 3, 4]
    assert isinstance(first, Route)
    # Node 3 fails: node 2 replaces it alone, the others keep their caches.
    assert ids(reroute(cov, first, {nid(3)}, network)) == [1, 2, 4]


def test_network_inputs_read_round_trips_and_relays_from_the_records() -> None:
    cov = coverage([Spec(1, (0, 4)), Spec(2, (4, 8)), Spec(3, (4, 8))])
    records = {
        ENTRY: replace(record(Spec(9, (0, 8))), rtt_us={nid(1).hex(): 40_000}),
        nid(1): replace(
            record(Spec(1, (0, 4))), rtt_us={nid(2).hex(): 80_000, nid(3).hex(): 10_000}
        ),
        nid(2): record(Spec(2, (4, 8))),
        nid(3): replace(record(Spec(3, (4, 8))), reach="relayed"),
    }
    network = network_inputs(ENTRY, cov, records.get)
    assert network.latency_s == {nid(1): 0.02}
    assert network.peer_rtt_s[nid(1)] == {nid(2): 0.08, nid(3): 0.01}
    assert network.relayed == {nid(3)}
    assert network.bandwidth_bytes_per_s == {nid(3): RELAY_BYTES_PER_S}
    # 3 is 35 ms nearer node 1 than 2 is, which outweighs the relay's penalty.
    assert ids(find_route(cov, network)) == [1, 3]


def test_a_newcomer_is_assumed_as_near_as_the_farthest_measured_member() -> None:
    """Neither the entry's record nor its probes measured node 2 yet (it
    just joined): it is priced at the farthest measured member's latency,
    not the intercontinental default, and its better claim wins the route."""
    cov = coverage([Spec(1, (0, 8)), Spec(2, (0, 8), decode=200.0)])
    records = {ENTRY: replace(record(Spec(9, (0, 8))), rtt_us={nid(1).hex(): 1_000})}
    network = network_inputs(ENTRY, cov, records.get)
    assert network.unmeasured_latency_s == 0.0005
    assert ids(find_route(cov, network)) == [2]
    assert network_inputs(ENTRY, cov, {}.get).unmeasured_latency_s == DEFAULT_HOP_LATENCY_S


def test_the_entrys_live_round_trips_override_its_record() -> None:
    """Its record is republished every ten seconds at most; what its probes
    measured just now is what routes use."""
    cov = coverage([Spec(1, (0, 8)), Spec(2, (0, 8), decode=200.0)])
    records = {ENTRY: replace(record(Spec(9, (0, 8))), rtt_us={nid(1).hex(): 1_000})}
    live = network_inputs(ENTRY, cov, records.get, {nid(1): 0.002, nid(2): 0.2})
    assert live.latency_s == {nid(1): 0.001, nid(2): 0.1}
    assert ids(find_route(cov, live)) == [1]


def test_bad_network_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="peer_rtt_s"):
        inputs(peer_rtt_s={nid(1): {nid(2): -0.1}})
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        inputs(bandwidth_bytes_per_s={nid(1): 0.0})
    with pytest.raises(ValueError, match="decode_steps"):
        inputs(decode_steps=0)


# --- observed speed against claims -------------------------------------------

LIAR_CLAIM = 5.4e11
"""The claim that carried every request in issue 18, against an honest 247."""


def test_an_observed_figure_replaces_the_claim() -> None:
    cov = coverage([Spec(1, (0, 8), decode=1000.0), Spec(2, (0, 8), decode=100.0)])
    assert ids(find_route(cov, inputs())) == [1]
    # Node 1 claims 1 ms per step but was seen to take 20 ms; node 2's 10 ms claim wins.
    observed = {nid(1): 0.02}
    assert ids(find_route(cov, inputs(observed_step_s=observed))) == [2]
    route = find_route(cov, inputs(observed_step_s={nid(1): 0.02, nid(2): 0.03}))
    assert ids(route) == [1]
    assert isinstance(route, Route)
    assert route.cost_s == pytest.approx(0.02 + 2 * DEFAULT_HOP_LATENCY_S)


def test_load_and_latency_still_apply_to_observed_figures() -> None:
    cov = coverage([Spec(1, (0, 8)), Spec(2, (0, 8))])
    observed = {nid(1): 0.01, nid(2): 0.015}
    assert ids(find_route(cov, inputs(observed_step_s=observed))) == [1]
    assert ids(find_route(cov, inputs(observed_step_s=observed, load={nid(1): 0.5}))) == [2]


def test_an_absurd_unobserved_claim_is_capped_by_what_peers_were_seen_to_do() -> None:
    honest, liar = Spec(1, (0, 8), decode=247.0), Spec(2, (0, 8), decode=LIAR_CLAIM)
    cov = coverage([honest, liar])
    # Nothing observed: nothing to cap by, so the liar wins the route that observes it.
    assert claim_ceiling(cov, inputs()) == math.inf
    assert ids(find_route(cov, inputs())) == [2]
    # The honest node observed at 5 ms: 8 layers / 5 ms = 1600 layers/s.
    seen = inputs(observed_step_s={nid(1): 0.005})
    assert claim_ceiling(cov, seen) == pytest.approx(CLAIM_CEILING_FACTOR * 1600)
    nodes = {n.node_id: n for n in cov.nodes}
    capped = hop_cost_s(nodes[nid(2)], 8, seen, claim_ceiling(cov, seen))
    assert capped - 2 * DEFAULT_HOP_LATENCY_S == pytest.approx(0.005 / CLAIM_CEILING_FACTOR)


def test_a_newcomer_slower_on_paper_is_tried_once_then_priced_by_what_it_did() -> None:
    """Its doctor claims a third of the observed node's rate: unobserved, it
    is hoped to be `NEWCOMER_SPEEDUP` times faster and gets the route that
    measures it; observed as slow as it said, it is not chosen again."""
    cov = coverage([Spec(1, (0, 8)), Spec(2, (0, 8), decode=66.0)])
    seen = inputs(observed_step_s={nid(1): 0.005})
    assert ids(find_route(cov, seen)) == [2]
    nodes = {n.node_id: n for n in cov.nodes}
    hoped = hop_cost_s(nodes[nid(2)], 8, seen, claim_ceiling(cov, seen))
    assert hoped - 2 * DEFAULT_HOP_LATENCY_S == pytest.approx(0.005 / NEWCOMER_SPEEDUP)
    both = inputs(observed_step_s={nid(1): 0.005, nid(2): 1 / 66.0})
    assert ids(find_route(cov, both)) == [1]
    # A node that reports no rate is not hoped for: it stays a last resort.
    silent = coverage([Spec(1, (0, 8)), Spec(2, (0, 8), decode=0.0)])
    assert ids(find_route(silent, seen)) == [1]


def test_the_ceiling_is_per_layer() -> None:
    """A one-layer node observed at 1 ms runs 1000 layers/s: a whole-model
    claim is held to 100x that, i.e. 8 layers in 80 us."""
    cov = coverage(
        [Spec(1, (0, 1)), Spec(2, (1, 8)), Spec(3, (0, 8), decode=LIAR_CLAIM)], num_layers=8
    )
    seen = inputs(observed_step_s={nid(1): 0.001})
    ceiling = claim_ceiling(cov, seen)
    assert ceiling == pytest.approx(CLAIM_CEILING_FACTOR * 1000)
    nodes = {n.node_id: n for n in cov.nodes}
    cost = hop_cost_s(nodes[nid(3)], 8, seen, ceiling) - 2 * DEFAULT_HOP_LATENCY_S
    assert cost == pytest.approx(8 / ceiling)


def test_a_node_caught_overclaiming_is_a_last_resort() -> None:
    honest, liar = Spec(1, (0, 8), decode=247.0), Spec(2, (0, 8), decode=LIAR_CLAIM)
    cov = coverage([honest, liar])
    # Both observed, the liar even a little faster: it is still not chosen.
    seen = inputs(observed_step_s={nid(1): 0.005, nid(2): 0.004})
    nodes = {n.node_id: n for n in cov.nodes}
    assert overclaims(nodes[nid(2)], seen) and not overclaims(nodes[nid(1)], seen)
    assert ids(find_route(cov, seen)) == [1]
    route = find_route(cov, inputs(observed_step_s={nid(2): 0.004}, avoid={nid(1)}))
    assert ids(route) == [2]
    assert isinstance(route, Route)
    assert route.cost_s == pytest.approx(0.004 + 2 * DEFAULT_HOP_LATENCY_S + OVERCLAIM_PENALTY_S)
    # Its own observation does not raise the ceiling for others.
    assert claim_ceiling(cov, inputs(observed_step_s={nid(2): 0.004})) == math.inf


def test_an_honest_claim_within_the_factor_is_not_penalised() -> None:
    cov = coverage([Spec(1, (0, 8), decode=1000.0)])
    # Seen 50 times slower than it claims (a loaded node on a WAN): believed, not penalised.
    seen = inputs(observed_step_s={nid(1): 0.05})
    route = find_route(cov, seen)
    assert isinstance(route, Route)
    assert route.cost_s == pytest.approx(0.05 + 2 * DEFAULT_HOP_LATENCY_S)


def test_a_newcomer_much_faster_than_observed_peers_still_gets_tried() -> None:
    """Ten times the observed rate is well within the ceiling: a GPU joining
    CPU nodes wins the route that gets it observed."""
    cov = coverage([Spec(1, (0, 8), decode=100.0), Spec(2, (0, 8), decode=1000.0)])
    assert ids(find_route(cov, inputs(observed_step_s={nid(1): 0.01}))) == [2]


# --- no route ---------------------------------------------------------------


def test_gap_is_reported() -> None:
    cov = coverage([Spec(1, (0, 3)), Spec(3, (6, 8))])
    result = find_route(cov, inputs())
    assert isinstance(result, NoRoute)
    assert result.reason == "gap"
    assert "[3, 6)" in result.message


def test_complete_but_misaligned_coverage_has_no_route() -> None:
    cov = coverage([Spec(1, (0, 5)), Spec(2, (3, 8))])
    assert cov.complete
    result = find_route(cov, inputs())
    assert isinstance(result, NoRoute) and result.reason == "misaligned"


def test_avoided_nodes_make_the_model_unavailable() -> None:
    cov = coverage([Spec(1, (0, 4)), Spec(2, (4, 8))])
    result = find_route(cov, inputs(avoid={nid(2)}))
    assert isinstance(result, NoRoute) and result.reason == "unavailable"


def test_failed_or_expired_doctor_is_never_on_a_route() -> None:
    """A node that would corrupt outputs (its doctor failed) or whose report
    expired is cheaper than the honest one, and still never chosen."""
    cov = coverage(
        [
            Spec(1, (0, 8), decode=10_000.0, result="failed"),
            Spec(2, (0, 8), decode=10_000.0, expires_at=NOW - 1),
            Spec(3, (0, 8), decode=1.0),
        ]
    )
    assert ids(find_route(cov, inputs())) == [3]
    corrupt_only = coverage([Spec(1, (0, 8), result="failed")])
    result = find_route(corrupt_only, inputs())
    assert isinstance(result, NoRoute) and result.reason == "gap"


# --- failover ---------------------------------------------------------------


def test_reroute_replaces_only_the_failed_span() -> None:
    cov = coverage(
        [
            Spec(1, (0, 3)),
            Spec(2, (3, 6)),
            Spec(3, (6, 8)),
            Spec(4, (3, 6), decode=50.0),
            # A cheaper full chain that would replace every hop.
            Spec(5, (0, 8), decode=1000.0),
        ]
    )
    # The route taken before node 5 joined.
    first = Route(
        (RouteHop(nid(1), (0, 3)), RouteHop(nid(2), (3, 6)), RouteHop(nid(3), (6, 8))), 0.0
    )
    after = reroute(cov, first, {nid(2)}, inputs())
    assert ids(after) == [1, 4, 3]
    assert isinstance(after, Route)
    assert after.cost_s == pytest.approx(0.01 + 0.02 + 0.01 + 4 * DEFAULT_HOP_LATENCY_S)


def test_reroute_may_split_a_span_over_several_nodes() -> None:
    cov = coverage([Spec(1, (0, 4)), Spec(2, (4, 8)), Spec(3, (4, 6)), Spec(4, (6, 8))])
    first = find_route(cov, inputs())
    assert isinstance(first, Route) and ids(first) == [1, 2]
    assert ids(reroute(cov, first, {nid(2)}, inputs())) == [1, 3, 4]


def test_reroute_falls_back_to_a_whole_new_route() -> None:
    cov = coverage([Spec(1, (0, 4)), Spec(2, (4, 8)), Spec(3, (0, 2)), Spec(4, (2, 8))])
    first = find_route(cov, inputs())
    assert isinstance(first, Route) and ids(first) == [1, 2]
    assert ids(reroute(cov, first, {nid(2)}, inputs())) == [3, 4]


def test_reroute_replaces_hops_that_left_coverage() -> None:
    before = coverage([Spec(1, (0, 4)), Spec(2, (4, 8)), Spec(3, (0, 4), decode=50.0)])
    first = find_route(before, inputs())
    assert isinstance(first, Route) and ids(first) == [1, 2]
    after = coverage([Spec(2, (4, 8)), Spec(3, (0, 4), decode=50.0)])
    assert ids(reroute(after, first, set(), inputs())) == [3, 2]


def test_reroute_with_no_alternative_says_why() -> None:
    cov = coverage([Spec(1, (0, 4)), Spec(2, (4, 8))])
    first = find_route(cov, inputs())
    assert isinstance(first, Route)
    result = reroute(cov, first, {nid(1)}, inputs())
    assert isinstance(result, NoRoute) and result.reason == "unavailable"


# --- properties against brute force -----------------------------------------

# Dyadic numbers only, so every sum is exact in floating point and ties are
# real ties: the tie-break can then be checked exactly.
THROUGHPUTS = st.sampled_from([1.0, 2.0, 4.0, 8.0])
LATENCIES = st.sampled_from([0.0, 0.25, 0.5, 1.0])
LOADS = st.sampled_from([0.0, 0.5, 0.75, 1.0])
STEPS = st.sampled_from([0.0, 0.125, 0.5, 2.0])
"""Observed step times: with claims of at most 8 tokens/s none is capped or
caught overclaiming (that needs a 100-fold gap), so costs stay dyadic."""


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[ModelCoverage, RouteInputs]:
    num_layers = draw(st.integers(1, 6))
    count = draw(st.integers(0, 7))
    specs = []
    for index in range(1, count + 1):
        start = draw(st.integers(0, num_layers - 1))
        end = draw(st.integers(start + 1, num_layers))
        state = draw(st.sampled_from(["alive", "alive", "suspect"]))
        specs.append(Spec(index, (start, end), decode=draw(THROUGHPUTS), state=state))
    all_ids = [nid(s.index) for s in specs]
    if not specs:
        return coverage([Spec(99, (0, num_layers), result="failed")], num_layers), inputs()
    subset = st.sets(st.sampled_from(all_ids), max_size=2)
    observed = draw(st.sets(st.sampled_from(all_ids)))
    route_inputs = RouteInputs(
        entry=draw(st.sampled_from([ENTRY, *all_ids])),
        latency_s={node_id: draw(LATENCIES) for node_id in all_ids},
        load={node_id: draw(LOADS) for node_id in all_ids},
        busy=draw(subset),
        avoid=draw(subset),
        observed_step_s={node_id: draw(STEPS) for node_id in sorted(observed)},
        peer_rtt_s={a: {b: draw(LATENCIES) for b in draw(subset)} for a in draw(subset)},
        relayed=draw(subset),
    )
    return coverage(specs, num_layers), route_inputs


def tilings(
    nodes: Sequence[ServingNode], start: int, end: int
) -> Iterator[tuple[ServingNode, ...]]:
    if start == end:
        yield ()
        return
    for node in nodes:
        if node.layers[0] == start:
            for rest in tilings(nodes, node.layers[1], end):
                yield (node, *rest)


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_route_is_the_cheapest_tiling(scenario: tuple[ModelCoverage, RouteInputs]) -> None:
    cov, route_inputs = scenario
    allowed = [n for n in cov.nodes if not route_inputs.excludes(n.node_id)]
    ceiling = claim_ceiling(cov, route_inputs)
    options = [
        (chain_cost_s(tiling, cov.num_layers, route_inputs, ceiling), tiling)
        for tiling in tilings(allowed, 0, cov.num_layers)
    ]
    result = find_route(cov, route_inputs)
    if not options:
        assert isinstance(result, NoRoute)
        any_tiling = next(tilings(cov.nodes, 0, cov.num_layers), None) is not None
        assert (result.reason == "unavailable") == any_tiling
        return
    assert isinstance(result, Route)
    assert_tiles(result, cov.num_layers)
    used = set(result.node_ids)
    assert used <= {n.node_id for n in allowed}
    assert not used & set(route_inputs.avoid)
    best_cost, best_tiling = min(options, key=lambda o: (o[0], [n.node_id for n in o[1]]))
    assert result.cost_s == best_cost
    assert result.node_ids == tuple(n.node_id for n in best_tiling)
    assert result.hops == tuple(RouteHop(n.node_id, n.layers) for n in best_tiling)


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.data())
def test_reroute_avoids_the_failed_and_still_tiles(
    scenario: tuple[ModelCoverage, RouteInputs], data: st.DataObject
) -> None:
    cov, route_inputs = scenario
    first = find_route(cov, route_inputs)
    if not isinstance(first, Route):
        return
    failed = data.draw(st.sets(st.sampled_from(first.node_ids), min_size=1))
    result = reroute(cov, first, failed, route_inputs)
    if isinstance(result, NoRoute):
        stricter = RouteInputs(
            entry=route_inputs.entry,
            latency_s=route_inputs.latency_s,
            load=route_inputs.load,
            busy=route_inputs.busy,
            avoid=set(route_inputs.avoid) | failed,
            observed_step_s=route_inputs.observed_step_s,
        )
        assert isinstance(find_route(cov, stricter), NoRoute)
        return
    assert_tiles(result, cov.num_layers)
    assert not set(result.node_ids) & (failed | set(route_inputs.avoid))
    nodes = {n.node_id: n for n in cov.nodes}
    ceiling = claim_ceiling(cov, route_inputs)
    chain = [nodes[i] for i in result.node_ids]
    assert result.cost_s == pytest.approx(
        chain_cost_s(chain, cov.num_layers, route_inputs, ceiling)
    )


@settings(max_examples=200, deadline=None)
@given(
    claim=st.floats(0, 1e15, allow_nan=False),
    span=st.integers(1, 8),
    peer_span=st.integers(1, 8),
    peer_step=st.floats(1e-6, 10, allow_nan=False),
)
def test_no_claim_buys_more_than_the_ceiling(
    claim: float, span: int, peer_span: int, peer_step: float
) -> None:
    """Whatever an unobserved node claims, its step is priced at no less than
    its layers at `CLAIM_CEILING_FACTOR` times the fastest observed rate."""
    peer = Spec(2, (0, peer_span), decode=1 / peer_step)  # an honest claim
    cov = coverage([Spec(1, (0, span), decode=claim), peer])
    seen = inputs(entry=nid(1), observed_step_s={nid(2): peer_step})
    nodes = {n.node_id: n for n in cov.nodes}
    cost = hop_cost_s(nodes[nid(1)], 8, seen, claim_ceiling(cov, seen))
    floor = span * peer_step / peer_span / CLAIM_CEILING_FACTOR
    assert cost >= floor * (1 - 1e-12)


# --- back-off ---------------------------------------------------------------


def test_backoff_grows_caps_and_expires() -> None:
    backoff = Backoff()
    assert backoff.avoided(0.0) == frozenset()
    assert backoff.record_failure(nid(1), 100.0) == 100.0 + BACKOFF_BASE_S
    assert backoff.avoided(100.0 + BACKOFF_BASE_S - 0.001) == {nid(1)}
    assert backoff.avoided(100.0 + BACKOFF_BASE_S) == frozenset()
    # Failing again soon after doubles the period, up to the cap.
    periods = []
    now = 110.0
    for _ in range(12):
        periods.append(backoff.record_failure(nid(1), now) - now)
        now += 1.0
    assert periods[:3] == [2 * BACKOFF_BASE_S, 4 * BACKOFF_BASE_S, 8 * BACKOFF_BASE_S]
    assert max(periods) == BACKOFF_CAP_S
    assert periods[-1] == BACKOFF_CAP_S


def test_backoff_is_per_node_and_forgets() -> None:
    backoff = Backoff(base_s=1.0, cap_s=10.0)
    backoff.record_failure(nid(1), 0.0)
    backoff.record_failure(nid(1), 0.5)  # until 2.5
    backoff.record_failure(nid(2), 0.5)  # until 1.5
    assert backoff.avoided(1.0) == {nid(1), nid(2)}
    assert backoff.avoided(2.0) == {nid(1)}
    # Quiet for a whole cap after its back-off ended: starts again at base.
    assert backoff.record_failure(nid(1), 13.0) == 14.0
    # A success resets the count too.
    backoff.record_failure(nid(1), 14.0)
    backoff.record_success(nid(1))
    assert backoff.record_failure(nid(1), 15.0) == 16.0


def test_backoff_feeds_route_avoidance() -> None:
    cov = coverage([Spec(1, (0, 8)), Spec(2, (0, 8), decode=50.0)])
    backoff = Backoff()
    backoff.record_failure(nid(1), 0.0)
    assert ids(find_route(cov, inputs(avoid=backoff.avoided(1.0)))) == [2]
    assert ids(find_route(cov, inputs(avoid=backoff.avoided(BACKOFF_BASE_S)))) == [1]


def test_backoff_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        Backoff(base_s=0.0)
    with pytest.raises(ValueError):
        Backoff(base_s=10.0, cap_s=1.0)
