"""The placement simulation's trace: a digest of every noted event, the
lines when kept, and the timeline merged with Raft's and SWIM's."""

from __future__ import annotations

import hashlib

from simulations.loop import EventLoop
from simulations.placement_trace import Trace, merge_timeline


def test_the_digest_covers_every_line_stamped_with_the_loop_time() -> None:
    loop = EventLoop()
    kept, unkept = Trace(loop, keep=True), Trace(loop)
    for trace in (kept, unkept):
        trace.note("load 0 y (0, 32)")
    loop.call_at(1.25, lambda: [trace.note("crash 3") for trace in (kept, unkept)])
    loop.run_until(2.0)
    assert kept.lines == ["0.000000 load 0 y (0, 32)", "1.250000 crash 3"]
    assert unkept.lines is None
    expected = hashlib.sha256(b"0.000000 load 0 y (0, 32)\n1.250000 crash 3\n").hexdigest()
    assert kept.hexdigest() == unkept.hexdigest() == expected


def test_a_different_event_gives_a_different_digest() -> None:
    one, other = Trace(EventLoop()), Trace(EventLoop())
    one.note("caught 1")
    other.note("caught 2")
    assert one.hexdigest() != other.hexdigest()


def test_the_timeline_is_in_time_order_then_raft_placement_swim_at_equal_times() -> None:
    raft = ["1.000000 n0 leader 1", "3.000000 n1 vote 2"]
    mine = ["1.000000 load 0 y (0, 32)", "2.000000 crash 0"]
    swim = ["1.000000 4 suspect 5 1", "0.500000 4 alive 5 0"]
    assert merge_timeline(raft, mine, swim) == [
        "0.500000 swim 4 alive 5 0",
        "1.000000 n0 leader 1",
        "1.000000 load 0 y (0, 32)",
        "1.000000 swim 4 suspect 5 1",
        "2.000000 crash 0",
        "3.000000 n1 vote 2",
    ]


def test_an_empty_run_has_an_empty_timeline() -> None:
    assert merge_timeline([], [], []) == []
