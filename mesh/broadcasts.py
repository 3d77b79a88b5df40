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

import sys
from collections.abc import Hashable

from mesh.messages import Update

SHRINK_BYTES = 4096
"""An emptied level whose dict has grown past this (about 150 entries'
worth) is replaced by a new one, giving its table back; smaller ones are
kept, since growing a dict again from nothing costs more than it saves."""

MAX_SKIPPED = 16
"""Updates too big for the rest of a message that are passed over before
the message is closed; bounds the scan when the budget is nearly spent."""


class BroadcastQueue:
    """Pending updates, bucketed by how often each has been sent."""

    def __init__(self) -> None:
        # _levels[t] maps key -> (update, size) for the updates sent t times,
        # oldest first (dicts keep insertion order); an update moves up one
        # level each time it is sent, so its level is its transmit count.
        self._levels: list[dict[Hashable, tuple[Update, int]]] = [{}]
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
        self._levels[0][key] = (update, size)
        self._level_of[key] = 0

    def take(self, budget: int, limit: int) -> tuple[Update, ...]:
        """Updates for one message of at most `budget` bytes (at least one
        update if any is queued); each taken update counts one transmit and
        leaves the queue after `limit` of them."""
        taken: list[Update] = []
        # (level, keys picked from it): the scan reads, the moves come after,
        # since a dict cannot change while it is iterated.
        picks: list[tuple[int, list[Hashable]]] = []
        skipped = 0
        for level, bucket in enumerate(self._levels):
            if not bucket:
                continue
            keys: list[Hashable] = []
            for key, (update, size) in reversed(bucket.items()):
                if size > budget and taken:
                    skipped += 1
                    if skipped > MAX_SKIPPED:
                        break
                    continue
                keys.append(key)
                taken.append(update)
                budget -= size
                if budget <= 0:
                    break
            if keys:
                picks.append((level, keys))
            if budget <= 0 or skipped > MAX_SKIPPED:
                break
        for level, keys in picks:
            self._promote(level, keys, limit)
        return tuple(taken)

    def _promote(self, level: int, keys: list[Hashable], limit: int) -> None:
        """Count one more transmit for `keys`, all now at `level`."""
        bucket = self._levels[level]
        sent = level + 1
        level_of = self._level_of
        if sent >= limit:
            for key in keys:
                del bucket[key]
                del level_of[key]
        else:
            if sent == len(self._levels):
                self._levels.append({})
            above = self._levels[sent]
            for key in keys:
                above[key] = bucket.pop(key)
                level_of[key] = sent
        if not bucket and sys.getsizeof(bucket) > SHRINK_BYTES:
            # A dict keeps its table at the largest size it ever had: after
            # a healed partition a level holds a thousand updates for a
            # moment and nothing after, in every one of a thousand nodes.
            self._levels[level] = {}
