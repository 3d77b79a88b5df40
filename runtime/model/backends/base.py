"""The one small interface every compute backend implements.

A backend runs a contiguous span of decoder layers [start, end) of one model
(a *shard*). The first shard (start == 0) also owns the token embeddings and
takes token ids; the last shard (end == num_layers) also owns the final norm
and LM head and returns logits. Every other shard takes and returns hidden
states.

Arrays cross the interface as NumPy arrays (float32 hidden states / logits,
int64 token ids and positions) because that is what the wire codec, the
doctor and the other backend all understand; the conversion is a copy of
one activation row per decode step, which is noise beside a layer's matmuls.
A session is one conversation; `forward_batch` runs several sessions' steps
in one forward, each on its own cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class BackendError(Exception):
    """A backend cannot do what was asked (not installed, recipe unsupported,
    bad shard, missing tensor). The message is meant for an operator."""


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Which part of which model to run, and in which numeric recipe."""

    model_dir: Path
    start: int  # first layer, inclusive
    end: int  # last layer, exclusive
    recipe: str  # one of runtime.model.recipes.RECIPES


class ShardPosition:
    """`is_first` / `is_last` for a backend that sets `spec` and `num_layers`:
    where a shard sits decides what it takes (ids or hidden states) and
    returns (hidden states or logits)."""

    spec: ShardSpec
    num_layers: int

    @property
    def is_first(self) -> bool:
        return self.spec.start == 0

    @property
    def is_last(self) -> bool:
        return self.spec.end == self.num_layers


class KVCache:
    """Opaque per-session cache handle; only the backend that made it reads it.

    Each backend subclasses this with its own cache type and hands one out
    from `new_cache()`. `forward` accepts any KVCache, as the protocol says,
    and narrows it to its own type (isinstance), raising BackendError for a
    handle another backend made. A nominal base class rather than an empty
    Protocol: every object satisfies an empty Protocol, so the type checker
    could not tell a cache from anything else passed in its place."""

    __slots__ = ()


class ShardBackend(Protocol):
    """What a loaded shard offers the rest of the node. Backends implement it
    structurally (no inheritance); `load_shard` returning each backend's
    shard as a ShardBackend is where the type checker holds them to it."""

    name: str  # "torch" | "mlx"
    device: str  # "cpu", "cuda:0", "mps", "gpu"...
    spec: ShardSpec
    num_layers: int  # layers in the whole model
    hidden_size: int
    vocab_size: int

    @property
    def is_first(self) -> bool: ...

    @property
    def is_last(self) -> bool: ...

    def new_cache(self) -> KVCache:
        """A fresh, empty KV cache for one session on this shard (the
        backend's own KVCache subclass)."""

    def forward(self, inputs: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        """Run the shard on T new tokens and append them to `cache`.

        `inputs` is int64 token ids of shape [T] on the first shard, else
        float32 hidden states of shape [T, hidden_size]. `positions` is int64
        [T] (absolute positions, continuing the cache). Returns float32
        [T, vocab_size] logits on the last shard, else [T, hidden_size].
        `cache` must come from this shard's `new_cache()`; any other handle
        is refused with BackendError.
        """

    def forward_batch(
        self, steps: Sequence[tuple[np.ndarray, np.ndarray, KVCache]]
    ) -> list[np.ndarray]:
        """Run several sessions' steps as one batched forward.

        Each step is what `forward` takes, (inputs, positions, cache), for
        a different session: typically one decode token each, at different
        positions, though any T >= 1 per row works (a row's padding is
        dropped). All rows go through the layers together (the matmuls run
        once for the batch); each row attends only to its own cache's keys
        and its own new tokens, and its new keys are appended to its own
        cache, so the caches stay independent and a session may take its
        next step alone or in another batch. Returns per step, in order,
        exactly what `forward` would (float32 [T_i, vocab_size] or
        [T_i, hidden_size]), equal to it up to float rounding. Refused with
        BackendError like `forward`, and when two steps share a cache; an
        empty batch returns []. Design: docs/design/batching.md.
        """

    def info(self) -> dict[str, Any]:
        """JSON-ready facts for status and the doctor (backend, device,
        dtype, library versions, bytes of weights held)."""
