"""The queue of updates waiting to ride on outgoing messages.

Every update a node learns (or makes) is sent a limited number of times,
least-sent first, newest first among equally-sent ones, within a byte budget
per message; newer news about the same node replaces older news outright.
This is memberlist's transmit-limited queue, organised by transmit count so
that taking a message's worth costs time proportional to what is taken, not
to the queue's length: after a partition heals, a node may hold a thousand
pending updates and still sends dozens of messages a second.
"""

from __future__ import annotations

from collections.abc import Hashable

from mesh.messages import Update

MAX_SKIPPED = 16
"""Updates too big for the rest of a message that are passed over before
the message is closed; bounds the scan when the budget is nearly spent."""


class _Entry:
    __slots__ = ("size", "transmits", "update")

    def __init__(self, update: Update, size: int) -> None:
        self.update = update
        self.size = size
        self.transmits = 0


class BroadcastQueue:
    """Pending updates, bucketed by how often each has been sent."""

    def __init__(self) -> None:
        # _levels[t] holds the entries sent t times, oldest first (dicts keep
        # insertion order); an entry moves up one level each time it is sent.
        self._levels: list[dict[Hashable, _Entry]] = [{}]
        self._level_of: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self._level_of)

    def __bool__(self) -> bool:
        return bool(self._level_of)

    def put(self, key: Hashable, update: Update, size: int) -> None:
        """Queue `update` under `key`, replacing whatever that key held."""
        level = self._level_of.pop(key, None)
        if level is not None:
            del self._levels[level][key]
        self._levels[0][key] = _Entry(update, size)
        self._level_of[key] = 0

    def take(self, budget: int, limit: int) -> tuple[Update, ...]:
        """Updates for one message of at most `budget` bytes (at least one
        update if any is queued); each taken update counts one transmit and
        leaves the queue after `limit` of them."""
        chosen: list[tuple[int, Hashable, _Entry]] = []
        skipped = 0
        for level, bucket in enumerate(self._levels):
            if not bucket:
                continue
            for key in reversed(bucket):
                entry = bucket[key]
                if entry.size > budget and chosen:
                    skipped += 1
                    if skipped > MAX_SKIPPED:
                        break
                    continue
                chosen.append((level, key, entry))
                budget -= entry.size
                if budget <= 0:
                    break
            if budget <= 0 or skipped > MAX_SKIPPED:
                break
        for level, key, entry in chosen:
            del self._levels[level][key]
            entry.transmits += 1
            if entry.transmits >= limit:
                del self._level_of[key]
                continue
            if entry.transmits == len(self._levels):
                self._levels.append({})
            self._levels[entry.transmits][key] = entry
            self._level_of[key] = entry.transmits
        return tuple(entry.update for _, _, entry in chosen)
