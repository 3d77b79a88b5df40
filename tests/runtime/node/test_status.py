"""The status document's drop counters, merged from every source."""

from __future__ import annotations

from collections import Counter

from runtime.node.status import merged_drops


def test_drops_merge_named_and_prefixed_by_source_sorted_and_without_zeros() -> None:
    transport = Counter({"control.oversized": 2, "data.bad_frame": 0})
    local = Counter({"engine.bad_field": 1, "control.oversized": 1})
    by_source = {
        "raft": Counter({"stale_term": 3}),
        "placement": Counter({"unknown_model": 1, "nothing": 0}),
        "wire": {"truncated": 4},
    }
    merged = merged_drops((transport, local), by_source)
    assert merged == {
        "control.oversized": 3,
        "engine.bad_field": 1,
        "placement.unknown_model": 1,
        "raft.stale_term": 3,
        "wire.truncated": 4,
    }
    assert list(merged) == sorted(merged)


def test_no_drops_is_an_empty_map() -> None:
    assert merged_drops((Counter(), Counter()), {"raft": Counter()}) == {}
