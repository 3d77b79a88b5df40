"""What libzmq holds for each connection that its plane was never handed (sans-IO).

libzmq hands a plane a multi-frame message only when its last frame is in,
and until then keeps every frame; no socket option bounds how many frames
one message may have (`MAXMSGSIZE` is per frame, the high-water mark counts
whole messages). So a peer that sends a message of many frames, and never
its last, makes a node hold all of it. This ledger finds such connections
from two counts per connection: the bytes libzmq has read from the kernel
(the driver reads them off the socket, `mesh.held_guard`) and the bytes of
the messages the plane took from it. What was read and not taken is held:
complete messages waiting for the plane (at most the receive high-water
mark) plus the message in progress. A connection holding more than any
honest peer can make it hold is to be cut; so is the largest *stalled*
holder (it grew, and the plane took nothing from it, since the last
reading: a message whose last frame has not come) while the stalled ones
together hold more than the plane's total. Complete messages that wait for
a busy plane are not stalled: the plane takes from every connection in
turn. No clock, sockets or randomness: the driver passes the time and the
readings in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "COMMAND_BYTES_PER_S",
    "FRAME_WIRE_BYTES",
    "HeldBytes",
]

FRAME_WIRE_BYTES: Final = 64
"""A frame's bytes on the wire beyond its payload, at most: a 9-byte frame
header, and under CURVE the MESSAGE command's name (8), nonce (8), MAC (16)
and flags (1). Counting the most keeps an honest connection's held bytes at
or above the truth only by what its frames really cost."""

COMMAND_BYTES_PER_S: Final = 4096
"""ZMTP commands (the handshake, PING and PONG, about 50 bytes each with
CURVE, a few a second) are read and never handed to the plane; this much a
second of what is read is let go as theirs. An attacker's message gains as
much, which is nothing next to the limits."""


@dataclass
class _Connection:
    read: int = 0  # bytes libzmq had read off the socket at the last reading
    taken: int = 0  # wire bytes of the messages the plane took since then
    held: int = 0  # read and not taken, as of the last reading
    stalled: bool = False  # it grew, and nothing was taken, between the last two readings
    at: float | None = None  # when it was last read


class HeldBytes:
    """Held bytes per connection (keyed by the driver: libzmq's fd), and
    which connections to cut.

    `limit` is one connection's most (above what an honest peer can make
    libzmq hold); `total` is the stalled connections' together, so many
    keys that each stay under `limit` are bounded as well.
    """

    def __init__(self, limit: int, total: int) -> None:
        if not 0 < limit <= total:
            raise ValueError(f"need 0 < limit <= total, got {limit} and {total}")
        self.limit = limit
        self.total = total
        self.cuts = 0
        self._connections: dict[int, _Connection] = {}

    def opened(self, connection: int, read_bytes: int) -> None:
        """A new connection (its number may be an old one's, reused), of
        which libzmq has read `read_bytes` so far. Those are not counted:
        the plane may have taken messages from it before it learnt of it."""
        self._connections[connection] = _Connection(read=read_bytes)

    def closed(self, connection: int) -> None:
        self._connections.pop(connection, None)

    def took(self, connection: int, payload_bytes: int, frames: int) -> None:
        """The plane took a message of `frames` frames from `connection`."""
        known = self._connections.get(connection)
        if known is not None:
            known.taken += payload_bytes + frames * FRAME_WIRE_BYTES

    def read(self, connection: int, read_bytes: int, now: float) -> None:
        """The driver's reading: libzmq has read `read_bytes` off the
        connection's socket so far. A count below the last one is a new
        connection under a reused number, which starts afresh from it."""
        known = self._connections.get(connection)
        if known is None or read_bytes < known.read:
            self.opened(connection, read_bytes)
            return
        let_go = 0.0 if known.at is None else (now - known.at) * COMMAND_BYTES_PER_S
        known.stalled = known.taken == 0 and read_bytes > known.read
        known.held = max(0, int(known.held + read_bytes - known.read - known.taken - let_go))
        known.read, known.taken, known.at = read_bytes, 0, now

    def held(self, connection: int) -> int:
        known = self._connections.get(connection)
        return 0 if known is None else known.held

    def held_in_all(self) -> int:
        return sum(known.held for known in self._connections.values())

    def largest(self) -> int:
        """The most any one connection holds."""
        return max((known.held for known in self._connections.values()), default=0)

    def to_cut(self) -> list[int]:
        """The connections to cut now: each over `limit`, then the largest
        stalled holders until the stalled rest are within `total`. They
        count as cut and leave the ledger (the driver closes them; a
        reconnection is a new connection)."""
        cut: list[int] = []
        stalled: list[tuple[int, int]] = []
        held = 0  # by the stalled connections not cut already
        for connection, known in self._connections.items():
            if known.held > self.limit:
                cut.append(connection)
            elif known.stalled:
                stalled.append((known.held, connection))
                held += known.held
        if held > self.total:
            for largest, connection in sorted(stalled, reverse=True):
                if held <= self.total:
                    break
                cut.append(connection)
                held -= largest
        for connection in cut:
            self.closed(connection)
        self.cuts += len(cut)
        return cut

    def __len__(self) -> int:
        return len(self._connections)
