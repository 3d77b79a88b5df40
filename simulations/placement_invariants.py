"""The invariants a placement simulation checks as it runs and at its end.

Raft's own (one leader per term, agreeing committed logs); every replica's
ledger equal at equal applied index; a pinned shard, once recorded, never
changes; every managed assignment a leader proposes goes to a worker its
view holds alive, spare and holding the model; no request is routed
through a node the ledger holds quarantined. A leader cut off from a
quorum keeps proposing until CheckQuorum steps it down; what it proposes
meanwhile never commits, which the agreeing ledgers show.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from consensus.commands import Assign, Command, Release
from consensus.ledger import PlacementLedger
from consensus.placement import Decision, PlacementInput
from simulations.loop import EventLoop
from simulations.raft_cluster import RaftCluster

__all__ = ["Invariants"]


class Invariants:
    """The violations found so far, and the checks that find them."""

    def __init__(self, loop: EventLoop) -> None:
        self._loop = loop
        self.violations: list[str] = []
        """What failed, each with its time or the node it is about."""
        self._pinned: dict[bytes, tuple[str, tuple[int, int]]] = {}
        """Node -> the pinned shard its first unmanaged assignment recorded."""

    def decision(self, snapshot: PlacementInput, decision: Decision) -> None:
        """A leader is about to propose `decision` from `snapshot`: a managed
        assignment must go to a worker it holds alive, spare and holding the
        model."""
        command = decision.command
        if isinstance(command, Assign) and command.managed:
            view = snapshot.nodes[command.node]
            if view.state != "alive" or not view.spare or command.model not in view.models:
                self.violations.append(f"{self._loop.now:.3f}: managed {command} onto {view}")

    def committed(self, command: Command) -> None:
        """A command committed: a pinned shard, once recorded, never changes
        and is never released."""
        if isinstance(command, Assign) and not command.managed:
            shard = (command.model, command.layers)
            if self._pinned.setdefault(command.node, shard) != shard:
                self.violations.append(f"pinned shard of {command.node.hex()[:8]} changed")
        elif isinstance(command, Release) and command.node in self._pinned:
            self.violations.append(f"pinned shard of {command.node.hex()[:8]} released")

    def routed(self, node_ids: Sequence[bytes], quarantined: Mapping[bytes, object]) -> None:
        """A request is about to run over `node_ids`: none may be quarantined."""
        if not quarantined.keys().isdisjoint(node_ids):
            self.violations.append(f"{self._loop.now:.3f}: a route through a quarantined node")

    def check(self, seed: int, raft: RaftCluster, ledgers: Sequence[PlacementLedger]) -> None:
        """Raise AssertionError if any invariant failed, Raft's and the
        ledgers' agreement included."""
        raft.check_safety()
        by_index: dict[int, bytes] = {}
        for i, ledger in enumerate(ledgers):
            snapshot = ledger.snapshot()
            other = by_index.setdefault(ledger.applied_index, snapshot)
            if other != snapshot:
                self.violations.append(f"ledger of voter {i} differs at {ledger.applied_index}")
        if self.violations:
            raise AssertionError(f"seed {seed}: " + "; ".join(self.violations[:5]))
