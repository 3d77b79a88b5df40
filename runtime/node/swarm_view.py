"""What this node knows of the swarm: members, their records, coverage, who is admitted.

One read model, used by chat (routes, 503 bodies), placement (its input) and
the status document, so all three agree on who serves what. It owns the
decoded-record cache: the membership core validated every record on
arrival, so decoding here only turns bytes into fields, once per record seq.

"Admitted" has one definition, `consensus.placement.capability_state`: an
unexpired admitted report about exactly the shard the node is assigned.
Coverage (`mesh.coverage`) is the stricter, routable view of the same
reports. Capability times are judged by wall clock: reports are compared
across machines.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from consensus.ledger import PlacementLedger
from consensus.placement import capability_state
from mesh import records
from mesh.coverage import CoverageMap, build_coverage
from mesh.identity import node_id_text
from mesh.member_table import LIVE_STATES
from mesh.membership import MemberView
from mesh.records import Addresses, NodeRecord, Record, dial_addresses
from runtime.node.membership_driver import MembershipDriver


class SwarmView:
    """The swarm as this node's membership view and ledger replica show it."""

    def __init__(self, membership: MembershipDriver, ledger: Callable[[], PlacementLedger]) -> None:
        """`ledger` returns the current replica (a snapshot restore replaces it)."""
        self.node_id = membership.node_id
        self._membership = membership
        self._ledger = ledger
        self._decoded: dict[bytes, tuple[int, NodeRecord | None]] = {}

    # --- members and records -----------------------------------------------------

    def members(self) -> list[MemberView]:
        return self._membership.members()

    def records(self) -> list[tuple[MemberView, NodeRecord | None]]:
        """Every member with its decoded record; forgets the cache of
        members the core has forgotten."""
        views = self._membership.members()
        decoded = [(view, self._decode(view.record)) for view in views]
        for node in self._decoded.keys() - {view.node for view in views}:
            del self._decoded[node]
        return decoded

    def rtts(self) -> dict[bytes, float]:
        """This node's live round trips to its members (`Membership.rtts`)."""
        return self._membership.core.rtts()

    def record(self, node: bytes) -> NodeRecord | None:
        view = self._membership.member(node)
        return None if view is None else self._decode(view.record)

    def signed_record(self, node: bytes) -> NodeRecord | None:
        """The record `node` signed, whether or not it is a member: what
        the reachability prober dials back. A node behind NAT never
        answers our ping, so it never becomes a member
        (docs/design/membership.md#introductions), yet must learn that it
        cannot be dialed; its own signed record still names the only
        address we dial. Not for routes: those read members only."""
        return self._decode(self._membership.core.record(node))

    def member_state(self, node: bytes) -> str | None:
        view = self._membership.member(node)
        return None if view is None else str(view.state)

    def dial_addresses(self, node: bytes) -> Addresses | None:
        """Where to dial `node`: its record's addresses, through another
        relay it holds when the one it advertises is not alive in this
        node's view (`mesh.records.dial_addresses`)."""
        record = self.record(node)
        if record is None:
            return None

        def is_down(relay: str) -> bool:
            state = self.member_state(bytes.fromhex(relay))
            return state is not None and state != "alive"

        return dial_addresses(record.addresses, is_down)

    def member_api(self, node: bytes) -> str | None:
        """The HTTP API address to reach `node` at (`dial_addresses`), if known."""
        addresses = self.dial_addresses(node)
        return None if addresses is None else addresses.api

    def _live_records(self) -> list[tuple[MemberView, NodeRecord]]:
        return [
            (view, record)
            for view, record in self.records()
            if str(view.state) in LIVE_STATES and record is not None
        ]

    def _decode(self, record: Record | None) -> NodeRecord | None:
        if record is None:
            return None
        cached = self._decoded.get(record.node)
        if cached is not None and cached[0] == record.seq:
            return cached[1]
        try:
            decoded: NodeRecord | None = records.decode_record_body(record.body)
        except records.RecordError:
            decoded = None
        self._decoded[record.node] = (record.seq, decoded)
        return decoded

    # --- who serves what ------------------------------------------------------------

    def coverage(self) -> CoverageMap:
        """Who serves what, now: the routable view (never a node the ledger
        holds quarantined)."""
        now = time.time()
        return build_coverage(
            ((view.node, str(view.state), record) for view, record in self.records()),
            now,
            quarantined=self._ledger().quarantined(now).keys(),
        )

    def assigned_models(self) -> set[str]:
        """Models some live member is assigned, admitted yet or not."""
        return {
            record.assignment.model
            for _, record in self._live_records()
            if record.assignment is not None
        }

    def stored_models(self) -> set[str]:
        """Models some live member has in its store (placement could load them)."""
        return {name for _, record in self._live_records() for name in record.models}

    def known_models(self) -> set[str]:
        """Models some member could serve: in a live member's store, assigned
        to a live member by its record, or assigned by the ledger. Demand
        for any other model is invented (nobody could ever place it), so
        the leader does not commit it (`Placement.demand_refusal`)."""
        ledger = {a.model for a in self._ledger().assignments()}
        return self.assigned_models() | self.stored_models() | ledger

    def loading_nodes(self, model: str) -> list[str]:
        """Live members assigned `model` (by the ledger, else by their record)
        that are not admitted for it yet: loading, or in the doctor."""
        ledger, now = self._ledger(), time.time()
        loading = []
        for view, record in self.records():
            if str(view.state) not in LIVE_STATES:
                continue
            claims = [ledger.assignment(view.node), record.assignment if record else None]
            shard = next((s for s in claims if s is not None and s.model == model), None)
            if shard is None:
                continue
            report = record.capability if record is not None else None
            if capability_state(report, shard, now) != "admitted":
                loading.append(node_id_text(view.node))
        return loading
