"""The direct-paths benchmark's reading: pairs by NAT kind, a direction
direct when either end holds the path, a node settled when no punch is in
flight. (The whole benchmark runs in a lab: `python -m benchmarks.direct_paths`;
tests/runtime/node/test_direct_paths.py and tests/processes/test_relays.py
check punches through the same NATs.)"""

from __future__ import annotations

from benchmarks.direct_paths import EXPECTED, fractions, pair_kind, settled


def test_pairs_are_named_by_their_nat_kinds_in_one_order() -> None:
    assert pair_kind("p1", "a") == pair_kind("a", "p1") == "public_pp"
    assert pair_kind("s2", "p1") == "pp_sym"
    assert pair_kind("s1", "s2") == "sym_sym"


def test_a_direction_is_direct_when_either_end_holds_the_path() -> None:
    as_measured = {"a": {"p1", "p2", "s1", "s2"}, "p1": {"p2"}, "p2": set(), "s1": set()}
    assert fractions(as_measured) == EXPECTED
    assert fractions({"a": {"p1"}})["public_pp"] == 0.5, "p2 unreached both ways"


def test_a_node_is_settled_once_every_punch_it_tried_ended() -> None:
    def view(**counters: int) -> dict[str, object]:
        return {"relays": {"direct": {"counters": counters}}}

    assert not settled(view()), "nothing tried yet"
    assert not settled(view(attempts=3, direct_simultaneous=1, failed_timeout=1))
    assert settled(view(attempts=3, direct_simultaneous=1, failed_timeout=2, lost=1))
