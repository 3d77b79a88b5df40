"""How a placement simulation's entries route: their own latencies, the
coverage they route over (truth or their own SWIM view, quarantine left
out), and rerouting around a hop that turns out to be down."""

from __future__ import annotations

from consensus.placement import ModelFacts
from mesh.config import MembershipConfig
from mesh.records import Assignment
from simulations.loop import EventLoop
from simulations.placement_membership import Membership
from simulations.placement_routing import ENTRIES, ENTRY_LATENCY_S, Entry, Routing, entry_node
from simulations.placement_trace import Trace
from simulations.placement_workers import GB, Fleet, WorkerSpec

MODELS = {"y": ModelFacts(32, GB // 2)}
SHARD = Assignment("y", (0, 32), "bf16", "managed", True, 1)


class Setup:
    """Two workers, three voters, the entries; quarantine set by hand."""

    def __init__(self, seed: int = 1, *, swim: bool = False) -> None:
        self.loop = EventLoop()
        self.fleet = Fleet([WorkerSpec(24, ("y",)) for _ in range(2)], MODELS, Trace(self.loop))
        config = MembershipConfig.lan() if swim else None
        self.membership = Membership(seed, self.fleet, 3, ENTRIES, self.loop, config=config)
        self.quarantined: dict[bytes, object] = {}
        self.routing = Routing(
            seed, self.fleet, self.membership, MODELS, self.loop,
            quarantined=lambda: self.quarantined,  # type: ignore[arg-type,return-value]
        )  # fmt: skip

    def serve(self, *workers: int) -> None:
        for index in workers:
            worker = self.fleet.workers[index]
            worker.serving, worker.verdict, worker.ready_at = SHARD, "admitted", self.loop.now


def test_each_entry_has_its_own_latency_to_each_worker_from_the_seed() -> None:
    one, again, other = Setup(1), Setup(1), Setup(2)
    entries = one.routing.entries
    assert [e.node for e in entries] == [entry_node(i) for i in range(ENTRIES)]
    low, high = ENTRY_LATENCY_S
    assert all(low <= s <= high for e in entries for s in e.latency_s.values())
    assert [e.latency_s for e in entries] == [e.latency_s for e in again.routing.entries]
    assert [e.latency_s for e in entries] != [e.latency_s for e in other.routing.entries]
    assert all(e.member is None for e in entries)  # the oracle


def test_an_entry_avoids_the_nodes_its_checks_caught_until_their_time() -> None:
    entry = Entry(entry_node(0), {}, distrusted={b"a": 10.0, b"b": 5.0})
    assert entry.inputs(4.0).avoid == {b"a", b"b"}
    assert entry.inputs(5.0).avoid == {b"a"}


def test_a_model_is_servable_once_an_admitted_worker_serves_every_layer() -> None:
    setup = Setup()
    assert not setup.routing.servable("y")
    setup.fleet.workers[0].serving = SHARD  # loading: no report yet
    assert not setup.routing.servable("y")
    setup.serve(0)
    assert setup.routing.servable("y")
    setup.fleet.crash(0, now=0.0)
    assert not setup.routing.servable("y")


def test_coverage_is_rebuilt_only_when_a_worker_or_the_quarantine_changes() -> None:
    setup = Setup()
    setup.serve(0, 1)
    first = setup.routing.coverage()
    assert setup.routing.coverage() is first
    setup.quarantined[setup.fleet.workers[0].node] = object()
    second = setup.routing.coverage()
    assert second is not first
    assert second.excluded[setup.fleet.workers[0].node] == "quarantined"
    route = setup.routing.route("y", setup.routing.entries[0].inputs(0.0))
    assert route is not None and route.node_ids == (setup.fleet.workers[1].node,)


def test_under_swim_an_entry_routes_by_its_own_view_and_around_a_crashed_hop() -> None:
    setup = Setup(swim=True)
    setup.serve(0, 1)
    entry = setup.routing.entries[0]
    assert entry.member == 3 + 2  # voters, then workers, then the entries
    inputs = entry.inputs(0.0)
    first = setup.routing.route("y", inputs, entry.member)
    assert first is not None
    (hop,) = first.node_ids
    crashed = setup.fleet.index[hop]
    worker = setup.fleet.workers[crashed]
    worker.gossiped = setup.fleet.record(worker)
    setup.fleet.crash(crashed, now=0.0)
    # Its own core still holds the worker alive and routes by its last record...
    assert setup.routing.route("y", inputs, entry.member) == first
    # ...until the chain fails on it and the entry routes around it.
    rerouted = setup.routing.reroute("y", entry, inputs, first)
    assert rerouted is not None and rerouted.node_ids != first.node_ids
    assert setup.routing.rerouted == 1
    assert setup.routing.coverage().best("y") is not None  # the truth: the other worker


def test_a_working_chain_is_not_rerouted() -> None:
    setup = Setup(swim=True)
    setup.serve(0, 1)
    entry = setup.routing.entries[0]
    inputs = entry.inputs(0.0)
    route = setup.routing.route("y", inputs, entry.member)
    assert route is not None
    assert setup.routing.reroute("y", entry, inputs, route) == route
    assert setup.routing.rerouted == 0
