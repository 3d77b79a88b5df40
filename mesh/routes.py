"""Route finding: the cheapest chain of nodes that together run every layer.

A request for a model of L layers needs hops whose spans tile `[0, L)`
exactly (a node runs its whole span, so `[0, 3)` and `[2, 5)` cover `[0, 5)`
but do not tile it). Each serving node is a step `s -> e` weighted by what it
adds to a decode step (`hop_cost_s`: compute, the one-way delay from the hop
before it, a relayed hop's penalty, a long prompt's bytes over the link's
bandwidth); chains only go forward, so relaxing nodes in order of their first
layer finds the cheapest chain in O(nodes^2). A hop's compute is priced by
what this entry observed (`mesh.observed_speed`); an unobserved node's claim only up to a ceiling,
and a node caught overclaiming pays a penalty. Ties go to the smallest node
ids, so entries with one view pick one chain. Sans-IO.

Why, and each input: docs/design/routes.md#route-finding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from mesh.coverage import ModelCoverage, ServingNode
from mesh.identity import node_id_from_text, node_id_text
from mesh.member_table import MemberState
from mesh.records import NodeRecord
from mesh.relay import RELAY_BYTES_PER_S

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
  joining CPU nodes) win the route that gets it observed (and a slower
  one is tried too: `NEWCOMER_SPEEDUP`);
- a node whose claim is above this factor times its own observed rate is
  caught overclaiming (see `OVERCLAIM_PENALTY_S`). The claim that carried
  all the traffic in issue 18 was nine orders of magnitude off."""

NEWCOMER_SPEEDUP = 2.0
"""An unobserved node is assumed at least this many times faster per layer
than the fastest node observed in its coverage, until a request measures
it: optimism under uncertainty, as a bandit explores. Its doctor measured
its rate alone, often under the load of its own start; priced by that
alone, a newcomer slower on paper than the nodes already observed would
never be routed, so never observed, and never checked by the requests it
carries. It costs each entry about one request per newcomer. A node that
reports no rate at all (0) gets no such hope (`MIN_DECODE_TOKENS_PER_S`)."""

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

