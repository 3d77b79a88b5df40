"""The hop server's sessions: what an `open` must say, who is turned away, and why.

One real whole-model shard (the tiny Qwen3, torch on CPU) behind a real
engine on loopback, and an entry's plane that opens sessions on it. Chains
that generate are in tests/runtime/inference/test_engine.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from mesh.identity import Identity
from mesh.transport import Plane, open_planes
from mesh.wire import decode_tensor
from runtime.inference.dispatch import Engine
from runtime.inference.hop_server import HopServer
from runtime.inference.kv_memory import REASON_MEMORY, KvMemory
from runtime.inference.protocol import (
    OP_BUSY,
    OP_ERROR,
    OP_OPENED,
    OP_TOKEN,
    encode_message,
    new_session_id,
    sampling_header,
)
from runtime.inference.session_policy import PENDING_GRACE_S
from runtime.model.backends import load_shard
from runtime.model.backends.base import ShardBackend, ShardSpec
from runtime.model.sampling import SamplingParams

MODEL = "tiny-qwen3"
LOOPBACK = "tcp://127.0.0.1:0"


@pytest.fixture(scope="module")
def whole(qwen3_dir: Path) -> ShardBackend:
    return load_shard(ShardSpec(qwen3_dir, 0, 8, "fp32"), "torch")


@dataclass
class Setup:
    hop: HopServer
    hop_plane: Plane
    entry: Identity
    entry_plane: Plane
    drops: Counter[str]

    def open_header(self, session: str, **changed: Any) -> dict[str, Any]:
        header = {
            "op": "open",
            "session": session,
            "model": MODEL,
            "layers": [0, 8],
            "reply": self.entry_plane.address,
            "budget": 64,
            "prev": self.entry.node_id.hex(),
            "next": None,
            "next_node": None,
            "next_session": None,
            "sampling": sampling_header(SamplingParams()),
            "seed": 1,
            "sketch_seed": 2,
            "check": None,
        }
        header.update(changed)
        return header

    async def ask(self, header: dict[str, Any]) -> dict[str, Any]:
        """Send `header` to the hop; its reply's header."""
        message = encode_message(header)
        self.entry_plane.send(self.hop_plane.address, message, peer=self.hop_plane.keys.node_id)
        with trio.fail_after(10):
            _, frames = await self.entry_plane.receive()
        return decode_tensor(frames)[0]


@asynccontextmanager
async def serving(shard: ShardBackend, **limits: Any) -> AsyncIterator[Setup]:
    node, entry = Identity.generate(), Identity.generate()
    drops: Counter[str] = Counter()
    async with (
        open_planes(LOOPBACK, LOOPBACK, drops=drops, keys=node.plane_keys()) as (_, plane),
        open_planes(LOOPBACK, LOOPBACK, drops=Counter(), keys=entry.plane_keys()) as (_, theirs),
        trio.open_nursery() as nursery,
    ):
        hop = HopServer(plane, shard, model=MODEL, drops=drops, signer=node, **limits)
        await nursery.start(Engine(plane, drops=drops, signer=node, hop_server=hop).run)
        yield Setup(hop, plane, entry, theirs, drops)
        nursery.cancel_scope.cancel()


async def test_an_open_for_this_shard_is_opened_and_closed(whole: ShardBackend) -> None:
    async with serving(whole) as setup:
        session = new_session_id()
        reply = await setup.ask(setup.open_header(session))
        assert (reply["op"], reply["session"]) == (OP_OPENED, session)
        assert setup.hop.sessions == 1
        await close(setup, session)


async def close(setup: Setup, session: str) -> None:
    """The entry closes `session`; returns once the hop holds no session."""
    setup.entry_plane.send(
        setup.hop_plane.address,
        encode_message({"op": "close", "session": session}),
        peer=setup.hop_plane.keys.node_id,
    )
    with trio.fail_after(10):
        while setup.hop.sessions:
            await trio.sleep(0.01)


async def test_only_the_node_a_session_takes_forwards_from_may_send_big_messages(
    whole: ShardBackend,
) -> None:
    async with serving(whole) as setup:
        entry, stranger = setup.entry.node_id, Identity.generate().node_id
        assert setup.hop.bulk_allowance(entry) == 0  # no session yet: one chunk at most
        session = new_session_id()
        assert (await setup.ask(setup.open_header(session)))["op"] == OP_OPENED
        assert setup.hop.bulk_allowance(entry) == setup.hop.max_message_bytes
        assert setup.hop.bulk_allowance(stranger) == 0
        await close(setup, session)
        assert setup.hop.bulk_allowance(entry) == 0


@pytest.mark.parametrize(
    ("changed", "reason"),
    [
        ({"model": "another"}, "wrong_shard"),
        ({"layers": [0, 4]}, "wrong_shard"),
        ({"budget": 0}, "budget_exceeded"),
        ({"prev": "cd" * 32}, "bad_field"),
        ({"next": "tcp://127.0.0.1:1"}, "bad_field"),
        ({"sampling": None}, "bad_field"),
    ],
)
async def test_an_open_that_does_not_fit_is_refused_with_why(
    whole: ShardBackend, changed: dict[str, Any], reason: str
) -> None:
    async with serving(whole) as setup:
        session = new_session_id()
        reply = await setup.ask(setup.open_header(session, **changed))
        assert (reply["op"], reply["session"]) == (OP_ERROR, session)
        assert reply["reason"].startswith(reason), reply
        assert setup.drops[f"engine.{reason}"] == 1 and setup.hop.sessions == 0


