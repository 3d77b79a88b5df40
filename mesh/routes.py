"""Route finding: the cheapest chain of nodes that together run every layer.

A request for a model of L layers needs hops whose spans tile `[0, L)`
exactly (a node runs its whole span, so `[0, 3)` and `[2, 5)` cover `[0, 5)`
but do not tile it). Boundaries `0..L` are vertices and each serving node an
edge `s -> e` weighted by what it adds to a decode step (`hop_cost_s`); the
graph is a DAG, so relaxing boundaries in order finds the cheapest chain in
O(nodes + L). A hop's compute is priced by what this entry observed
(`mesh.observed_speed`); an unobserved node's claim only up to a ceiling,
and a node caught overclaiming pays a penalty. Ties go to the smallest node
ids, so entries with one view pick one chain. Sans-IO.

Why, and each input: docs/design/routes.md#route-finding.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from mesh.coverage import ModelCoverage, ServingNode
from mesh.identity import node_id_text
from mesh.member_table import MemberState

DEFAULT_HOP_LATENCY_S = 0.05
"""One-way latency assumed for a node the membership probes have not yet
measured (it just joined). About half an intercontinental round trip: a
measured node is preferred unless it is worse than that, while an unprobed
newcomer is not shut out the way an infinite default would shut it out,
nor preferred over everyone the way a zero default would prefer it."""

MIN_DECODE_TOKENS_PER_S = 1.0
"""Throughput floor. Capability reports allow 0 (measurement missing); a
node reporting it is costed as running one token per second, so it is used
only when nothing measured covers its span, instead of dividing by zero."""

SUSPECT_PENALTY_S = 0.5
"""Added to each hop through a `suspect` member. Suspects stay in coverage
(most suspicions are refuted within a probe round), but a suspect may be
dead, and a dead hop costs a failover and a replay of the whole history.
Half a second per decode step is more than any interactive route costs, so a
suspect is chosen only when every alternative without it is slower than chat
can tolerate anyway, or there is no alternative."""

CLAIM_CEILING_FACTOR = 100.0
"""How far a claimed decode rate may exceed what was observed before it is
not believed. A doctor measures its span's decode rate alone on the node;
serving adds queueing among sessions and the share of network time the
entry cannot explain (`mesh.observed_speed`), which on a WAN chain can make
a node's observed rate ten times lower than its honest claim, rarely more.
A hundredfold gap is beyond what those explain, so:
- an unobserved node's claim is capped at this factor times the fastest
  rate per layer (layers x steps per second) observed among the credible
  nodes of its coverage; that still lets a much faster newcomer (a GPU
  joining CPU nodes) win the route that gets it observed;
- a node whose claim is above this factor times its own observed rate is
  caught overclaiming (see `OVERCLAIM_PENALTY_S`). The claim that carried
  all the traffic in issue 18 was nine orders of magnitude off."""

OVERCLAIM_PENALTY_S = 0.5
"""Added to each hop through a node caught overclaiming (above). Its claim
is already ignored for its observation; the penalty is because its other
self-reports are not to be trusted either: the compute times it reports
per step decide how a chain's unexplained time is split (an under-reporting
hop is charged only its share), and a node that signs a rate it cannot come
near may also sign whatever it likes there. Like `SUSPECT_PENALTY_S`, half a
second per step makes it a last resort: used only when every alternative is
slower than chat can tolerate, or there is none. It lasts as long as the
claim does: a node that republishes an honest report is priced afresh."""

NoRouteReason = Literal["gap", "misaligned", "unavailable"]
"""Why no route exists:
- `gap`: some layer has no serving node at all (placement must fill it);
- `misaligned`: every layer is served, but the spans do not tile `[0, L)`
  (placement must add a node on the right boundaries);
