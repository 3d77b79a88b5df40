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

import pytest
import trio

from mesh.identity import Identity
from mesh.transport import Plane, open_planes
from mesh.wire import decode_tensor
from runtime.inference.dispatch import Engine
from runtime.inference.hop_server import HopServer
from runtime.inference.protocol import (
    OP_BUSY,
    OP_ERROR,
    OP_OPENED,
    encode_message,
    new_session_id,
    sampling_header,
)
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
        setup.entry_plane.send(
            setup.hop_plane.address,
            encode_message({"op": "close", "session": session}),
            peer=setup.hop_plane.keys.node_id,
        )
        with trio.fail_after(10):
            while setup.hop.sessions:
                await trio.sleep(0.01)


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
