"""Forming a hop's batches of decode steps: which waiting steps run together, and what came of it.

A hop runs one forward at a time. While its shard is busy, one-token decode
steps of different sessions wait in one `DecodeQueue`; when the shard frees
up, the hop's batcher takes the oldest waiting step of each session (never
two of one session: the second continues the first's cache), at most
`MAX_BATCH_ROWS`, and runs them as one `ShardBackend.forward_batch`.
Nothing waits on purpose: a batch forms while the forward before it runs,
so a step that finds the hop idle runs at once, alone, and no step waits
longer than the forwards ahead of it. `BatchStats` is what the hop's status
shows of it. A long prefill runs in chunks sized by `ChunkSizer`, and
the batches that wait run between them. Sans-IO: the caller passes the
times.

How the hop server uses it: docs/design/batching.md#forming-batches-at-a-hop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from runtime.inference.latency import STEP_BUCKETS_S, Histogram

__all__ = [
    "MAX_BATCH_ROWS",
    "MIN_CHUNK_TOKENS",
    "PREFILL_CHUNK_TOKENS",
    "BatchStats",
    "ChunkSizer",
    "DecodeQueue",
]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

MAX_BATCH_ROWS: Final = 16
"""The most decode steps one batched forward takes. Every row of a batch
waits for the whole batch, so a bigger one lengthens each member's step,
while what a row saves flattens: on the development CPU 16 rows at a
128-token context ran 4-4.5x the throughput of 16 steps alone, in 55-58 ms,
about four lone steps (docs/design/batching.md). The gather copies every
row's keys, padded to the longest row, per layer and step: the bound keeps
that copy within 16 sessions' caches. It equals the hop's default session
limit (`hop_server.DEFAULT_MAX_SESSIONS`), so at the defaults every waiting
session joins the next batch; steps beyond it wait for the one after."""


@dataclass(eq=False, slots=True)
class _Waiting(Generic[K, V]):
    key: K
    item: V
    since: float


class DecodeQueue(Generic[K, V]):
    """Decode steps waiting for the shard, oldest first; ``key`` is the
    step's session."""

    def __init__(self) -> None:
        self._waiting: list[_Waiting[K, V]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, key: K, item: V, now: float) -> None:
        """``item``, a step of session ``key``, waits from ``now``."""
        self._waiting.append(_Waiting(key, item, now))

    def discard(self, item: V) -> bool:
        """Forget ``item`` (its session left before it ran); False when it
        was not waiting (already taken, or never added)."""
        for index, waiting in enumerate(self._waiting):
            if waiting.item is item:
                del self._waiting[index]
                return True
        return False

    def take(self, limit: int, now: float) -> tuple[list[V], list[float]]:
        """The next batch: the oldest waiting step of each session, oldest
        first, at most ``limit``; and how long each waited until ``now``.
        The steps taken stop waiting; the rest keep their places."""
        if limit < 1:
            raise ValueError("a batch takes at least one step")
        taken: list[_Waiting[K, V]] = []
        keys: set[K] = set()
        for waiting in self._waiting:
            if len(taken) == limit:
                break
            if waiting.key not in keys:
                keys.add(waiting.key)
                taken.append(waiting)
        chosen = {id(waiting) for waiting in taken}
        self._waiting = [w for w in self._waiting if id(w) not in chosen]
        return [w.item for w in taken], [max(0.0, now - w.since) for w in taken]


@dataclass
class BatchStats:
    """The batches a hop's batcher ran: a step that found the shard busy
    waited and ran in one (a lone waiting step is a batch of one); a step
    that found it idle ran at once and is not counted here."""

    batches: int = 0
    rows: int = 0
    largest: int = 0
    sizes: Counter[int] = field(default_factory=Counter)
    """rows -> batches of that many rows."""
    wait_s: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS_S))
    """How long each row waited for its batch: the batching window, measured."""

    def count(self, waits: Sequence[float]) -> None:
        """One batch ran, of one row per wait in ``waits``."""
        rows = len(waits)
        self.batches += 1
        self.rows += rows
        self.largest = max(self.largest, rows)
        self.sizes[rows] += 1
        for wait in waits:
            self.wait_s.observe(wait)

    def to_json(self) -> dict[str, Any]:
        mean = self.rows / self.batches if self.batches else 0.0
        return {
            "batches": self.batches,
            "rows": self.rows,
            "mean_rows": round(mean, 3),
            "largest": self.largest,
            "sizes": {str(rows): n for rows, n in sorted(self.sizes.items())},
            "wait_s": self.wait_s.to_json(),
        }


PREFILL_CHUNK_TOKENS: Final = 512
"""The most positions one forward of a prefill takes. A hop with no decode
step due runs a prompt in chunks this long: the KV cache grows chunk by
chunk, each chunk is a forward as big as a matmul needs to run at full
speed (chunked-prefill servers, Sarathi-Serve and vLLM, budget a few
hundred to a few thousand tokens per GPU iteration for the same reason), and a decode step that
arrives meanwhile waits for one chunk, not the whole prompt."""

MIN_CHUNK_TOKENS: Final = 16
"""The fewest positions a chunk takes, however fast the decode batches it
yields to: each chunk pays a thread handoff and the shard's per-layer
Python (about a millisecond or two on the development CPU, as a one-token
step does), so much smaller chunks would spend more on that than on the
prompt."""

CHUNK_EWMA_WEIGHT: Final = 0.5
"""The weight of the latest decode batch in the batch time a chunk is
sized to: steady enough that one slow batch (a GC pause, the other
engineer's process) does not halve the next chunk, quick enough to follow
the batch growing as sessions join."""


@dataclass
class ChunkSizer:
    """How many positions the next chunk of a prefill takes.

    With no decode step due, `PREFILL_CHUNK_TOKENS`. With decode steps due,
    as many as take about one decode batch's time, measured: each decode
    step then waits for at most one chunk beside its own batch, so the
    sessions' inter-token time stays within about twice its time without the
    prompt, while the prompt gets about half the shard. The chunk's cost per
    position is the latest chunk's (it grows as the prompt's attention
    does); before any chunk was measured, or any batch, the smallest.
    ``smallest`` and ``largest`` bound a chunk (a huge ``smallest`` turns
    chunking off: the tests' comparison)."""

    smallest: int = MIN_CHUNK_TOKENS
    largest: int = PREFILL_CHUNK_TOKENS
    batch_s: float | None = None
    """The decode batches' forward time, averaged (`CHUNK_EWMA_WEIGHT`)."""
    per_token_s: float | None = None
    """The latest chunk's forward time per position."""

    def decoded(self, seconds: float) -> None:
        """A decode step or batch took ``seconds``."""
        old = self.batch_s
        self.batch_s = seconds if old is None else old + CHUNK_EWMA_WEIGHT * (seconds - old)

    def chunked(self, tokens: int, seconds: float) -> None:
        """A chunk of ``tokens`` positions took ``seconds``."""
        self.per_token_s = seconds / tokens

    def next(self, remaining: int, *, decoding: bool) -> int:
        """The next chunk's positions, of ``remaining``; ``decoding``: other
        sessions' decode steps are due on this hop."""
        if remaining < 1:
            raise ValueError("a chunk takes at least one position")
        size = self.largest
        if decoding:
            if self.batch_s is None or not self.per_token_s:
                size = self.smallest
            else:
                fits = int(self.batch_s / self.per_token_s)
                size = min(self.largest, max(self.smallest, fits))
        return min(remaining, size)
