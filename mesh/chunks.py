"""Big data-plane messages as bounded chunks, and per-peer byte budgets (sans-IO).

libzmq allocates a whole frame, up to the socket's MAXMSGSIZE, before the
plane learns who sent it, and it cannot cap per peer. So the data plane's
MAXMSGSIZE is one chunk (`FRAME_LIMIT_BYTES`), and a message bigger than
`SINGLE_MESSAGE_BYTES` travels as several ZeroMQ messages (chunks) that the
receiver reassembles only for a peer its owner allows (`Reassembly`). What
the others send costs one chunk at a time, and a token bucket per peer
(`ByteBudgets`) bounds how many bytes of theirs are handled per second.
Everything here is plain data: `now` is passed in, buffers are bytes-like.
Why, and the numbers: docs/design/transport.md#byte-budgets.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "FRAME_LIMIT_BYTES",
    "MAX_FRAMES",
    "PIECE_BYTES",
    "SINGLE_MESSAGE_BYTES",
    "ByteBudgets",
    "ChunkError",
    "Intake",
    "Reassembly",
    "is_chunk",
    "split",
]

Buffer = bytes | memoryview

# --- limits -------------------------------------------------------------------

# The payload of one chunk. A decode step's activations (one row: 32 KiB at
# hidden 8,192 in fp32) and every reply stay far below it, so they never
# chunk; 1 MiB keeps what one unauthorised message can make libzmq allocate
# small, and a long prefill costs one extra header per MiB (negligible).
PIECE_BYTES: Final = 1024 * 1024

# Room for the frames beside a piece: a chunk's own header, or the tensor
# header of an unchunked message (mesh.wire caps that at a few KiB).
FRAME_ROOM_BYTES: Final = 64 * 1024

# The largest message sent as is: one piece plus its header room. Bigger
# ones are chunked; an unchunked message bigger than this is refused.
SINGLE_MESSAGE_BYTES: Final = PIECE_BYTES + FRAME_ROOM_BYTES

# The data plane's inbound ZMQ_MAXMSGSIZE (per frame): libzmq drops the
# connection of a peer that sends a bigger frame before allocating it.
FRAME_LIMIT_BYTES: Final = SINGLE_MESSAGE_BYTES

# Frames one chunked message may have (a tensor message has two).
MAX_FRAMES: Final = 8

# Bytes all partial messages may hold together, whoever sent them: two of
# the largest messages the data plane takes (256 MiB each).
MAX_PENDING_BYTES: Final = 512 * 1024 * 1024

# A partial message whose next chunk has not come for this long is dropped:
# chunks of one message are sent back to back, so a gap this long means the
# rest was lost (the sender's queue was full, or it went away). Well over
# the time one chunk takes on a slow (10 Mbit/s) link.
STALE_AFTER_S: Final = 30.0

# Per peer without a grant: bytes per second handled, and the burst. Far
# above a hop's replies to an entry (a few KiB a step, a prefill's
# commitment at most 576 KiB), so only a flood is held back.
PEER_RATE_BYTES_PER_S: Final = 32 * 1024 * 1024
PEER_BURST_BYTES: Final = 32 * 1024 * 1024

# Token buckets kept at once; beyond it the oldest is forgotten (a full
# bucket, as a new peer gets). Matches the plane's verified-peer table.
MAX_BUCKETS: Final = 4096

# --- the chunk header ---------------------------------------------------------

# A chunk is two frames: this header, then a piece. Its first bytes can
# never begin a tensor header (a CBOR map starts 0xA0..0xBF).
MAGIC: Final = b"\x00SMC"
_HEAD = struct.Struct("<4sQI")  # magic, message id, chunk index
_COUNT = struct.Struct("<B")  # index 0 only: frame count, then each size
_SIZE = struct.Struct("<Q")


class ChunkError(ValueError):
    """A chunk that is not well formed, with its drop reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_chunk(first_frame: Buffer) -> bool:
    """True when a message's first frame is a chunk header (cheap: a prefix)."""
    return first_frame[:4] == MAGIC


def split(
    message_id: int, frames: Sequence[Buffer], piece_bytes: int = PIECE_BYTES
) -> list[list[Buffer]]:
    """``frames`` as chunks ``[header, piece]``. Pieces are views of the
    frames (no copy) and never span two frames; empty frames have none."""
    if not 0 < len(frames) <= MAX_FRAMES:
        raise ValueError(f"a chunked message has 1..{MAX_FRAMES} frames")
    views = [memoryview(frame).cast("B") for frame in frames]
    sizes = b"".join(_SIZE.pack(view.nbytes) for view in views)
    pieces = [v[at : at + piece_bytes] for v in views for at in range(0, v.nbytes, piece_bytes)]
    first = _HEAD.pack(MAGIC, message_id, 0) + _COUNT.pack(len(views)) + sizes
    if not pieces:
        raise ValueError("an empty message is never chunked")
    return [
        [first if index == 0 else _HEAD.pack(MAGIC, message_id, index), piece]
        for index, piece in enumerate(pieces)
    ]


