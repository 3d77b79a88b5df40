"""The piggyback queue against its definition.

`BroadcastQueue` buckets updates by transmit count so that taking a
message's worth costs what is taken. The reference below is the definition
written the slow, obvious way: sort everything by (times sent, newest
first), walk the sorted list with the byte budget. Random sequences of puts
and takes must give the same messages from both, update for update.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.broadcasts import MAX_SKIPPED, BroadcastQueue


class ReferenceQueue:
    """Every pending update with its transmit count and the moment it
    entered that count (a later moment is newer)."""

    def __init__(self) -> None:
        self._clock = itertools.count()
        self._pending: dict[str, list] = {}  # key -> [update, size, transmits, since]

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, key: str, update: str, size: int) -> None:
        self._pending.pop(key, None)
        self._pending[key] = [update, size, 0, next(self._clock)]

    def take(self, budget: int, limit: int) -> tuple[str, ...]:
        order = sorted(self._pending.items(), key=lambda kv: (kv[1][2], -kv[1][3]))
        chosen: list[str] = []
        skipped = 0
        for key, (_, size, _, _) in order:
            if size > budget and chosen:
                skipped += 1
                if skipped > MAX_SKIPPED:
                    break
                continue
            chosen.append(key)
            budget -= size
            if budget <= 0:
                break
        taken = []
        for key in chosen:
            entry = self._pending[key]
            taken.append(entry[0])
            entry[2] += 1
            entry[3] = next(self._clock)
            if entry[2] >= limit:
                del self._pending[key]
        return tuple(taken)


PUT = st.tuples(st.just("put"), st.integers(0, 30), st.integers(1, 400))
TAKE = st.tuples(st.just("take"), st.integers(1, 2000), st.integers(1, 6))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(PUT, TAKE), max_size=200))
def test_takes_match_the_sorted_definition(operations: list[tuple[str, int, int]]) -> None:
    queue, reference = BroadcastQueue(), ReferenceQueue()
    for step, (op, a, b) in enumerate(operations):
        if op == "put":
            key, update = f"k{a}", f"u{step}"
            queue.put(key, update, b)
            reference.put(key, update, b)
        else:
            assert queue.take(a, b) == reference.take(a, b), f"operation {step}"
        assert len(queue) == len(reference)
        assert bool(queue) == bool(reference)


def test_a_message_holds_at_least_one_update_even_if_it_is_too_big() -> None:
    queue = BroadcastQueue()
    queue.put("a", "huge", 10_000)
    assert queue.take(100, limit=3) == ("huge",)


def test_newer_news_replaces_older_news_of_the_same_key() -> None:
    queue = BroadcastQueue()
    queue.put("node", "old", 10)
    queue.take(100, limit=5)
    queue.put("node", "new", 10)
    assert len(queue) == 1
    assert queue.take(100, limit=5) == ("new",)


def test_an_update_leaves_after_its_limit_of_transmits() -> None:
    queue = BroadcastQueue()
    queue.put("a", "x", 10)
    assert [queue.take(100, limit=3) for _ in range(4)] == [("x",), ("x",), ("x",), ()]
    assert not queue
