"""Fault: a hop that computes slowly, as a loaded or modest machine does.

``SHARDMESH_TEST_FAULT=slow_hop:<seconds>`` makes every forward the node's
hop server runs take `seconds` longer, a batch of several sessions' steps
as one forward included (a sleep in the compute thread, after the real
forward: the numbers stay honest, the node's event loop keeps running).
The doctor, which runs before the hop server exists, measures the shard's
true speed. Tests use it to hold sessions open long enough to watch them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from runtime.inference import hop_server


class _SlowShard:
    """The real shard, whose forwards then sleep: each a step's, or a
    batch's (one forward, one sleep, as a slow machine's batch takes)."""

    def __init__(self, shard: Any, delay_s: float) -> None:
        self._shard = shard
        self._delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shard, name)

    def forward(self, inputs: np.ndarray, positions: np.ndarray, cache: Any) -> np.ndarray:
        output = self._shard.forward(inputs, positions, cache)
        time.sleep(self._delay_s)
        return output

    def forward_batch(self, steps: Sequence[tuple[np.ndarray, np.ndarray, Any]]) -> list[Any]:
        outputs = self._shard.forward_batch(steps)
        time.sleep(self._delay_s)
        return outputs


def install(argument: str) -> None:
    delay_s = float(argument)
    honest_init = hop_server.HopServer.__init__

    def slow_init(self: Any, plane: Any, shard: Any, **kwargs: Any) -> None:
        honest_init(self, plane, _SlowShard(shard, delay_s), **kwargs)

    hop_server.HopServer.__init__ = slow_init  # type: ignore[method-assign]