@dataclass(frozen=True)
class Chunk:
    """One decoded chunk header and its piece."""

    message_id: int
    index: int
    sizes: tuple[int, ...] | None  # index 0 only
    piece: Buffer


def decode(frames: Sequence[Buffer]) -> Chunk:
    """A chunk's fields; raises `ChunkError` (``bulk_malformed``)."""
    if len(frames) != 2:
        raise ChunkError("bulk_malformed")
    head = bytes(frames[0][: _HEAD.size + _COUNT.size + MAX_FRAMES * _SIZE.size + 1])
    if len(head) < _HEAD.size:
        raise ChunkError("bulk_malformed")
    _, message_id, index = _HEAD.unpack_from(head)
    if index != 0:
        if len(head) != _HEAD.size:
            raise ChunkError("bulk_malformed")
        return Chunk(message_id, index, None, frames[1])
    if len(head) < _HEAD.size + _COUNT.size:
        raise ChunkError("bulk_malformed")
    (count,) = _COUNT.unpack_from(head, _HEAD.size)
    start = _HEAD.size + _COUNT.size
    if not 0 < count <= MAX_FRAMES or len(head) != start + count * _SIZE.size:
        raise ChunkError("bulk_malformed")
    sizes = tuple(_SIZE.unpack_from(head, start + i * _SIZE.size)[0] for i in range(count))
    return Chunk(message_id, 0, sizes, frames[1])


# --- reassembly -----------------------------------------------------------------


@dataclass
class _Partial:
    """One peer's message in progress."""

    message_id: int
    sizes: tuple[int, ...]
    total: int
    last_at: float
    next_index: int = 0
    frame: int = 0  # the frame the next piece belongs to
    filled: int = 0  # bytes of that frame so far
    held: int = 0
    pieces: list[list[Buffer]] = field(default_factory=list)


