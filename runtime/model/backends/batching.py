"""The layout of a batched step, shared by both backends' `forward_batch`.

A batched step runs several sessions' new tokens through a shard as one
forward, yet every session keeps its own KV cache, so sessions can join and
leave the batch between steps. The rows are right-padded: session i's T_i
new tokens take query slots 0..T_i-1 (positions L_i.., after its L_i cached
tokens), and attention sees its L_i + T_i keys in slots 0..L_i+T_i-1, in
position order (a cache holds position j in slot j), zeros after. This
module says what the padded batch looks like (positions, the attention mask
that hides other slots, which rows are real); the backends gather each
layer's keys from the sessions' caches into that shape and append each
row's new keys to its own cache. Design: docs/design/batching.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runtime.model.backends.base import BackendError, KVCache

Step = tuple[np.ndarray, np.ndarray, KVCache]
"""One session's part of a batched step: (inputs, positions, cache), as
`ShardBackend.forward` takes them."""


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where each session's tokens sit in one padded batch."""

    past: tuple[int, ...]  # L_i: tokens already in row i's cache
    counts: tuple[int, ...]  # T_i: row i's new tokens, >= 1

    @property
    def rows(self) -> int:
        return len(self.counts)

    @property
    def width(self) -> int:
        """Query slots per row: the most new tokens any row has."""
        return max(self.counts)

    @property
    def key_slots(self) -> int:
        """Key slots per row: the longest row's cache after this step."""
        return max(p + n for p, n in zip(self.past, self.counts, strict=True))

    def position_ids(self) -> np.ndarray:
        """int64 [rows, width]: each query slot's position (a padding slot
        continues its row's count; its output is dropped)."""
        return np.asarray(self.past, dtype=np.int64)[:, None] + np.arange(self.width)

    def mask(self, window: int | None) -> np.ndarray:
        """bool [rows, 1, width, key_slots]: True where a query slot may
        attend to a key slot. A query at position p sees the row's keys at
        positions <= p (causal) and, under a sliding `window`, > p - window
        (transformers' and mlx-lm's convention alike); never a key slot past
        the row's own, so padding and other sessions' lengths change
        nothing. A padding query sees its row's real keys (never none,
        which would make NaNs)."""
        queries = self.position_ids()[:, :, None]  # [rows, width, 1]
        keys = np.arange(self.key_slots)[None, None, :]
        ends = (np.asarray(self.past) + np.asarray(self.counts))[:, None, None]
        visible = (keys <= queries) & (keys < ends)
        if window is not None:
            visible &= keys > queries - window
        return visible[:, None]

    def padded(self, rows: Sequence[np.ndarray], fill: float | int = 0) -> np.ndarray:
        """Row arrays [T_i, ...] stacked into [rows, width, ...], `fill` after
        each row's own tokens."""
        first = rows[0]
        out = np.full((self.rows, self.width, *first.shape[1:]), fill, dtype=first.dtype)
        for index, row in enumerate(rows):
            out[index, : len(row)] = row
        return out


def layout(steps: Sequence[Step], past: Sequence[int]) -> BatchLayout:
    """The batch's layout, refusing what one forward could not run: an
    empty step, positions that do not continue the row's cache (`past`,
    read by the backend), one cache in two rows (both would append to it)."""
    if len({id(cache) for _, _, cache in steps}) != len(steps):
        raise BackendError("forward_batch got one session's cache in two rows")
    counts = []
    for (inputs, positions, _), cached in zip(steps, past, strict=True):
        count = len(inputs)
        expected = np.arange(cached, cached + count)
        if count == 0 or not np.array_equal(np.asarray(positions), expected):
            raise BackendError(
                f"positions must continue the cache ({cached}..{cached + count - 1}), "
                f"got {np.asarray(positions).tolist()}"
            )
        counts.append(count)
    return BatchLayout(tuple(past), tuple(counts))