RELAYED_PENALTY_S = 0.01
"""Added to each hop reached through a relay (its record says `reach:
relayed`). The relay's detour is already in the measured delays; this is
for what they do not show: a relay that dies stalls every stream through it
for the entry's step deadline and reroute wait (seconds: docs/design/
relays.md#measured), and each traversal adds a little forwarding time
(about 1 ms measured). Ten milliseconds per step is what "similar cost"
means: a direct hop wins unless it is that much slower per token."""

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
      probe round trip); missing -> `unmeasured_latency_s`.
    - `unmeasured_latency_s`: what a node the entry has not measured yet is
      assumed to be: `DEFAULT_HOP_LATENCY_S`, or (`network_inputs`) the
      farthest node it did measure.
    - `load`: node id -> open sessions / session capacity; missing -> 0. At
      1 or more the node would answer busy, so it is excluded.
    - `busy`: nodes that answered busy recently; excluded.
    - `avoid`: nodes in back-off after failing (`Backoff.avoided`); excluded.
    - `observed_step_s`: node id -> seconds per decode step this entry
      observed through the node's span (`ObservedSpeeds.step_s`); a node
      there is priced by it instead of its claim.
    - `peer_rtt_s`: node a -> node b -> the round trip a measured to b. The
      one-way delay between two hops is half of it (either direction's
      measurement); a pair nobody measured falls back to the entry's latency
      to the receiving hop, as before.
    - `relayed`: nodes reached through a relay; each costs
      `RELAYED_PENALTY_S`.
    - `prefill_bytes`, `decode_steps`: the prompt's activations crossing each
      link, and the decode steps they are spread over: a hop whose incoming
      link has a known `bandwidth_bytes_per_s` is charged `prefill_bytes /
      bandwidth / decode_steps` (so bandwidth decides only for long prompts).
    """

    entry: bytes
    latency_s: Mapping[bytes, float] = field(default_factory=dict)
    load: Mapping[bytes, float] = field(default_factory=dict)
    busy: Collection[bytes] = frozenset()
    avoid: Collection[bytes] = frozenset()
    observed_step_s: Mapping[bytes, float] = field(default_factory=dict)
    peer_rtt_s: Mapping[bytes, Mapping[bytes, float]] = field(default_factory=dict)
    relayed: Collection[bytes] = frozenset()
    prefill_bytes: float = 0.0
    decode_steps: int = 1
    bandwidth_bytes_per_s: Mapping[bytes, float] = field(default_factory=dict)
    unmeasured_latency_s: float = DEFAULT_HOP_LATENCY_S

    def __post_init__(self) -> None:
        measured = [
            ("latency_s", self.latency_s),
            ("load", self.load),
            ("observed_step_s", self.observed_step_s),
        ]
        measured += [(f"peer_rtt_s[{node_id_text(a)}]", m) for a, m in self.peer_rtt_s.items()]
        for name, values in measured:
            for node_id, value in values.items():
                if not math.isfinite(value) or value < 0:
                    raise ValueError(f"{name}[{node_id_text(node_id)}]={value!r} is not >= 0")
        for node_id, rate in self.bandwidth_bytes_per_s.items():
            if not math.isfinite(rate) or rate <= 0:
                raise ValueError(
                    f"bandwidth_bytes_per_s[{node_id_text(node_id)}]={rate!r} is not > 0"
                )
        if not math.isfinite(self.unmeasured_latency_s) or self.unmeasured_latency_s < 0:
            raise ValueError(f"unmeasured_latency_s={self.unmeasured_latency_s!r} is not >= 0")
        if not math.isfinite(self.prefill_bytes) or self.prefill_bytes < 0:
            raise ValueError(f"prefill_bytes={self.prefill_bytes!r} is not >= 0")
        if self.decode_steps < 1:
            raise ValueError(f"decode_steps={self.decode_steps!r} is not >= 1")

    def excludes(self, node_id: bytes) -> bool:
        """True when the node may not be on a route now."""
        return node_id in self.avoid or node_id in self.busy or self.load.get(node_id, 0.0) >= 1


def network_inputs(
    entry: bytes,
    coverage: ModelCoverage,
    record: Callable[[bytes], NodeRecord | None],
    own_rtts: Mapping[bytes, float] | None = None,
) -> RouteInputs:
    """Route inputs for `entry` with the network its members' signed records
    describe: each record's `rtt_us` (the round trips its membership probes
    measured, the entry's own included) as `peer_rtt_s`, the nodes whose
    record says `reach: relayed` as `relayed`, and for those the relay's
    byte budget (`mesh.relay.RELAY_BYTES_PER_S`) as their bandwidth.
    `record` looks a node's record up (None: unknown). `own_rtts` (member ->
    seconds), the entry's live measurements, override its own record's:
    a record's round trips are republished only every ten seconds or more,
    and a newcomer the record does not name yet would pay
    `DEFAULT_HOP_LATENCY_S` until then, shut out of routes on a LAN. For
    the same reason a node the entry has not probed yet (membership probes
    one member a period) is assumed as far as the farthest it has: a member
    of the same swarm, not an intercontinental stranger."""
    peer_rtt_s: dict[bytes, dict[bytes, float]] = {}
    relayed: set[bytes] = set()
    for node in {entry} | {serving.node_id for serving in coverage.nodes}:
        found = record(node)
        if found is None:
            continue
        if found.rtt_us:
            rtts = {node_id_from_text(peer): us / 1e6 for peer, us in found.rtt_us.items()}
            peer_rtt_s[node] = rtts
        if found.reach == "relayed":
            relayed.add(node)
    if own_rtts:
        peer_rtt_s[entry] = {**peer_rtt_s.get(entry, {}), **own_rtts}
    latency_s = {peer: rtt / 2 for peer, rtt in peer_rtt_s.get(entry, {}).items()}
    return RouteInputs(
        entry=entry,
        latency_s=latency_s,
        unmeasured_latency_s=max(latency_s.values(), default=DEFAULT_HOP_LATENCY_S),
        peer_rtt_s=peer_rtt_s,
        relayed=frozenset(relayed),
        bandwidth_bytes_per_s={node: float(RELAY_BYTES_PER_S) for node in relayed},
    )


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


def one_way_s(sender: bytes, receiver: bytes, inputs: RouteInputs) -> float:
    """The estimated one-way delay of an activation from `sender` to
    `receiver`: half a round trip either of them measured to the other
    (`peer_rtt_s`; the entry's own `latency_s` first on its links), else the
    entry's latency to whichever end is not the entry, else
    `inputs.unmeasured_latency_s`. Zero from a node to itself."""
    if sender == receiver:
        return 0.0
    far = sender if receiver == inputs.entry else receiver
    if inputs.entry in (sender, receiver) and far in inputs.latency_s:
        return inputs.latency_s[far]
    for a, b in ((sender, receiver), (receiver, sender)):
        rtt = inputs.peer_rtt_s.get(a, {}).get(b)
        if rtt is not None:
            return rtt / 2
    return inputs.latency_s.get(far, inputs.unmeasured_latency_s)


def hop_cost_s(
    node: ServingNode,
    num_layers: int,
    inputs: RouteInputs,
    ceiling_layers_per_s: float,
    previous: bytes | None = None,
) -> float:
    """What a hop through `node` adds to one decode step, in seconds, when
    the activation comes from `previous` (None: the entry, the first hop).

    - Compute: what this entry observed a step through the node take, when
      it did (`inputs.observed_step_s`). Otherwise `1 / decode_tokens_per_s`,
      the rate the node's doctor measured for its own span (so it scales
      with the number of layers and the hardware), capped at
      `ceiling_layers_per_s` (`claim_ceiling` of the node's coverage)
      divided by the span's layers, and no slower than `NEWCOMER_SPEEDUP`
      times the fastest observed: a newcomer is tried.
    - Load: compute is divided by `1 - load`. A node shares its accelerator
      among its sessions; at utilisation rho a queue's expected service time
      grows as 1/(1-rho) (M/M/1), so a half-full node costs double and a
      nearly full one approaches the exclusion at load 1 continuously.
    - Network: `one_way_s` from `previous`, plus the token going back to the
      entry when the hop ends at the last layer; `RELAYED_PENALTY_S` when
      the node is reached through a relay; the prompt's bytes over the
      incoming link's bandwidth, spread over the decode steps.
    - `SUSPECT_PENALTY_S` when the node is a suspect member, and
      `OVERCLAIM_PENALTY_S` when it is caught overclaiming (`overclaims`).

    Only defined for nodes `inputs` does not exclude (load below 1).
    """
    step = inputs.observed_step_s.get(node.node_id)
    if step is None:
        step = _unobserved_step_s(node, ceiling_layers_per_s)
    cost = step / (1.0 - inputs.load.get(node.node_id, 0.0))
    cost += _network_cost_s(
        node, num_layers, inputs, inputs.entry if previous is None else previous
    )
    if node.state == MemberState.SUSPECT:
        cost += SUSPECT_PENALTY_S
    if overclaims(node, inputs):
        cost += OVERCLAIM_PENALTY_S
    return cost


def _unobserved_step_s(node: ServingNode, ceiling_layers_per_s: float) -> float:
    """A step through a node this entry has not observed: its claim, capped
    by the ceiling, and no slower than `NEWCOMER_SPEEDUP` times the fastest
    observed (the ceiling is `CLAIM_CEILING_FACTOR` times that)."""
    layers = node.layers[1] - node.layers[0]
    claimed = min(node.decode_tokens_per_s, ceiling_layers_per_s / layers)
    step = 1.0 / max(claimed, MIN_DECODE_TOKENS_PER_S)
    if node.decode_tokens_per_s <= 0 or math.isinf(ceiling_layers_per_s):
        return step
    fastest_layers_per_s = ceiling_layers_per_s / CLAIM_CEILING_FACTOR
    return min(step, layers / (NEWCOMER_SPEEDUP * fastest_layers_per_s))


def _network_cost_s(
    node: ServingNode, num_layers: int, inputs: RouteInputs, previous: bytes
) -> float:
    cost = one_way_s(previous, node.node_id, inputs)
    if node.layers[1] == num_layers:
        cost += one_way_s(node.node_id, inputs.entry, inputs)
    if node.node_id != inputs.entry and node.node_id in inputs.relayed:
        cost += RELAYED_PENALTY_S
    rate = inputs.bandwidth_bytes_per_s.get(node.node_id)
    if rate is not None and previous != node.node_id:
        cost += inputs.prefill_bytes / rate / inputs.decode_steps
    return cost


def chain_cost_s(
    nodes: Iterable[ServingNode],
    num_layers: int,
    inputs: RouteInputs,
    ceiling_layers_per_s: float,
    previous: bytes | None = None,
) -> float:
    """The summed `hop_cost_s` of hops in chain order, each from the one before
    (the first from `previous`, None: the entry)."""
    total = 0.0
    for node in nodes:
        total += hop_cost_s(node, num_layers, inputs, ceiling_layers_per_s, previous)
        previous = node.node_id
    return total


def _cheapest(
    nodes: Iterable[ServingNode],
    span: tuple[int, int],
    num_layers: int,
    inputs: RouteInputs,
    ceiling: float,
    around: tuple[bytes | None, bytes | None] = (None, None),
) -> tuple[RouteHop, ...] | None:
    """The cheapest hops tiling `span`, ties to the smallest node ids.

    `around` names the hops before and after the span (None: the entry
    before, nothing after); the delay into the hop after it counts too.
    Chains are extended node by node in order of their first layer: a
    node's cost depends on the hop before it, so the best chain is kept per
    last node, not per boundary."""
    start, end = span
    before, after = around
    inside = sorted(
        (node for node in nodes if start <= node.layers[0] and node.layers[1] <= end),
        key=lambda node: (node.layers[0], node.node_id),
    )
    # best[node id] = (cost, node ids, hops) of the best chain from start ending at it.
    best: dict[bytes, tuple[float, tuple[bytes, ...], tuple[RouteHop, ...]]] = {}
    ending: dict[int, list[bytes]] = {}
    for node in inside:
        if node.layers[0] == start:
            froms: list[tuple[float, tuple[bytes, ...], tuple[RouteHop, ...], bytes | None]] = [
                (0.0, (), (), before)
            ]
        else:
            froms = [(*best[m], m) for m in ending.get(node.layers[0], ())]
        hop = RouteHop(node.node_id, node.layers)
        for cost, ids, hops, previous in froms:
            added = hop_cost_s(node, num_layers, inputs, ceiling, previous)
            candidate = (cost + added, (*ids, node.node_id), (*hops, hop))
            known = best.get(node.node_id)
            if known is None or candidate[:2] < known[:2]:
                best[node.node_id] = candidate
        if node.node_id in best:
            ending.setdefault(node.layers[1], []).append(node.node_id)
    finals = []
    for last in ending.get(end, ()):
        cost, ids, hops = best[last]
        if after is not None:
            cost += one_way_s(last, after, inputs)
        finals.append((cost, ids, hops))
    return min(finals, key=lambda final: final[:2])[2] if finals else None


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
    hops = _cheapest(allowed, (0, length), length, inputs, ceiling) if length > 0 else None
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
    for index, hop in enumerate(route.hops):
        node = allowed.get(hop.node_id)
        if node is not None and node.layers == hop.layers:
            patched.append(hop)
            continue
        before = patched[-1].node_id if patched else None
        after = route.hops[index + 1].node_id if index + 1 < len(route.hops) else None
        replacement = _cheapest(
            allowed.values(), hop.layers, length, inputs, ceiling, (before, after)
        )
        if replacement is None:
            return find_route(coverage, inputs)
        patched.extend(replacement)
    hops = tuple(patched)
    return Route(hops, _route_cost(coverage, hops, inputs))


def _route_cost(coverage: ModelCoverage, hops: tuple[RouteHop, ...], inputs: RouteInputs) -> float:
    nodes = {node.node_id: node for node in coverage.nodes}
    ceiling = claim_ceiling(coverage, inputs)
    return chain_cost_s((nodes[hop.node_id] for hop in hops), coverage.num_layers, inputs, ceiling)


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
