"""Slow hops (issue 15): a step's deadline follows the hops' measured speed,
and a step that runs out anyway is routed around the hop that held it up.

The first section runs real shards of the tiny model over real loopback
planes (`tests.runtime.inference.test_engine`'s nodes), some made slower per token by a
`PacedShard` (the real forward, then a sleep: a slower machine, emulated).
The second drives the chat service's re-route decision on the real
coverage builder and route finder, with membership states set by the test
and trio's autojump clock standing in for the waits.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio

from benchmarks.pipeline import PacedShard, fixed_timeouts, measured_pace
from mesh.coverage import build_coverage
from mesh.records import Addresses, Assignment, BackendInfo, CapabilityReport, NodeRecord
from mesh.routes import Route
from runtime.inference.chain import ChainHop, Failure, Pipeline, PipelineError
from runtime.inference.chat import REROUTE_WAIT_S, ArtifactStore, ChatService
from runtime.inference.deadlines import DEFAULT_DEADLINES, Deadlines, Stall
from runtime.model.backends.base import ShardBackend
from runtime.model.sampling import SamplingParams
from tests.runtime.inference.test_engine import (
    MODEL,
    SPANS,
    Node,
    _load,
    bare_plane,
    collect,
    settle,
    start_chain,
    start_node,
)

LAYERS = SPANS[-1][1]
DIGEST = "ab" * 32
FAST_S_PER_TOKEN = 0.0005
SLOW_FACTOR = 20
"""The slow hop: 10 ms per position, 20 times the others' 0.5 ms. A
512-token prefill then takes it 5.1 s, past the fixed 2 s + 5 ms per token
(4.56 s) the entry used to give a whole chain, and far within what its
measured speed gives it."""
LONG_PROMPT = 512
NEW_TOKENS = 4
STUCK_S_PER_TOKEN = 0.4
"""A hop that got slow after its doctor measured it: 2.8 s for the 7-token
prompt, where its figures promise milliseconds."""
STEADY = Deadlines(floor_s=1.0)
"""A floor of 1 s: the stuck hop overruns it, while the healthy hops of a
loaded CI box report their milliseconds of prefill well within it."""


@pytest.fixture(scope="module")
def shards(qwen3_dir: Path) -> dict[tuple[int, int], ShardBackend]:
    return {span: _load(qwen3_dir, span, "torch") for span in SPANS}


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread while a test measures speeds: the tiny model
    gains nothing from more, and on a loaded 2-core box two threads
    spinning for each other make every forward ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- real hops --------------------------------------------------------------------


@pytest.mark.slow  # ~13 s: the inner loop (`make check`) leaves it to `make test`
async def test_a_512_token_prompt_through_a_20x_slower_hop_completes_where_fixed_timeouts_failed(
    shards: dict[tuple[int, int], ShardBackend], one_thread: None
) -> None:
    paces = [FAST_S_PER_TOKEN, FAST_S_PER_TOKEN * SLOW_FACTOR, FAST_S_PER_TOKEN]
    paced = [PacedShard(shards[span], s) for span, s in zip(SPANS, paces, strict=True)]
    # What each node's doctor measures and its capability report states.
    measured = [measured_pace(shard) for shard in paced]
    rates = [r["prefill_tok_s"] for _pace, r in measured]
    assert rates[1] < 1 / paces[1] and rates[1] * 3 < min(rates[0], rates[2])
    prompt = np.random.default_rng(3).integers(0, paced[0].vocab_size, LONG_PROMPT).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    async with trio.open_nursery() as nursery:
        entry, hops = await start_chain(nursery, paced)
        pipeline = entry.engine.pipeline
        chain = [
            replace(node.as_hop(), pace=pace)
            for node, (pace, _rates) in zip(hops, measured, strict=True)
        ]
        # The old fixed timeouts: 2 s + 5 ms per token for the prefill, 2 s a decode step.
        fixed_chain, fixed = fixed_timeouts(chain)
        expected = [hop.pace.step_s(LONG_PROMPT, prefill=True) for hop in fixed_chain]
        assert fixed.step_s(expected) == pytest.approx(2 + 0.005 * LONG_PROMPT)
        assert fixed.step_s([hop.pace.step_s(1, prefill=False) for hop in fixed_chain]) == 2.0
        with pytest.raises(PipelineError, match=r"no token within 4\.56 s: hop 1 ") as info:
            await collect(pipeline, fixed_chain, prompt, params, deadlines=fixed)
        assert info.value.failure.suspects == {hops[1].node_id}
        # The deadlines from the measured speed.
        expected = [hop.pace.step_s(LONG_PROMPT, prefill=True) for hop in chain]
        assert DEFAULT_DEADLINES.step_s(expected) > 4 * LONG_PROMPT * paces[1]
        began = trio.current_time()
        got = await collect(pipeline, chain, prompt, params, deadlines=DEFAULT_DEADLINES)
        assert trio.current_time() - began > LONG_PROMPT * paces[1]  # really that slow
        # The same tokens as the same shards without the sleeps.
        _entry, plain = await start_chain(nursery, [shards[span] for span in SPANS])
        plain_chain = [node.as_hop() for node in plain]
        assert got == await collect(pipeline, plain_chain, prompt, params)
        await settle(hops)
        nursery.cancel_scope.cancel()


async def test_a_step_past_its_deadline_moves_to_another_replica_at_once(
    shards: dict[tuple[int, int], ShardBackend], tmp_path: Path, one_thread: None
) -> None:
    """The middle hop got slow after its doctor measured it. The prefill
    runs out of time; the commitments that did arrive say it held the step
    (the first hop reported, it did not), and although membership still sees
    it alive the chat service routes around it to the other replica, without
    waiting and without replaying on the same chain."""
    async with trio.open_nursery() as nursery:
        entry = await start_node(nursery, "entry")
        a = await start_node(nursery, "a", shards[(0, 3)])
        stuck = await start_node(nursery, "b1", PacedShard(shards[(3, 6)], STUCK_S_PER_TOKEN))
        b2 = await start_node(nursery, "b2", shards[(3, 6)])
        c = await start_node(nursery, "c", shards[(6, 8)])
        pipeline = entry.engine.pipeline
        expected = await collect(pipeline, [a.as_hop(), b2.as_hop(), c.as_hop()])
        swarm = Swarm(entry.node)
        for node, decode in ((a, 1000.0), (stuck, 1000.0), (b2, 500.0), (c, 1000.0)):
            swarm.add(node.node, record_of(node, decode=decode))  # b2 measured slower
        chat = chat_service(swarm, pipeline, tmp_path)
        route = first_route(chat)
        assert route.node_ids == (a.node, stuck.node, c.node)
        failures: list[Failure] = []
        slowed: dict[bytes, float] = {}
        state = {"route": route}

        async def on_failure(failure: Failure) -> list[ChainHop] | None:  # as ChatService._failover
            failures.append(failure)
            new_route = await chat._reroute(MODEL, state["route"], failure, slowed)
            if new_route is None:
                return None
            state["route"] = new_route
            return chat._chain(new_route, slowed)

        began = trio.current_time()
        chain = chat._chain(route, slowed)
        got = await collect(pipeline, chain, reroute=on_failure, deadlines=STEADY)
        assert got == expected
        assert trio.current_time() - began < REROUTE_WAIT_S  # membership was not waited for
        (failure,) = failures
        assert failure.suspects == {stuck.node_id}
        assert failure.stall is not None and failure.stall.silent and failure.stall.index == 1
        assert failure.reason.startswith("no token within")
        assert state["route"].node_ids == (a.node, b2.node, c.node)
        assert chat.backoff.avoided(trio.current_time()) == {stuck.node}
        assert slowed == {}
        await settle([a, b2, c])
        nursery.cancel_scope.cancel()


# --- the chat service's decision ----------------------------------------------------------


class Swarm:
    """The swarm as a chat entry reads it (`runtime.inference.chat.ChatSwarm`):
    records and member states as the test sets them, coverage from the
    real builder."""

    def __init__(self, entry: bytes) -> None:
        self.node_id = entry
        self.records: dict[bytes, NodeRecord] = {}
        self.states: dict[bytes, str] = {}

    def add(self, node: bytes, record: NodeRecord) -> None:
        self.records[node] = record
        self.states[node] = "alive"

    def coverage(self) -> Any:
        entries = [(node, self.states[node], record) for node, record in self.records.items()]
        return build_coverage(entries, time.time(), {MODEL: LAYERS})

    def assigned_models(self) -> set[str]:
        return set()

    def stored_models(self) -> set[str]:
        return set()

    def loading_nodes(self, model: str) -> list[str]:
        return []

    def rtts(self) -> dict[bytes, float]:
        return {}

    def record(self, node: bytes) -> NodeRecord | None:
        return self.records.get(node)

    def dial_addresses(self, node: bytes) -> Addresses | None:
        record = self.records.get(node)
        return None if record is None else record.addresses

    def member_state(self, node: bytes) -> str | None:
        return self.states.get(node)

    def member_api(self, node: bytes) -> str | None:
        return None


class Placement:
    """Placement as chat tells it demand (nothing here is placed)."""

    def count_demand(self, model: str, *, unserved: bool) -> None:
        pass

    def why_waiting(self, model: str) -> tuple[str, str]:
        return "no_demand", ""

    def num_layers(self, model: str) -> int | None:
        return LAYERS


def record(
    layers: tuple[int, int],
    data: str = "tcp://127.0.0.1:9",
    *,
    prefill: float = 10_000.0,
    decode: float = 1000.0,
) -> NodeRecord:
    now = time.time()
    capability = CapabilityReport(
        result="admitted",
        model=MODEL,
        manifest_digest=DIGEST,
        layers=layers,
        recipe="fp32",
        backend="torch",
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        validated_at=now - 60,
        expires_at=now + 600,
        num_layers=LAYERS,
    )
    return NodeRecord(
        addresses=Addresses("tcp://127.0.0.1:8", data),
        started_at=0.0,
        backend=BackendInfo("torch", "cpu", 2**30),
        assignment=Assignment(MODEL, layers, "fp32", "operator", False, 1),
        capability=capability,
    )


def record_of(node: Node, *, decode: float) -> NodeRecord:
    spec = node.hop.shard.spec
    return record((spec.start, spec.end), node.address, decode=decode)


def chat_service(swarm: Swarm, pipeline: Pipeline, cache: Path) -> ChatService:
    return ChatService(
        swarm=swarm,
        placement=Placement(),
        leader=lambda: None,
        pipeline=pipeline,
        artifacts=ArtifactStore(cache, lambda digest: None),
    )


def first_route(chat: ChatService) -> Route:
    variant = chat.swarm.coverage().best(MODEL)
    assert variant is not None and variant.complete
    return chat._route(variant, frozenset())


A, B, C = (bytes([i]) * 32 for i in (1, 2, 3))


def single_holder_swarm() -> Swarm:
    """One node per span: no chain avoids any of them."""
    swarm = Swarm(b"\xee" * 32)
    for node, span in zip((A, B, C), SPANS, strict=True):
        swarm.add(node, record(span))
    return swarm


def stalled_at_b(*, silent: bool) -> Failure:
    nodes = frozenset(n.hex() for n in (A, B, C))
    stall = Stall(1, B.hex(), held_s=1.5, expected_s=0.05, silent=silent)
    return Failure(nodes, frozenset({B.hex()}), "no token within 1.2 s", 3, stall)


async def test_a_slow_hop_that_has_no_replica_gets_the_time_it_showed_it_needs(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """It reported the step, late: it is alive and slower than its
    figures. No chain avoids it, so the generation goes on on the same
    chain at once, expecting it as many times slower as it showed; nothing
    is backed off (other requests still need it)."""
    swarm = single_holder_swarm()
    async with bare_plane() as plane:
        chat = chat_service(swarm, Pipeline(plane, drops=Counter()), tmp_path)
        route = first_route(chat)
        slowed: dict[bytes, float] = {}
        began = trio.current_time()
        assert await chat._reroute(MODEL, route, stalled_at_b(silent=False), slowed) == route
        assert trio.current_time() == began
        assert slowed == {B: pytest.approx(30.0)}
        assert chat.backoff.avoided(trio.current_time()) == frozenset()
        before, after = chat._chain(route, {}), chat._chain(route, slowed)
        assert after[1].pace == before[1].pace.slowed(30.0)
        assert [after[0].pace, after[2].pace] == [before[0].pace, before[2].pace]


async def test_a_silent_hop_that_stays_alive_is_waited_for_then_kept(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    swarm = single_holder_swarm()
    async with bare_plane() as plane:
        chat = chat_service(swarm, Pipeline(plane, drops=Counter()), tmp_path)
        route = first_route(chat)
        slowed: dict[bytes, float] = {}
        began = trio.current_time()
        assert await chat._reroute(MODEL, route, stalled_at_b(silent=True), slowed) == route
        assert trio.current_time() - began == pytest.approx(REROUTE_WAIT_S, abs=0.1)
        assert slowed == {B: pytest.approx(30.0)}


async def test_a_silent_hop_that_membership_declares_dead_loses_the_generation(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    swarm = single_holder_swarm()
    async with bare_plane() as plane, trio.open_nursery() as nursery:
        chat = chat_service(swarm, Pipeline(plane, drops=Counter()), tmp_path)
        route = first_route(chat)

        async def kill_b_later() -> None:
            await trio.sleep(1.0)  # a probe round or two
            swarm.states[B] = "suspect"
            await trio.sleep(1.0)  # the suspicion's timeout
            swarm.states[B] = "dead"

        nursery.start_soon(kill_b_later)
        began = trio.current_time()
        slowed: dict[bytes, float] = {}
        assert await chat._reroute(MODEL, route, stalled_at_b(silent=True), slowed) is None
        assert 2.0 <= trio.current_time() - began < 2.5
        assert slowed == {}
        assert chat.backoff.avoided(trio.current_time()) == {B}


async def test_a_suspect_hop_that_comes_back_keeps_the_generation(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A node behind NAT whose relay died: suspected, then back (at its
    other relay) before the suspicion ran out. The chain's other hop stalled
    meanwhile; no chain avoids either, so the generation waits and goes on."""
    swarm = single_holder_swarm()
    swarm.states[C] = "suspect"
    async with bare_plane() as plane, trio.open_nursery() as nursery:
        chat = chat_service(swarm, Pipeline(plane, drops=Counter()), tmp_path)
        route = first_route(chat)

        async def refute_c_later() -> None:
            await trio.sleep(2.0)
            swarm.states[C] = "alive"

        nursery.start_soon(refute_c_later)
        began = trio.current_time()
        slowed: dict[bytes, float] = {}
        assert await chat._reroute(MODEL, route, stalled_at_b(silent=True), slowed) == route
        assert 2.0 <= trio.current_time() - began < 2.5
        assert chat.backoff.avoided(trio.current_time()) == frozenset()


async def test_a_hop_that_failed_to_open_is_not_retried_on_the_same_chain(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    swarm = single_holder_swarm()
    async with bare_plane() as plane:
        chat = chat_service(swarm, Pipeline(plane, drops=Counter()), tmp_path)
        route = first_route(chat)
        nodes = frozenset(n.hex() for n in (A, B, C))
        failure = Failure(nodes, frozenset({B.hex()}), "open timed out", 0)
        began = trio.current_time()
        assert await chat._reroute(MODEL, route, failure, {}) is None
        assert trio.current_time() == began
        assert chat.backoff.avoided(trio.current_time()) == {B}
