"""The drain: who can take this node's span, and what a stop does with open sessions."""

from __future__ import annotations

import signal
from typing import Any, cast

import trio

from mesh.coverage import CoverageKey, CoverageMap, ModelCoverage, ServingNode
from mesh.records import Assignment
from runtime.node import drain as drain_module
from runtime.node.drain import (
    DRAIN_GRACE_S,
    HAND_OVER_WAIT_S,
    drain,
    others_hold,
    span_replaceable,
    stop_on_signal,
)

ME, A, B = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
MODEL = "m"


def serving(node: bytes, layers: tuple[int, int], state: str = "alive") -> ServingNode:
    return ServingNode(node, state, layers, "fp32", 100.0, 10.0)


def coverage(*nodes: ServingNode, model: str = MODEL) -> CoverageMap:
    key = CoverageKey(model, "ab" * 32, "fp32")
    entry = ModelCoverage(model, "ab" * 32, "fp32", 8, ((0, 8),), (), (1,) * 8, nodes, True)
    return CoverageMap({key: entry}, {})


def test_others_hold_needs_every_layer_of_the_span_on_a_live_other_node() -> None:
    mine = serving(ME, (0, 4))
    assert others_hold(coverage(mine, serving(A, (0, 4))), ME, MODEL, (0, 4))
    assert others_hold(coverage(mine, serving(A, (0, 2)), serving(B, (2, 8))), ME, MODEL, (0, 4))
    assert not others_hold(coverage(mine, serving(A, (0, 3))), ME, MODEL, (0, 4)), "layer 3"
    assert not others_hold(coverage(mine, serving(A, (0, 4), "dead")), ME, MODEL, (0, 4))
    assert not others_hold(coverage(mine), ME, MODEL, (0, 4)), "nobody else"


def test_others_hold_only_in_the_variant_this_node_serves() -> None:
    assert not others_hold(coverage(serving(A, (0, 4))), ME, MODEL, (0, 4)), "not mine"
    assert not others_hold(coverage(serving(ME, (0, 4))), ME, "other", (0, 4))


class Admitted:
    def __init__(self, assignment: Assignment | None) -> None:
        self._assignment = assignment

    def assignment(self) -> Assignment | None:
        return self._assignment


def test_span_replaceable_reads_the_served_assignment() -> None:
    shard = Assignment(MODEL, (0, 4), "fp32", "operator", False, 1)
    held = coverage(serving(ME, (0, 4)), serving(A, (0, 4)))
    asked: list[str] = []

    def view() -> CoverageMap:
        asked.append("coverage")
        return held

    assert span_replaceable(cast(Any, Admitted(shard)), view, ME)
    assert not span_replaceable(None, view, ME)
    assert not span_replaceable(cast(Any, Admitted(None)), view, ME)
    assert asked == ["coverage"], "coverage is built only when there is a span to cover"


class HopStub:
    """A hop server's drain surface: `leaving`, open `sessions`, `hand_over`."""

    def __init__(self, sessions: int) -> None:
        self.leaving = False
        self.sessions = sessions
        self.handed = 0

    def hand_over(self) -> int:
        self.handed = self.sessions
        return self.sessions


async def test_no_shard_nothing_to_drain() -> None:
    withdrawn: list[bool] = []
    await drain(None, withdraw=lambda: withdrawn.append(True), replaceable=lambda: True)
    assert withdrawn == []


async def test_a_replaceable_node_hands_its_sessions_over(autojump_clock: object) -> None:
    hop = HopStub(2)
    order: list[str] = []

    def replaceable() -> bool:
        order.append("asked")
        return True

    def withdraw() -> None:
        order.append("withdrawn")
        assert hop.leaving, "refuses new sessions before it withdraws"

    async def entries_close() -> None:
        await trio.sleep(1.0)
        hop.sessions = 0

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(entries_close)
        await drain(cast(Any, hop), withdraw=withdraw, replaceable=replaceable)
    assert order == ["asked", "withdrawn"], "asked before its own record stops listing it"
    assert hop.handed == 2
    assert 1.0 <= trio.current_time() - start < HAND_OVER_WAIT_S


async def test_the_only_holder_serves_its_sessions_to_their_end(autojump_clock: object) -> None:
    hop = HopStub(1)
    start = trio.current_time()
    await drain(cast(Any, hop), withdraw=lambda: None, replaceable=lambda: False, grace_s=30.0)
    assert hop.handed == 0
    assert hop.sessions == 1, "a stuck session does not hold the stop forever"
    assert 30.0 <= trio.current_time() - start < 31.0
    assert DRAIN_GRACE_S > HAND_OVER_WAIT_S


async def test_a_second_signal_cuts_the_drain_short(autojump_clock: object) -> None:
    send, receive = trio.open_memory_channel[int](4)
    hop = HopStub(1)
    served: list[HopStub | None] = [None]  # the shard is admitted after the node is up
    left: list[float] = []

    async def leave() -> None:
        left.append(trio.current_time())

    async def signals() -> Any:
        async for signum in receive:
            yield signum

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: stop_on_signal(
                signals(),
                nursery,
                lambda: cast(Any, served[0]),
                withdraw=lambda: None,
                replaceable=lambda: False,
                leave=leave,
            )
        )
        await trio.sleep(5.0)
        served[0] = hop
        assert not hop.leaving, "nothing happens before the first signal"
        start = trio.current_time()
        send.send_nowait(signal.SIGTERM)
        await trio.sleep(10.0)
        assert hop.leaving and not left, "draining: the only holder waits for its session"
        send.send_nowait(signal.SIGINT)
        await trio.sleep(drain_module.POLL_S)
        assert left and left[0] - start < DRAIN_GRACE_S
        nursery.cancel_scope.cancel()