- `unavailable`: a tiling exists, but each one passes through a node that is
  avoided (back-off), busy or full; retrying later can succeed."""


@dataclass(frozen=True, slots=True)
class RouteHop:
    """One node of a chain and the layers it runs, `[start, end)`."""

    node_id: bytes
    layers: tuple[int, int]


@dataclass(frozen=True, slots=True)
class Route:
    """A chain whose hops tile `[0, L)`, and its estimated decode-step time.

    `cost_s` is an estimate for ranking routes (latency + compute + load and
    suspicion penalties), not a promise of wall time.
    """

    hops: tuple[RouteHop, ...]
    cost_s: float

    @property
    def node_ids(self) -> tuple[bytes, ...]:
        return tuple(hop.node_id for hop in self.hops)


@dataclass(frozen=True, slots=True)
class NoRoute:
    """No chain exists now; `reason` tells the caller what would fix it."""

    reason: NoRouteReason
    message: str


@dataclass(frozen=True, slots=True)
class RouteInputs:
    """Everything besides coverage that prices or excludes a node.

    - `entry`: the node that took the request. Its own hop has no network
      latency; every other hop is charged the entry's estimate of its
      one-way latency for the activation coming in, and the last hop is
      charged it once more for returning the token. (The entry measures only
      its own links; hop-to-hop latency is approximated by the entry's
      latency to the receiving hop.)
    - `latency_s`: node id -> one-way latency estimate in seconds (half the
      probe round trip); missing -> `DEFAULT_HOP_LATENCY_S`.
    - `load`: node id -> open sessions / session capacity; missing -> 0. At
      1 or more the node would answer busy, so it is excluded.
    - `busy`: nodes that answered busy recently; excluded.
    - `avoid`: nodes in back-off after failing (`Backoff.avoided`); excluded.
    - `observed_step_s`: node id -> seconds per decode step this entry
      observed through the node's span (`ObservedSpeeds.step_s`); a node
      there is priced by it instead of its claim.
    """

    entry: bytes
    latency_s: Mapping[bytes, float] = field(default_factory=dict)
    load: Mapping[bytes, float] = field(default_factory=dict)
    busy: Collection[bytes] = frozenset()
    avoid: Collection[bytes] = frozenset()
    observed_step_s: Mapping[bytes, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, values in (
            ("latency_s", self.latency_s),
            ("load", self.load),
            ("observed_step_s", self.observed_step_s),
        ):
            for node_id, value in values.items():
                if not math.isfinite(value) or value < 0:
                    raise ValueError(f"{name}[{node_id_text(node_id)}]={value!r} is not >= 0")

    def excludes(self, node_id: bytes) -> bool:
        """True when the node may not be on a route now."""
        return node_id in self.avoid or node_id in self.busy or self.load.get(node_id, 0.0) >= 1


def overclaims(node: ServingNode, inputs: RouteInputs) -> bool:
    """Whether the node claims a decode rate more than `CLAIM_CEILING_FACTOR`
    times what this entry observed it deliver."""
    observed = inputs.observed_step_s.get(node.node_id)
    return observed is not None and node.decode_tokens_per_s * observed > CLAIM_CEILING_FACTOR


def claim_ceiling(coverage: ModelCoverage, inputs: RouteInputs) -> float:
    """The fastest believable claim for `coverage`, in layers per second:
    `CLAIM_CEILING_FACTOR` times the fastest rate per layer observed among
    its nodes not caught overclaiming; infinite while none was observed."""
    fastest = 0.0
    for node in coverage.nodes:
        observed = inputs.observed_step_s.get(node.node_id)
        if observed is None or overclaims(node, inputs):
            continue
        layers = node.layers[1] - node.layers[0]
        fastest = max(fastest, layers / observed if observed > 0 else math.inf)
    return CLAIM_CEILING_FACTOR * fastest if fastest > 0 else math.inf


def hop_cost_s(
    node: ServingNode, num_layers: int, inputs: RouteInputs, ceiling_layers_per_s: float
) -> float:
    """What a hop through `node` adds to one decode step, in seconds.

    - Compute: what this entry observed a step through the node take, when
      it did (`inputs.observed_step_s`). Otherwise `1 / decode_tokens_per_s`,
      the rate the node's doctor measured for its own span (so it scales
      with the number of layers and the hardware), capped at
      `ceiling_layers_per_s` (`claim_ceiling` of the node's coverage)
      divided by the span's layers.
    - Load: compute is divided by `1 - load`. A node shares its accelerator
      among its sessions; at utilisation rho a queue's expected service time
      grows as 1/(1-rho) (M/M/1), so a half-full node costs double and a
      nearly full one approaches the exclusion at load 1 continuously.
    - Latency: the activation coming in, plus the token going back to the
      entry when the hop ends at the last layer; zero on the entry itself.
    - `SUSPECT_PENALTY_S` when the node is a suspect member, and
      `OVERCLAIM_PENALTY_S` when it is caught overclaiming (`overclaims`).

    Only defined for nodes `inputs` does not exclude (load below 1).
    """
    step = inputs.observed_step_s.get(node.node_id)
    if step is None:
        believable = ceiling_layers_per_s / (node.layers[1] - node.layers[0])
        step = 1.0 / max(min(node.decode_tokens_per_s, believable), MIN_DECODE_TOKENS_PER_S)
    cost = step / (1.0 - inputs.load.get(node.node_id, 0.0))
    if node.node_id != inputs.entry:
        latency = inputs.latency_s.get(node.node_id, DEFAULT_HOP_LATENCY_S)
        cost += latency * (2 if node.layers[1] == num_layers else 1)
    if node.state == MemberState.SUSPECT:
        cost += SUSPECT_PENALTY_S
    if overclaims(node, inputs):
        cost += OVERCLAIM_PENALTY_S
    return cost


def _cheapest(
    nodes: Iterable[ServingNode],
    start: int,
    end: int,
    num_layers: int,
    inputs: RouteInputs,
    ceiling: float,
) -> tuple[RouteHop, ...] | None:
    """The cheapest hops tiling `[start, end)`, ties to the smallest node ids."""
    by_start: dict[int, list[ServingNode]] = {}
    for node in nodes:
        if start <= node.layers[0] and node.layers[1] <= end:
            by_start.setdefault(node.layers[0], []).append(node)
    # best[b] = (cost, node ids, hops) of the best chain found from start to b.
    best: dict[int, tuple[float, tuple[bytes, ...], tuple[RouteHop, ...]]] = {start: (0.0, (), ())}
    for boundary in range(start, end):
        if boundary not in best:
            continue
        cost, ids, hops = best[boundary]
        for node in by_start.get(boundary, ()):
            candidate = (
                cost + hop_cost_s(node, num_layers, inputs, ceiling),
                (*ids, node.node_id),
                (*hops, RouteHop(node.node_id, node.layers)),
            )
            # Two chains to one boundary are never prefixes of each other, so
            # comparing (cost, ids) here keeps the lexicographic tie-break exact.
            known = best.get(node.layers[1])
            if known is None or candidate[:2] < known[:2]:
                best[node.layers[1]] = candidate
    return best[end][2] if end in best else None


def _tiles(nodes: Iterable[ServingNode], num_layers: int) -> bool:
    """Whether the spans of `nodes` can tile `[0, num_layers)` at all."""
    reachable = {0}
    for node in sorted(nodes, key=lambda node: node.layers):
        if node.layers[0] in reachable:
            reachable.add(node.layers[1])
    return num_layers in reachable


def find_route(coverage: ModelCoverage, inputs: RouteInputs) -> Route | NoRoute:
    """The cheapest chain over `[0, L)` through nodes `inputs` does not exclude."""
    length = coverage.num_layers
    allowed = [node for node in coverage.nodes if not inputs.excludes(node.node_id)]
    ceiling = claim_ceiling(coverage, inputs)
    hops = _cheapest(allowed, 0, length, length, inputs, ceiling) if length > 0 else None
    if hops is not None:
        return Route(hops, _route_cost(coverage, hops, inputs))
    if length <= 0:
        return NoRoute("gap", "the model has no layers to serve")
    if coverage.gaps:
        gaps = ", ".join(f"[{a}, {b})" for a, b in coverage.gaps)
        return NoRoute("gap", f"no admitted node serves layers {gaps}")
    if not _tiles(coverage.nodes, length):
        return NoRoute("misaligned", f"the served spans do not tile [0, {length})")
    return NoRoute("unavailable", "every chain passes through a busy, full or backed-off node")


def reroute(
    coverage: ModelCoverage, route: Route, failed: Collection[bytes], inputs: RouteInputs
) -> Route | NoRoute:
    """A route after the hops in `failed` broke, keeping the others if possible.

    Surviving hops keep their KV caches, so the cheapest failover replaces
    only each failed hop's span with a chain over exactly that span; then
    only the new hops need the history replayed. A hop that is no longer in
    `coverage` (its report expired) or is now excluded by `inputs` is
    replaced too. When some span cannot be re-tiled on its own boundaries,
    the whole route is searched again without the failed nodes (every hop
    then rebuilds its cache).
    """
    inputs = replace(inputs, avoid=frozenset(inputs.avoid) | frozenset(failed))
    length = coverage.num_layers
    allowed = {node.node_id: node for node in coverage.nodes if not inputs.excludes(node.node_id)}
    ceiling = claim_ceiling(coverage, inputs)
    patched: list[RouteHop] = []
    for hop in route.hops:
        node = allowed.get(hop.node_id)
        if node is not None and node.layers == hop.layers:
            patched.append(hop)
            continue
        replacement = _cheapest(
            allowed.values(), hop.layers[0], hop.layers[1], length, inputs, ceiling
        )
        if replacement is None:
            return find_route(coverage, inputs)
        patched.extend(replacement)
    hops = tuple(patched)
    return Route(hops, _route_cost(coverage, hops, inputs))


def _route_cost(coverage: ModelCoverage, hops: tuple[RouteHop, ...], inputs: RouteInputs) -> float:
    nodes = {node.node_id: node for node in coverage.nodes}
    ceiling = claim_ceiling(coverage, inputs)
    return sum(hop_cost_s(nodes[hop.node_id], coverage.num_layers, inputs, ceiling) for hop in hops)


BACKOFF_BASE_S = 5.0
"""First back-off after a peer fails. It covers the seconds SWIM needs to
suspect and declare a crashed node dead (after which coverage drops it
anyway), so failovers and the next requests do not walk into the same dead
node; a peer that merely dropped one connection is back after 5 s."""

BACKOFF_CAP_S = 300.0
"""Longest back-off. Each further failure doubles the period up to this cap:
a flapping volunteer (sleeping laptop, saturated uplink) is tried at most
every five minutes, and one that recovers is not shut out for long."""


@dataclass(slots=True)
class Backoff:
    """Per-peer exponential back-off kept by an entry node. Pure: `now` is passed.

    A peer that stays out of trouble for `cap_s` after its back-off ended
    starts afresh on its next failure, and so does one that served a
    session (`record_success`).
    """

    base_s: float = BACKOFF_BASE_S
    cap_s: float = BACKOFF_CAP_S
    _failures: dict[bytes, tuple[int, float]] = field(default_factory=dict)
    """node id -> (consecutive failures, end of its back-off)."""

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError("back-off needs 0 < base_s <= cap_s")

    def record_failure(self, node_id: bytes, now: float) -> float:
        """Start or lengthen the node's back-off; returns when it ends."""
        self._failures = {
            peer: entry for peer, entry in self._failures.items() if entry[1] + self.cap_s > now
        }
        count = self._failures.get(node_id, (0, now))[0] + 1
        until = now + min(self.cap_s, self.base_s * 2 ** min(count - 1, 64))
        self._failures[node_id] = (count, until)
        return until

    def record_success(self, node_id: bytes) -> None:
        """The node served: its next failure starts from the base period."""
        self._failures.pop(node_id, None)

    def avoided(self, now: float) -> frozenset[bytes]:
        """Nodes still in back-off at `now`: pass them as `RouteInputs.avoid`."""
        return frozenset(peer for peer, (_, until) in self._failures.items() if until > now)
