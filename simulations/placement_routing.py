"""How a placement simulation's entries route chat requests over the workers.

Requests arrive at `ENTRIES` entry nodes, members that serve no shard, each
with its own latency to every worker, so entries route differently, as a
real swarm's do. An entry routes (`mesh.routes.find_route`) over the
coverage map (`mesh.coverage.build_coverage`) of the workers' records,
less the nodes the ledger holds quarantined: the truth under the oracle,
its own core's view under SWIM, where a chain that meets a crashed or
unreachable hop is routed around it. See docs/simulation.md, "Liars and
spot checks" and "Placement over real membership".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Final

from consensus.placement import ModelFacts
from consensus.quarantine import Quarantine
from mesh.coverage import CoverageMap, build_coverage
from mesh.member_table import MemberState
from mesh.routes import Route, RouteInputs, find_route
from simulations.loop import EventLoop
from simulations.placement_membership import Membership
from simulations.placement_workers import Fleet
from simulations.seeds import component_rng

__all__ = ["ENTRIES", "ENTRY_LATENCY_S", "Entry", "Routing", "entry_node"]

ENTRIES: Final = 16
"""Entry nodes the requests arrive at, uniformly. Routes tie-break to the
smallest node ids, so entries that agreed on every latency would all use
one chain; their own latencies (`ENTRY_LATENCY_S`) spread the traffic over
the replicas as clients spread over a real swarm. Sixteen make a worker
that no entry routes through rare: (1 - 1/replicas)**16, 1% at 4 replicas."""
ENTRY_LATENCY_S: Final = (0.005, 0.08)
"""One-way latency from an entry to a worker, uniform in this range per
(entry, worker): a volunteer swarm across a continent, next door to 80 ms."""


@dataclass
class Entry:
    """An entry node: its latency to each worker, and the nodes its own
    checks caught, avoided until a time."""

    node: bytes
    latency_s: dict[bytes, float]
    distrusted: dict[bytes, float] = field(default_factory=dict)
    member: int | None = None
    """Its SWIM member index, whose own view it routes by; None: the oracle."""

    def inputs(self, now: float) -> RouteInputs:
        avoid = frozenset(node for node, until in self.distrusted.items() if until > now)
        return RouteInputs(self.node, latency_s=self.latency_s, avoid=avoid)


def entry_node(index: int) -> bytes:
    """Entry `index`'s node id: 0xEE, then the index, 32 bytes in all."""
    return bytes([0xEE, *index.to_bytes(31, "big")])


class Routing:
    """The entries, and the coverage each routes over."""

    def __init__(
        self,
        seed: int,
        fleet: Fleet,
        membership: Membership,
        models: Mapping[str, ModelFacts],
        loop: EventLoop,
        quarantined: Callable[[], Mapping[bytes, Quarantine]],
    ) -> None:
        self._fleet, self._membership, self._loop = fleet, membership, loop
        self._lengths = {name: facts.num_layers for name, facts in models.items()}
        self._quarantined = quarantined
        latencies = component_rng(seed, "placement", "entries")
        self.entries = [
            Entry(
                entry_node(i),
                {w.node: latencies.uniform(*ENTRY_LATENCY_S) for w in fleet.workers},
                member=membership.entry_member(i),
            )
            for i in range(ENTRIES)
        ]
        self._coverage: tuple[object, CoverageMap] | None = None
        self._seen_coverage: dict[int, tuple[object, CoverageMap]] = {}
        """SWIM: each observer's coverage, as `_coverage` is the truth's."""
        self.rerouted = 0
        """SWIM: requests whose first chain hit a worker down or cut off
        from their entry, and were routed around it."""

    def servable(self, model: str) -> bool:
        """A route over every layer of `model` exists through admitted
        shards of live workers the ledger does not hold quarantined (live
        in truth, whatever any member believes)."""
        return self.route(model, RouteInputs(self.entries[0].node)) is not None

    def route(self, model: str, inputs: RouteInputs, observer: int | None = None) -> Route | None:
        """The route an entry with `inputs` takes (`mesh.routes`) over the
        coverage of `observer`'s view (`coverage`), or None."""
        variant = self.coverage(observer).best(model)
        found = None if variant is None else find_route(variant, inputs)
        return found if isinstance(found, Route) else None

    def coverage(self, observer: int | None = None) -> CoverageMap:
        """What the entries route over (`mesh.coverage`): each worker's record,
        less the nodes the ledger holds quarantined now. Rebuilt only when a
        worker's state or the quarantined set changed. `observer`: the SWIM
        member whose own view says who is alive, as a runtime node builds it
        from its membership (`runtime.node.swarm_view`); None: the truth,
        which is what the oracle's entries see."""
        if observer is not None:
            return self._coverage_seen_by(observer)
        quarantined = frozenset(self._quarantined())
        workers = self._fleet.workers
        key = (quarantined, tuple((w.alive, w.serving, w.verdict) for w in workers))
        if self._coverage is None or self._coverage[0] != key:
            members = [
                (w.node, MemberState.ALIVE if w.alive else MemberState.DEAD, self._fleet.record(w))
                for w in workers
            ]
            now = self._loop.now
            built = build_coverage(members, now, self._lengths, quarantined=quarantined)
            self._coverage = (key, built)
        return self._coverage[1]

    def _coverage_seen_by(self, observer: int) -> CoverageMap:
        """`coverage` by SWIM member `observer`'s view: a worker it holds
        live serves by its record (a crashed one's last, `gossiped`)."""
        quarantined = frozenset(self._quarantined())
        workers = self._fleet.workers
        states = tuple(self._membership.member_view(observer, w)[0] for w in workers)
        said = tuple((w.alive, w.serving, w.verdict, w.gossiped) for w in workers)
        key = (quarantined, states, said)
        cached = self._seen_coverage.get(observer)
        if cached is None or cached[0] != key:
            members = [
                (w.node, state, self._fleet.record(w) if w.alive else w.gossiped)
                for w, state in zip(workers, states, strict=True)
            ]
            now = self._loop.now
            built = build_coverage(members, now, self._lengths, quarantined=quarantined)
            cached = (key, built)
            self._seen_coverage[observer] = cached
        return cached[1]

    def reroute(self, model: str, entry: Entry, inputs: RouteInputs, route: Route) -> Route | None:
        """SWIM: the entry's view may still hold a crashed or cut-off worker
        alive. Its chain then fails on that hop and the entry routes around
        it (`runtime.inference.chat`'s reroute: the hop backed off, the
        tokens so far replayed on the new chain), until a chain works or
        none is left; the request counts as `rerouted`."""
        avoid = set(inputs.avoid)
        found: Route | None = route
        while found is not None:
            broken = self._unusable(entry, found)
            if not broken:
                break
            avoid |= broken
            found = self.route(model, replace(inputs, avoid=frozenset(avoid)), entry.member)
        if avoid != set(inputs.avoid):
            self.rerouted += 1
        return found

    def _unusable(self, entry: Entry, route: Route) -> set[bytes]:
        """Hops of `route` that fail the entry's chain: crashed, or across a
        partition from the entry, which opens a session on every hop and
        gets the token back from the last (`runtime.inference.chain`); each
        side of a placement partition is whole, so hops the entry reaches
        reach each other."""
        swim = self._membership.swim
        assert swim is not None and entry.member is not None
        network, at, members = swim.network, entry.member, self._membership.members
        return {
            node
            for node in route.node_ids
            if not self._fleet.workers[self._fleet.index[node]].alive
            or not network.can_reach(at, members[node])
            or not network.can_reach(members[node], at)
        }