class Reassembly:
    """Chunks back into messages, only for peers ``allowance(peer)`` grants.

    ``allowance(peer)`` is the largest message that peer may send now (0:
    none bigger than one chunk); it is asked once per message, at its first
    chunk, so the rest of a refused message costs a dict lookup a chunk. A
    peer has at most one message in progress (its chunks come in order on
    one connection; a new first chunk ends the old message), and all partial
    messages together reserve at most ``max_pending`` bytes. Every chunk not
    used goes to ``drop(reason)``: ``bulk_refused`` (no grant for it),
    ``bulk_busy`` (no room), ``bulk_incomplete`` (a message given up:
    replaced, out of turn or stale) or ``bulk_malformed``.
    """

    def __init__(
        self,
        allowance: Callable[[bytes], int],
        drop: Callable[[str], None],
        *,
        max_message: int,
        max_pending: int = MAX_PENDING_BYTES,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        self.allowance = allowance
        self.max_message = max_message
        self.max_pending = max_pending
        self.stale_after_s = stale_after_s
        self.pending_bytes = 0
        self._drop = drop
        self._partials: dict[bytes, _Partial] = {}

    def add(self, peer: bytes, frames: Sequence[Buffer], now: float) -> list[bytes] | None:
        """Take one chunk from ``peer``: the whole message's frames once its
        last chunk is in, else None."""
        try:
            chunk = decode(frames)
        except ChunkError as exc:
            self._refuse(peer, exc.reason)
            return None
        if chunk.index == 0:
            assert chunk.sizes is not None
            if not self._start(peer, chunk.message_id, chunk.sizes, now):
                return None
        partial = self._partials.get(peer)
        if partial is None:
            self._drop("bulk_refused")  # the rest of a message refused at its start
            return None
        if (chunk.message_id, chunk.index) != (partial.message_id, partial.next_index):
            self._refuse(peer, "bulk_incomplete")
            return None
        return self._fill(peer, partial, chunk.piece, now)

    def expire(self, now: float) -> None:
        """Give up on partial messages idle for ``stale_after_s``."""
        for peer, partial in list(self._partials.items()):
            if now - partial.last_at >= self.stale_after_s:
                self._refuse(peer, "bulk_incomplete")

    @property
    def in_progress(self) -> int:
        """Peers with a message half received."""
        return len(self._partials)

    def _start(self, peer: bytes, message_id: int, sizes: tuple[int, ...], now: float) -> bool:
        if peer in self._partials:
            self._refuse(peer, "bulk_incomplete")
        total = sum(sizes)
        if total == 0:
            self._drop("bulk_malformed")
            return False
        if total > self.max_message or total > self.allowance(peer):
            self._drop("bulk_refused")
            return False
        if self.pending_bytes + total > self.max_pending:
            self._drop("bulk_busy")
            return False
        self._partials[peer] = _Partial(message_id, sizes, total, now)
        self.pending_bytes += total
        return True

    def _fill(
        self, peer: bytes, partial: _Partial, piece: Buffer, now: float
    ) -> list[bytes] | None:
        """Append one piece where the frame sizes say it goes."""
        size = memoryview(piece).nbytes
        sizes = partial.sizes
        while partial.frame < len(sizes) and partial.filled == sizes[partial.frame]:
            partial.frame += 1
            partial.filled = 0
        if size == 0 or partial.frame >= len(sizes) or partial.filled + size > sizes[partial.frame]:
            self._refuse(peer, "bulk_malformed")
            return None
        while len(partial.pieces) <= partial.frame:
            partial.pieces.append([])
        partial.pieces[partial.frame].append(piece)
        partial.filled += size
        partial.held += size
        partial.next_index += 1
        partial.last_at = now
        if partial.held < partial.total:
            return None
        self._forget(peer)
        partial.pieces.extend([] for _ in range(len(sizes) - len(partial.pieces)))
        # The one copy of a chunked message: pieces into each frame's bytes.
        return [b"".join(parts) for parts in partial.pieces]

    def _refuse(self, peer: bytes, reason: str) -> None:
        """Count ``reason`` and give up on the peer's message in progress."""
        self._forget(peer)
        self._drop(reason)

    def _forget(self, peer: bytes) -> None:
        partial = self._partials.pop(peer, None)
        if partial is not None:
            self.pending_bytes -= partial.total


# --- byte budgets ---------------------------------------------------------------


class ByteBudgets:
    """A token bucket of bytes per peer: ``rate`` a second, up to ``burst``.

    ``take`` is on every small message's path, so it is a dict lookup and a
    few float operations; a peer seen for the first time starts full.
    """

    def __init__(
        self,
        rate: float = PEER_RATE_BYTES_PER_S,
        burst: float = PEER_BURST_BYTES,
        *,
        max_peers: int = MAX_BUCKETS,
    ) -> None:
        if rate <= 0 or burst <= 0 or max_peers <= 0:
            raise ValueError("rate, burst and max_peers must be positive")
        self.rate = rate
        self.burst = burst
        self.max_peers = max_peers
        self._buckets: dict[bytes, list[float]] = {}  # peer -> [tokens, at]

    def take(self, peer: bytes, nbytes: int, now: float) -> bool:
        """Charge ``nbytes`` to ``peer`` at time ``now``; False (nothing
        charged) when its bucket does not hold that many."""
        bucket = self._buckets.get(peer)
        if bucket is None:
            if len(self._buckets) >= self.max_peers:
                del self._buckets[next(iter(self._buckets))]
            bucket = self._buckets[peer] = [self.burst, now]
        tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
        bucket[1] = now
        if tokens < nbytes:
            bucket[0] = tokens
            return False
        bucket[0] = tokens - nbytes
        return True


# --- the intake: what a chunked plane does with each inbound message ------------


def no_bulk(_peer: bytes) -> int:
    """The allowance of a plane whose owner grants nobody: every message
    of every peer stays within one chunk."""
    return 0


class Intake:
    """Every inbound message of a chunked plane, from an authenticated peer.

    Each message's bytes are charged to the peer's `ByteBudgets`; one over
    budget is dropped (``over_budget``) unless ``allowance(peer)`` grants
    the peer big messages now (a hop's session takes a prefill from it: its
    bytes are bounded by the grant, not the rate). A chunk goes to the
    `Reassembly`; an unchunked message bigger than `SINGLE_MESSAGE_BYTES`
    is dropped (``oversized``): the sender would have chunked it.
    ``allowance`` may be replaced at any time (the plane's owner sets it).
    """

    def __init__(
        self,
        drop: Callable[[str], None],
        *,
        max_message: int,
        budgets: ByteBudgets | None = None,
        max_pending: int = MAX_PENDING_BYTES,
    ) -> None:
        self.allowance: Callable[[bytes], int] = no_bulk
        self.budgets = budgets or ByteBudgets()
        self.reassembly = Reassembly(
            lambda peer: self.allowance(peer),
            drop,
            max_message=max_message,
            max_pending=max_pending,
        )
        self._drop = drop

    def take(self, peer: bytes, frames: Sequence[Buffer], now: float) -> list[bytes] | None:
        """The message's frames as bytes once it is whole (at once, unless
        it is chunked), or None: dropped and counted, or a chunk kept."""
        size = sum(memoryview(frame).nbytes for frame in frames)
        if not self.budgets.take(peer, size, now) and self.allowance(peer) <= 0:
            self._drop("over_budget")
            return None
        if frames and is_chunk(frames[0]):
            return self.reassembly.add(peer, frames, now)
        if size > SINGLE_MESSAGE_BYTES:
            self._drop("oversized")
            return None
        return [bytes(frame) for frame in frames]
