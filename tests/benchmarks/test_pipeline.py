"""How `benchmarks.pipeline --pin` shares out the cores, the order its
measurements are taken in, and how it counts batched steps.

What pinning does to a node's threads is checked on a real process in
tests/processes/test_node.py; this is the split itself.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.pipeline import PIN_GROUPS, _batched_rows, _interleaved, pin_sets, spans


def test_sixteen_cores_make_four_disjoint_sets_of_four() -> None:
    sets = pin_sets(range(16))
    assert len(sets) == PIN_GROUPS == 4
    assert all(len(cores) == 4 for cores in sets)
    assert frozenset().union(*sets) == frozenset(range(16))
    assert sets[0] == {0, 1, 2, 3}  # this process takes the lowest cores


def test_leftover_cores_go_unused_so_every_set_is_alike() -> None:
    sets = pin_sets([3, 5, 7, 9, 11, 13, 15])  # any cores, any order
    assert [sorted(cores) for cores in sets] == [[3], [5], [7], [9]]


def test_too_few_cores_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="needs at least 4 cores; this process may use 2"):
        pin_sets({0, 1})


def test_spans_cut_the_layers_into_contiguous_hops() -> None:
    assert spans(8, 1) == [(0, 8)]
    assert spans(8, 3) == [(0, 3), (3, 5), (5, 8)]
    assert spans(30, 3) == [(0, 10), (10, 20), (20, 30)]


def test_the_anchor_brackets_each_swarm_and_plaintext_brackets_curve() -> None:
    """So each ratio divides by measurements taken right around its swarm."""
    taken: list[str] = []

    def anchor() -> float:
        taken.append("anchor")
        return 100.0 + len(taken)

    def swarm(hops: int, curve: bool) -> dict[str, Any]:
        taken.append(f"{hops}hop-{'curve' if curve else 'plain'}")
        return {"hops": hops, "curve": curve}

    runs = _interleaved(anchor, swarm, curve_control=True)
    assert taken == [
        "anchor", "1hop-curve", "anchor", "3hop-plain", "3hop-curve", "3hop-plain", "anchor"
    ]  # fmt: skip
    assert runs.singles == [101.0, 103.0, 107.0]
    assert runs.one == {"hops": 1, "curve": True} and runs.three == {"hops": 3, "curve": True}
    assert runs.plain == [{"hops": 3, "curve": False}] * 2
    taken.clear()
    assert _interleaved(anchor, swarm, curve_control=False).plain == []
    assert taken == ["anchor", "1hop-curve", "anchor", "3hop-curve", "anchor"]


def test_batched_steps_are_read_from_each_nodes_status() -> None:
    """A node that did not answer, or serves no shard, ran no batch."""
    assert _batched_rows({"hop": {"batching": {"batches": 2, "rows": 5}}}) == 5
    assert _batched_rows({"hop": None}) == 0
    assert _batched_rows(None) == 0