async def test_a_leaving_or_full_hop_turns_newcomers_away_as_busy(whole: ShardBackend) -> None:
    async with serving(whole, max_sessions=2) as setup:
        first = await setup.ask(setup.open_header(new_session_id()))
        assert first["op"] == OP_OPENED
        share = await setup.ask(setup.open_header(new_session_id()))
        assert share["op"] == OP_BUSY and "share" in share["reason"], "one peer, not every slot"
        setup.hop.leaving = True
        leaving = await setup.ask(setup.open_header(new_session_id()))
        assert leaving["op"] == OP_BUSY and "leaving" in leaving["reason"]
        assert setup.drops["engine.busy"] == 2


async def test_a_session_whose_cache_would_not_fit_is_busy_until_memory_frees(
    whole: ShardBackend,
) -> None:
    """Room for one 64-position budget: a second open is refused `memory`
    before anything is computed; once the first closes, it fits."""
    room = KvMemory(capacity_bytes=100 * 1_000, bytes_per_position=1_000)
    async with serving(whole, kv_memory=room) as setup:
        first = new_session_id()
        assert (await setup.ask(setup.open_header(first)))["op"] == OP_OPENED
        refused = await setup.ask(setup.open_header(new_session_id()))
        assert (refused["op"], refused["reason"]) == (OP_BUSY, REASON_MEMORY)
        assert setup.drops["engine.busy_memory"] == 1 and setup.hop.sessions == 1
        assert setup.hop.stats.to_json()["kv_memory"]["held_bytes"] == 64 * 1_000
        await close(setup, first)
        assert setup.hop.stats.to_json()["kv_memory"]["held_bytes"] == 0
        assert (await setup.ask(setup.open_header(new_session_id())))["op"] == OP_OPENED


# --- squatters ----------------------------------------------------------------------


def from_source(hop: str, source_ip: str) -> str:
    """The hop's endpoint, connected to from ``source_ip`` (ZeroMQ's
    ``tcp://SRC:0;DST:PORT``): every 127.x.y.z is this machine's loopback."""
    return hop.replace("tcp://", f"tcp://{source_ip}:0;", 1)


def plain_open(plane: Plane, session: str) -> list[Any]:
    header = {
        "op": "open",
        "session": session,
        "model": MODEL,
        "layers": [0, 8],
        "reply": plane.address,
        "budget": 64,
        "prev": plane.keys.node_id.hex(),
        "sampling": sampling_header(SamplingParams()),
        "seed": 1,
        "sketch_seed": 2,
    }
    return encode_message(header)


async def reply_to(plane: Plane, session: str, ops: set[str]) -> dict[str, Any]:
    """The next reply about ``session`` whose op is one of ``ops``."""
    while True:
        header = decode_tensor((await plane.receive()).frames)[0]
        if header.get("session") == session and header.get("op") in ops:
            return header


async def squat(plane: Plane, to: str, hop: bytes) -> None:
    """Open sessions and never forward; take a refused or displaced slot
    back at once, for as long as the test lasts."""
    while True:
        session = new_session_id()
        plane.send(to, plain_open(plane, session), peer=hop)
        answer = await reply_to(plane, session, {OP_OPENED, OP_BUSY})
        if answer["op"] == OP_BUSY:
            await trio.sleep(0.02)


async def chat(plane: Plane, to: str, hop: bytes) -> None:
    """What an honest entry does: open, prefill, take the token, close."""
    session = new_session_id()
    plane.send(to, plain_open(plane, session), peer=hop)
    answer = await reply_to(plane, session, {OP_OPENED, OP_BUSY, OP_ERROR})
    assert answer["op"] == OP_OPENED, answer
    prompt = np.array([1, 2, 3, 4], np.int64)
    plane.send(
        to,
        encode_message({"op": "forward", "session": session, "step": 0, "pos": 0}, prompt),
        peer=hop,
    )
    answer = await reply_to(plane, session, {OP_TOKEN, OP_BUSY, OP_ERROR})
    assert answer["op"] == OP_TOKEN, answer
    plane.send(to, encode_message({"op": "close", "session": session}), peer=hop)


async def test_strangers_from_four_networks_cannot_squat_every_slot(whole: ShardBackend) -> None:
    """Four fresh keys from four /24s open every slot and never forward
    (the squat measured on issue 30). A returning member is served at once,
    a newcomer as soon as the squatters' grace is over; each within 2 s."""
    planes = [
        open_planes(LOOPBACK, LOOPBACK, drops=Counter(), keys=Identity.generate().plane_keys())
        for _ in range(5)
    ]
    async with (
        serving(whole) as setup,
        planes[0] as (_, s1),
        planes[1] as (_, s2),
        planes[2] as (_, s3),
        planes[3] as (_, s4),
        planes[4] as (_, newcomer),
        trio.open_nursery() as attack,
    ):
        hop, node = setup.hop, setup.hop_plane.keys.node_id
        address = setup.hop_plane.address
        await chat(setup.entry_plane, address, node)  # a member: it completed a session here
        for n, squatter in enumerate([s1, s2, s3, s4], 1):
            attack.start_soon(squat, squatter, from_source(address, f"127.0.{n}.9"), node)
        with trio.fail_after(10):
            while hop.sessions < hop.max_sessions:
                await trio.sleep(0.01)
        squatted = trio.current_time()
        with trio.fail_after(2):
            await chat(setup.entry_plane, address, node)
        await trio.sleep_until(squatted + PENDING_GRACE_S)
        with trio.fail_after(2):
            await chat(newcomer, from_source(address, "127.0.9.9"), node)
        # Each squatter was placed in its own network, from its source address.
        networks = {s.holder.prefix for s in hop._sessions.values()}
        assert len(networks & {f"127.0.{n}.0/24" for n in range(1, 5)}) >= 2, networks
        assert setup.drops["engine.displaced"] >= 2
        attack.cancel_scope.cancel()
