"""`SwarmReader`: what the inference layer and its checks read of the swarm.

The swarm's state (members, their signed records, the coverage built from
them) is kept above this layer, by `runtime.node.swarm_view.SwarmView`;
chat (`runtime.inference.chat`) and the spot checks (`runtime.node.spot_check`)
read it through this protocol, so inference never imports node. Chat reads
a little more (`runtime.inference.chat.ChatSwarm` extends it).
"""

from __future__ import annotations

from typing import Protocol

from mesh.coverage import CoverageMap
from mesh.records import Addresses, NodeRecord


class SwarmReader(Protocol):
    """This node's id, the coverage and each member's record
    (`runtime.node.swarm_view.SwarmView` is the real one)."""

    @property
    def node_id(self) -> bytes: ...
    def coverage(self) -> CoverageMap: ...
    def record(self, node: bytes) -> NodeRecord | None: ...
    def dial_addresses(self, node: bytes) -> Addresses | None:
        """Where to send to `node`: its record's addresses, or another
        relay's it holds when the advertised relay is down."""
