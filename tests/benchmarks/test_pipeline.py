"""How `benchmarks.pipeline --pin` shares out the cores.

What pinning does to a node's threads is checked on a real process in
tests/processes/test_node.py; this is the split itself.
"""

from __future__ import annotations

import pytest

from benchmarks.pipeline import PIN_GROUPS, pin_sets


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
