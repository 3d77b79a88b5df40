"""A prefill bigger than one chunk still crosses between hops (issue 30, item 3).

The data plane takes frames of one chunk at most and reassembles a bigger
message only from a peer the receiving hop takes forwards from
(`mesh.chunks`, `HopServer.bulk_allowance`). A long prompt's activations
between two hops are such a message: through two hops over real planes the
greedy tokens are those of one hop holding the whole model, and a stranger
sending the same bytes to the second hop is refused chunk by chunk.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

import numpy as np
import pytest
import trio

from mesh.chunks import SINGLE_MESSAGE_BYTES
from mesh.identity import Identity
from mesh.transport import Plane, open_planes
from runtime.inference.chain import ChainHop
from runtime.inference.deadlines import Deadlines
from runtime.inference.dispatch import Engine
from runtime.inference.hop_server import HopServer
from runtime.model.backends import load_shard
from runtime.model.backends.base import ShardBackend, ShardSpec
from runtime.model.sampling import SamplingParams
from runtime.model.tiny import make_tiny_model

MODEL = "tiny-wide"
HIDDEN = 256
PROMPT = [(7 * i) % 300 + 1 for i in range(1200)]
"""1,200 positions x 256 x 4 bytes: 1.2 MiB of activations, over one chunk."""
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
LOOPBACK = "tcp://127.0.0.1:0"
WAIT_S = 30.0


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], ShardBackend]:
    folder = make_tiny_model(
        tmp_path_factory.mktemp("wide") / MODEL, layers=2, hidden_size=HIDDEN, with_manifest=False
    )
    spans = ((0, 2), (0, 1), (1, 2))
    return {span: load_shard(ShardSpec(folder, *span, "fp32"), "torch") for span in spans}


@asynccontextmanager
async def node(shard: ShardBackend | None) -> AsyncIterator[tuple[Engine, Counter[str]]]:
    """A node's data plane and engine (a hop server when it holds ``shard``)."""
    identity = Identity.generate()
    drops: Counter[str] = Counter()
    async with (
        open_planes(LOOPBACK, LOOPBACK, drops=drops, keys=identity.plane_keys()) as (_, data),
        trio.open_nursery() as nursery,
    ):
        hop = None
        if shard is not None:
            hop = HopServer(data, shard, model=MODEL, drops=drops, signer=identity)
        engine = Engine(data, drops=drops, signer=identity, hop_server=hop)
        await nursery.start(engine.run)
        yield engine, drops
        nursery.cancel_scope.cancel()


def as_hop(engine: Engine) -> ChainHop:
    assert engine.hop_server is not None
    spec = engine.hop_server.shard.spec
    return ChainHop(engine.plane.keys.node_id.hex(), engine.plane.address, (spec.start, spec.end))


async def generate(entry: Engine, chain: list[ChainHop]) -> list[int]:
    stream = entry.pipeline.generate(MODEL, chain, PROMPT, GREEDY, seed=1, deadlines=Deadlines())
    with trio.fail_after(WAIT_S):
        async with aclosing(stream) as tokens:
            return [token async for token in tokens]


async def test_a_prefill_over_one_chunk_reaches_the_next_hop_whole(
    shards: dict[tuple[int, int], ShardBackend],
) -> None:
    assert len(PROMPT) * HIDDEN * 4 > SINGLE_MESSAGE_BYTES
    async with (
        node(None) as (entry, _),
        node(shards[(0, 2)]) as (whole, _),
        node(shards[(0, 1)]) as (first, first_drops),
        node(shards[(1, 2)]) as (second, second_drops),
    ):
        expected = await generate(entry, [as_hop(whole)])
        assert len(expected) == GREEDY.max_tokens
        assert await generate(entry, [as_hop(first), as_hop(second)]) == expected
        # The activations crossed as chunks (no single frame of theirs fits).
        assert second.plane.received_bytes > len(PROMPT) * HIDDEN * 4
        assert not [k for k in (*first_drops, *second_drops) if k.startswith("data.")]

        await stranger_is_refused(second.plane, second_drops)


async def stranger_is_refused(hop: Plane, drops: Counter[str]) -> None:
    """The same bytes from a node no session of ``hop`` takes forwards from."""
    async with open_planes(
        LOOPBACK, LOOPBACK, drops=Counter(), keys=Identity.generate().plane_keys()
    ) as (_, stranger):
        activations = np.zeros((len(PROMPT), HIDDEN), np.float32)
        stranger.send(hop.address, [b"header", activations.data], peer=hop.keys.node_id)
        with trio.fail_after(WAIT_S):
            while drops["data.bulk_refused"] < 3:  # the header's piece, then two
                await trio.sleep(0.01)
