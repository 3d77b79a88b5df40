"""The status document: the body of `GET /v1/network/status`.

DESIGN.md (Contracts) fixes its keys; the metrics and the dashboard are both
views of it. It is assembled here from what each component reports about
itself, so no component needs to know the document's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mesh import records
from mesh.coverage import coverage_to_json, excluded_to_json
from mesh.identity import node_id_text
from runtime.inference.chat import ChatService
from runtime.inference.dispatch import Engine
from runtime.model.store import ModelStore
from runtime.node.admission import ShardSlot
from runtime.node.membership_driver import MembershipDriver
from runtime.node.placement_driver import Placement
from runtime.node.raft_driver import RaftDriver
from runtime.node.spot_check import Adjudicator, SpotChecker
from runtime.node.swarm_view import SwarmView


@dataclass(frozen=True)
class StatusSources:
    """Everything the document reports on, as the daemon wired it."""

    profile: str
    addresses: dict[str, str]
    started_at: float
    """Wall clock: shown to humans only."""
    started_mono: float
    membership: MembershipDriver
    swarm: SwarmView
    raft: RaftDriver
    engine: Engine
    slot: ShardSlot
    placement: Placement
    store: ModelStore
    chat: ChatService
    spot_checks: SpotChecker
    adjudicator: Adjudicator
    drops: dict[str, int]


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
        "addresses": dict(source.addresses),
        "started_at": source.started_at,
        "uptime_s": round(now - source.started_mono, 3),
        "leaving": membership.leaving,
        "health": membership.core.health,
        "members": members,
        **source.raft.status(),
        "coverage": coverage_to_json(coverage),
        "not_serving": excluded_to_json(coverage),
        "drops": source.drops,
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
    }


def _ago(now: float, then: float | None) -> float | None:
    """Seconds from monotonic `then` to `now`, for humans (None stays None)."""
    return None if then is None else round(max(0.0, now - then), 3)
