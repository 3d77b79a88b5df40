"""The status document: the body of `GET /v1/network/status`.

Its keys are a contract: the Prometheus metrics (`runtime.api.metrics`),
the web page and `shardmesh status` are all views of it, so a key is
renamed or removed only with every reader. It is assembled here from what
each component reports about itself, so no component needs to know the
document's shape.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from mesh import records
from mesh.coverage import coverage_to_json, excluded_to_json
from mesh.identity import node_id_text
from runtime.inference.chat import ChatService
from runtime.inference.dispatch import Engine
from runtime.model.store import ModelStore
from runtime.node.admission import ShardSlot
from runtime.node.ledger_follower import LedgerFollower
from runtime.node.membership_driver import MembershipDriver
from runtime.node.placement_driver import Placement
from runtime.node.raft_driver import RaftDriver
from runtime.node.reachability_driver import ReachabilityDriver
from runtime.node.relays import NodeRelays
from runtime.node.spot_check import Adjudicator, SpotChecker
from runtime.node.swarm_view import SwarmView


class StatusSources(Protocol):
    """Everything the document reports on, as the daemon wired it
    (`runtime.node.daemon.Node` is the real one)."""

    profile: str
    addresses: dict[str, str]
    started_at: float
    """Wall clock: shown to humans only."""
    started_mono: float
    transport_drops: Counter[str]
    local_drops: Counter[str]
    membership: MembershipDriver
    swarm: SwarmView
    raft: RaftDriver
    ledger_follower: LedgerFollower
    engine: Engine
    slot: ShardSlot
    placement: Placement
    store: ModelStore
    chat: ChatService
    spot_checks: SpotChecker
    adjudicator: Adjudicator
    reachability: ReachabilityDriver
    relays: NodeRelays


def merged_drops(
    named: Sequence[Counter[str]], by_source: Mapping[str, Mapping[str, int]]
) -> dict[str, int]:
    """Every drop counter in one sorted map, zeros left out: the `named`
    counters' names as they are ("control.", "data.", "engine."), each
    source's prefixed by its name ("raft.", "placement.unknown_model")."""
    drops: Counter[str] = sum(named, Counter())
    for source, counter in by_source.items():
        drops += Counter({f"{source}.{reason}": n for reason, n in counter.items()})
    return dict(sorted(drops.items()))


def status_document(source: StatusSources, now: float) -> dict[str, Any]:
    """The document at monotonic time `now`."""
    membership = source.membership
    members = []
    for view, record in source.swarm.records():
        record_json: dict[str, Any] | None = None
        if view.record is not None:
            record_json = {"seq": view.record.seq}
            if record is None:
                record_json["error"] = "undecodable"
            else:
                record_json.update(records.record_to_json(record))
        is_self = view.node == membership.node_id
        members.append(
            {
                "node_id": node_id_text(view.node),
                "self": is_self,
                "state": str(view.state),
                "incarnation": view.incarnation,
                "addr": view.addr,
                "last_seen": None if is_self else _ago(now, view.last_seen),
                "state_for": _ago(now, view.state_since),
                "record": record_json,
            }
        )
    members.sort(key=lambda m: (not m["self"], m["node_id"]))
    coverage = source.swarm.coverage()
    admission = source.slot.admission
    return {
        "node_id": node_id_text(membership.node_id),
        "incarnation": membership.core.incarnation,
        "profile": source.profile,
        "join": membership.join_status(),
        # Whether peers can dial this node back (runtime.node.reachability_driver).
        "reachability": source.reachability.status(),
        # The relay it offers, the ones it is reached through (runtime.node.relays).
        "relays": source.relays.status(),
        "addresses": dict(source.addresses),
        "started_at": source.started_at,
        "uptime_s": round(now - source.started_mono, 3),
        "leaving": membership.leaving,
        "health": membership.core.health,
        # New ids introduced and not verified yet: never in `members`
        # (docs/design/membership.md#introductions).
        "candidates": membership.core.candidates,
        "members": members,
        **source.raft.status(),
        "coverage": coverage_to_json(coverage),
        "not_serving": excluded_to_json(coverage),
        "drops": _drops(source),
        "sessions": source.engine.sessions,
        "hop": source.engine.hop_stats,
        # What routes price each hop by: why a node gets no traffic.
        "chat": {**source.chat.stats_json(), "observed_step_ms": source.chat.speeds.to_json()},
        # What this node's spot checks found (as an entry) and judged (as
        # the leader): runtime.node.spot_check.
        "verify": {
            "checks": source.spot_checks.stats_json(),
            "verdicts": dict(source.adjudicator.counters),
        },
        "admission": None if admission is None else admission.to_json(),
        "placement": source.placement.to_json(),
        "store": list(source.store.names()),
        "events": [
            {
                "kind": e["kind"],
                "node_id": e["node_id"],
                "incarnation": e["incarnation"],
                "ago_s": _ago(now, e["at"]),
            }
            for e in membership.recent_events
        ],
        "ledger_follower": source.ledger_follower.status(),
    }


def _drops(source: StatusSources) -> dict[str, int]:
    by_source = {**source.membership.drops(), "raft": source.raft.drops}
    by_source["placement"] = source.placement.drops  # refused: "placement.unknown_model"
    return merged_drops((source.transport_drops, source.local_drops), by_source)


def _ago(now: float, then: float | None) -> float | None:
    """Seconds from monotonic `then` to `now`, for humans (None stays None)."""
    return None if then is None else round(max(0.0, now - then), 3)
