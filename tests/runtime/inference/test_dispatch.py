"""The engine: one reader of the data plane, sorting each message to its side.

Two real planes on loopback: a shardless node's engine, and a peer that
sends it messages and reads what comes back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio

from mesh.chunks import SINGLE_MESSAGE_BYTES
from mesh.identity import Identity
from mesh.transport import Plane, open_planes
from mesh.wire import decode_tensor
from runtime.inference.dispatch import REPLY_MAX_BYTES, Engine
from runtime.inference.protocol import OP_ERROR, encode_message, new_session_id

LOOPBACK = "tcp://127.0.0.1:0"


@asynccontextmanager
async def data_plane(identity: Identity, drops: Counter[str]) -> AsyncIterator[Plane]:
    async with open_planes(LOOPBACK, LOOPBACK, drops=drops, keys=identity.plane_keys()) as (
        _control,
        data,
    ):
        yield data


async def until(condition: Callable[[], bool]) -> None:
    with trio.fail_after(10):
        while not condition():
            await trio.sleep(0.01)


async def test_what_a_shardless_node_drops_and_why() -> None:
    node, peer = Identity.generate(), Identity.generate()
    drops: Counter[str] = Counter()
    async with (
        data_plane(node, drops) as plane,
        data_plane(peer, Counter()) as theirs,
        trio.open_nursery() as nursery,
    ):
        engine = Engine(plane, drops=drops, signer=node)
        await nursery.start(engine.run)
        assert (engine.sessions, engine.hop_stats) == (0, None)
        assert engine.max_message_bytes == REPLY_MAX_BYTES
        # An entry allows nobody big messages: every reply fits one chunk.
        assert REPLY_MAX_BYTES <= SINGLE_MESSAGE_BYTES
        assert engine.bulk_allowance(peer.node_id) == 0
        session = new_session_id()
        messages = [
            [b"not cbor", b""],
            encode_message({"op": "dance", "session": session}),
            encode_message({"op": "token", "session": session, "step": 0}),
            encode_message({"op": "forward", "session": session, "step": 0, "pos": 0}),
        ]
        for frames in messages:
            theirs.send(plane.address, frames, peer=node.node_id)
        await until(lambda: sum(v for k, v in drops.items() if k.startswith("engine.")) >= 4)
        assert drops["engine.unknown_op"] == 1
        assert drops["engine.stale_reply"] == 1, "a reply for no session of this entry"
        assert drops["engine.wrong_shard"] == 1, "a hop op on a node that serves no shard"
        assert sum(v for k, v in drops.items() if k.startswith("engine.")) == 4
        nursery.cancel_scope.cancel()


async def test_an_open_on_a_shardless_node_is_refused_with_an_error() -> None:
    node, entry = Identity.generate(), Identity.generate()
    drops: Counter[str] = Counter()
    async with (
        data_plane(node, drops) as plane,
        data_plane(entry, Counter()) as theirs,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(Engine(plane, drops=drops, signer=node).run)
        session = new_session_id()
        header = {"op": "open", "session": session, "reply": theirs.address}
        theirs.send(plane.address, encode_message(header), peer=node.node_id)
        with trio.fail_after(10):
            sender, frames = await theirs.receive()
        reply = decode_tensor(frames)[0]
        assert sender == node.node_id
        assert (reply["op"], reply["session"]) == (OP_ERROR, session)
        assert reply["reason"].startswith("wrong_shard"), "the entry fails over at once"
        nursery.cancel_scope.cancel()


async def test_an_oversized_message_is_refused_before_it_is_decoded() -> None:
    node = Identity.generate()
    drops: Counter[str] = Counter()
    async with data_plane(node, drops) as plane:
        engine = Engine(plane, drops=drops, signer=node)
        engine.dispatch(b"\x01" * 32, [b"x" * (REPLY_MAX_BYTES + 1)])
        assert drops == Counter({"engine.oversized": 1})


async def test_attach_needs_a_running_engine() -> None:
    node = Identity.generate()
    async with data_plane(node, Counter()) as plane:
        engine = Engine(plane, drops=Counter(), signer=node)
        with pytest.raises(RuntimeError, match="running engine"):
            await engine.attach(object())  # type: ignore[arg-type]
