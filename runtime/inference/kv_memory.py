"""A hop's KV memory, budgeted: what a session's cache may grow to, and whether it fits.

A session's KV cache grows by one position per token, up to the budget it
asked for at `open` (its prompt plus the tokens it may generate), on every
layer of the shard. A hop that let sessions in by count alone could run out
of memory halfway through a long generation, and an out-of-memory error
takes every session on the node with it. So the hop reserves a session's
whole budget when it opens it and frees it when it closes; a session that
would not fit is refused (`busy`, reason `memory`, and the entry routes
elsewhere or answers 429) before anything is computed. The capacity is
what `--max-memory` leaves beside the weights, or the device's free memory
once the shard is loaded. Sans-IO: plain arithmetic, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

REASON_MEMORY: Final = "memory"
"""The `busy` reason of a session whose cache would not fit."""

DTYPE_BYTES: Final = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per cached element by compute dtype: the KV cache is kept in the
recipe's compute dtype whatever the weights are quantized to."""


def kv_bytes_per_position(config: Mapping[str, Any], layers: int, dtype: str) -> int:
    """One position's keys and values over `layers` layers of a model with
    this `config.json`: 2 x layers x KV heads x head size x element bytes.
    A sliding-window layer holds fewer positions; counting it whole errs on
    the safe side."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def kv_capacity(max_memory: int | None, weight_bytes: int, free_bytes: int | None) -> int | None:
    """Bytes the caches may take: `--max-memory` less the weights, at most
    what the device has free (read after the weights loaded); None when
    neither is known (no bound but the session count)."""
    room = None if max_memory is None else max(0, max_memory - weight_bytes)
    if free_bytes is None:
        return room
    return free_bytes if room is None else min(room, free_bytes)


@dataclass(slots=True)
class KvMemory:
    """The caches' bytes reserved per session, against a capacity (None:
    unbounded)."""

    capacity_bytes: int | None
    bytes_per_position: int
    _held: dict[str, int] = field(default_factory=dict)

    def reserve(self, session: str, positions: int) -> bool:
        """Reserve `positions` of cache for `session`; False (nothing held)
        when it would not fit beside what the open sessions hold."""
        wanted = positions * self.bytes_per_position
        if self.capacity_bytes is not None and self.held_bytes + wanted > self.capacity_bytes:
            return False
        self._held[session] = wanted
        return True

    def release(self, session: str) -> None:
        self._held.pop(session, None)

    @property
    def held_bytes(self) -> int:
        return sum(self._held.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "held_bytes": self.held_bytes,
            "bytes_per_position": self.bytes_per_position,
        }
