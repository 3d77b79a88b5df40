"""The chat-demand workload of a placement simulation.

Requests for each model arrive as a Poisson process at a configured rate,
each at one of the entries, which routes it (`simulations.placement_routing`)
and has it served (`simulations.placement_spot_checks`) when a route exists.
Served or not, a request counts as demand, flushed to the leader through
Raft every `DEMAND_FLUSH_S`, as the entry nodes' batching does; that demand
is what the placement policy places copies for.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from consensus.commands import RecordDemand, encode_command
from simulations.placement_metrics import since
from simulations.placement_routing import ENTRIES, Routing
from simulations.placement_spot_checks import SpotChecks
from simulations.raft_cluster import RaftCluster

__all__ = ["DEMAND_FLUSH_S", "ModelStats", "Workload"]

DEMAND_FLUSH_S: Final = 0.5
"""The entries' demand batching (runtime.node.placement_driver.DEMAND_FLUSH_S)."""


@dataclass
class ModelStats:
    """What happened to one model's demand."""

    requests: int = 0
    served: int = 0
    first_request_at: float | None = None
    first_assigned_at: float | None = None
    first_served_at: float | None = None

    def summary(self) -> dict[str, object]:
        """The model's figures in the metrics, but its chain's availability."""
        return {
            "requests": self.requests,
            "served": self.served,
            "served_fraction": self.served / self.requests if self.requests else None,
            "first_request_at": self.first_request_at,
            "request_to_assigned_s": since(self.first_request_at, self.first_assigned_at),
            "request_to_served_s": since(self.first_request_at, self.first_served_at),
        }


class Workload:
    """Requests arriving, routed, served, and counted as demand."""

    def __init__(
        self,
        raft: RaftCluster,
        models: Iterable[str],
        routing: Routing,
        spot_checks: SpotChecks,
        *,
        arrivals: random.Random,
        serving: random.Random,
        swim: bool,
    ) -> None:
        self._raft, self._loop = raft, raft.loop
        self._routing, self._spot_checks = routing, spot_checks
        self._arrivals, self._serving, self._swim = arrivals, serving, swim
        self.stats = {name: ModelStats() for name in models}
        self.requests: list[tuple[float, str, bool]] = []
        """Every chat request: (time, model, served)."""
        self._pending: Counter[str] = Counter()
        """Demand not yet flushed to the leader, per model."""

    def schedule(self, model: str, per_minute: float, start: float, stop: float) -> None:
        """Chat requests for `model` at `per_minute` on average (Poisson),
        from `start` to `stop` virtual seconds."""
        if model not in self.stats or per_minute <= 0:
            raise ValueError(f"unknown model {model!r} or a rate <= 0")
        at = start
        while True:
            at += self._arrivals.expovariate(per_minute / 60.0)
            if at >= stop:
                return
            self._loop.call_at(at, self._request, model)

    def _request(self, model: str) -> None:
        now = self._loop.now
        stats = self.stats[model]
        stats.requests += 1
        if stats.first_request_at is None:
            stats.first_request_at = now
        self._pending[model] += 1
        entry = self._routing.entries[self._serving.randrange(ENTRIES)]
        inputs = entry.inputs(now)
        route = self._routing.route(model, inputs, entry.member)
        if route is not None and self._swim:
            route = self._routing.reroute(model, entry, inputs, route)
        self.requests.append((now, model, route is not None))
        if route is not None:
            stats.served += 1
            if stats.first_served_at is None:
                stats.first_served_at = now
            self._spot_checks.serve(model, entry, route)

    def flush(self) -> None:
        """Every `DEMAND_FLUSH_S`: propose the demand counted since the last
        flush through the leader, model by model; what it cannot propose
        waits for the next flush."""
        self._loop.call_later(DEMAND_FLUSH_S, self.flush)
        leader = self._raft.leader()
        if leader is None or not self._pending:
            return
        for model, count in sorted(self._pending.items()):
            command = RecordDemand(model, count, self._loop.now)
            if self._raft.propose(encode_command(command), on=leader) is None:
                return  # kept for the next flush
            del self._pending[model]

    def assigned(self, model: str) -> None:
        """A managed assignment of `model` committed."""
        stats = self.stats[model]
        if stats.first_assigned_at is None:
            stats.first_assigned_at = self._loop.now
