"""What each hop's decode steps and prefills took, as an entry node saw them.

A capability report's decode rate is the node's own word, so route finding
(`mesh.routes`) prices a hop by what this entry observed whenever it has.
Every token reply carries each hop's compute time by its own clock, and the
entry times the steps by its own: reports that add up to more than the
entry's wall time are scaled down to it, and the time left over (less a
network allowance per message) is split evenly over the hops. Prefill steps
give each hop's seconds per prompt token, which set its prefill deadlines.
Figures are moving averages (`OBSERVATION_WEIGHT`) over at most
`MAX_OBSERVED_NODES` nodes. Sans-IO: the caller passes the times.

The cross-check, its limits and why: docs/design/routes.md#observed-speeds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Final

from mesh.identity import node_id_text

OBSERVATION_WEIGHT: Final = 0.25
"""How far one generation moves a node's figure towards what it showed.
A sustained change (the node got loaded, or freed) shows within about four
generations, while one slow generation (a garbage-collection pause, a busy
moment on the entry) moves the figure only a quarter of the way."""

NETWORK_ALLOWANCE_S: Final = 0.0005
"""Unexplained time per message of a step (entry to the first hop, hop to
hop, the last hop back) that is put down to the network, not to the hops.
Half a millisecond is a loopback or LAN transfer of one token's hidden state
through ZeroMQ, so honest chains on a LAN are charged nothing for their
network, while a hop that under-reports hides at most this much per step:
little next to the tens of milliseconds a real model's step takes."""

MAX_OBSERVED_NODES: Final = 4096
"""Nodes whose figures an entry keeps (a few hundred bytes each). More than one
entry routes through in any period its figures stay meaningful; beyond it
the node observed least recently is forgotten and priced by its claim again
(capped by what others were seen to do, see `mesh.routes`)."""


class ObservedSpeeds:
    """Per node: the smoothed seconds one decode step through its span took,
    and one prompt token of a prefill, as this entry observed them (the
    rules: docs/design/routes.md#observed-speeds)."""

    def __init__(self, capacity: int = MAX_OBSERVED_NODES) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._step_s: OrderedDict[bytes, float] = OrderedDict()
        """node id -> smoothed seconds per step, least recently observed first."""
        self._prefill_s: OrderedDict[bytes, float] = OrderedDict()
        """node id -> smoothed seconds per prefill token, least recently observed first."""

    def observe(
        self,
        nodes: Sequence[bytes],
        decode_us: Sequence[int],
        decode_steps: int,
        wall_s: float,
        wall_steps: int,
    ) -> bool:
        """Feed one finished generation; True when it was used.

        `nodes`, `decode_us` and `decode_steps` are the chain's timing (the
        hops in chain order, each one's reported compute summed over
        `decode_steps` one-token steps); `wall_s` is what the entry's clock
        saw `wall_steps` steps take (first token to last). A generation whose
        two counts differ is skipped: its timing then covers other steps than
        the wall time (a failover started the chain's timing afresh, or a hop
        did not report), and so is one without a decode step.
        """
        if len(nodes) != len(decode_us) or not nodes:
            raise ValueError("one reported time per hop is needed")
        if wall_s < 0 or min(decode_us) < 0:
            raise ValueError("times cannot be negative")
        if decode_steps < 1 or decode_steps != wall_steps:
            return False
        wall = wall_s / wall_steps
        reported = [us / 1e6 / decode_steps for us in decode_us]
        total = sum(reported)
        if total > wall:
            reported = [r * wall / total for r in reported]
            total = wall
        allowance = NETWORK_ALLOWANCE_S * (len(nodes) + 1)
        share = max(0.0, wall - total - allowance) / len(nodes)
        for node, own in zip(nodes, reported, strict=True):
            self._update(self._step_s, node, own + share)
        return True

    def observe_prefill(
        self, nodes: Sequence[bytes], prefill_us: Sequence[int], tokens: int, wall_s: float
    ) -> bool:
        """Feed the prefill a finished generation's chain began with; True
        when it was used (not for a step of no tokens: the chain's timing
        had no report of it).

        `nodes` and `prefill_us` are the hops in chain order and each one's
        reported compute for the step, `tokens` its length, `wall_s` what
        the entry's clock saw it take (sent to token)."""
        if len(nodes) != len(prefill_us) or not nodes:
            raise ValueError("one reported time per hop is needed")
        if wall_s < 0 or min(prefill_us) < 0:
            raise ValueError("times cannot be negative")
        if tokens < 1:
            return False
        reported = [us / 1e6 for us in prefill_us]
        total = sum(reported)
        if total > wall_s:
            reported = [r * wall_s / total for r in reported]
        for node, own in zip(nodes, reported, strict=True):
            self._update(self._prefill_s, node, own / tokens)
        return True

    def _update(self, table: OrderedDict[bytes, float], node: bytes, value: float) -> None:
        known = table.pop(node, None)
        if known is not None:
            value = known + OBSERVATION_WEIGHT * (value - known)
        table[node] = value
        while len(table) > self.capacity:
            table.popitem(last=False)

    def step_s(self) -> Mapping[bytes, float]:
        """node id -> observed seconds per decode step: `RouteInputs.observed_step_s`."""
        return dict(self._step_s)

    def prefill_s_per_token(self) -> Mapping[bytes, float]:
        """node id -> observed seconds per prompt token of a prefill."""
        return dict(self._prefill_s)

    def to_json(self) -> dict[str, float]:
        """For the status document: hex node id -> observed milliseconds per
        step, so an operator can see why a node gets no traffic."""
        return {node_id_text(node): round(s * 1e3, 3) for node, s in self._step_s.items()}
