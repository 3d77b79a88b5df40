"""Continuous batching at a hop: decode steps that wait for a busy shard run as one forward.

The first section holds the batch-forming core (`DecodeQueue`, `BatchStats`)
to its rules. The rest runs real shards of the tiny model behind real
engines on loopback (`tests.runtime.inference.test_engine`'s nodes):
several generations at once through one hop, on torch and MLX, and through
a three-hop chain, decode exactly what each decodes alone, and the hops'
counters show the batches they ran; a lone generation never goes through
the batcher; a generation that ends while its step is inside a batch
leaves the others' tokens untouched. The shards are slowed a little
(`PacedShard`: the real forward, then a sleep) so that steps overlap on a
loaded box too.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from benchmarks.pipeline import PacedShard
from runtime.inference.batcher import MAX_BATCH_ROWS, BatchStats, DecodeQueue
from runtime.inference.chain import ChainHop, Pipeline
from runtime.model.backends.base import KVCache, ShardBackend
from runtime.model.sampling import SamplingParams
from tests.runtime.inference.test_engine import (
    MODEL,
    PATIENT,
    SEED,
    SPANS,
    _load,
    collect,
    settle,
    start_chain,
)

WHOLE = (0, SPANS[-1][1])
# Different lengths, so the rows of a batch sit at different positions.
PROMPTS = ((5, 40, 99, 250, 7, 12, 301), (17, 3, 260, 88), (9,), (300, 2, 71, 18, 44), (61, 62))
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
PACE_S = 0.002
"""Per position of each forward: a tiny model's step takes ~1 ms, and the
sleep holds the shard long enough that other sessions' steps arrive while
it is busy, as they do on a real model, even on a loaded box."""
GATE_S = 10.0  # the most a held batch waits for the test (a failed one)


# --- the batch-forming core -----------------------------------------------------------


def test_a_batch_takes_each_sessions_oldest_step_oldest_first_up_to_the_limit() -> None:
    queue: DecodeQueue[str, str] = DecodeQueue()
    for at, (session, step) in enumerate([("a", "a0"), ("b", "b0"), ("a", "a1"), ("c", "c0")]):
        queue.add(session, step, float(at))
    steps, waits = queue.take(2, now=10.0)
    assert (steps, waits) == (["a0", "b0"], [10.0, 9.0])
    # a1 waited before c0, and a0 has left: a's next step goes first now.
    steps, waits = queue.take(MAX_BATCH_ROWS, now=10.0)
    assert (steps, waits) == (["a1", "c0"], [8.0, 7.0])
    assert len(queue) == 0 and queue.take(1, now=11.0) == ([], [])
    with pytest.raises(ValueError):
        queue.take(0, now=11.0)


def test_a_step_whose_session_left_is_never_taken() -> None:
    queue: DecodeQueue[str, list[int]] = DecodeQueue()
    left, stays = [1], [2]
    queue.add("a", left, 0.0)
    queue.add("b", stays, 0.0)
    assert queue.discard(left) and not queue.discard(left)
    assert queue.take(MAX_BATCH_ROWS, now=1.0)[0] == [stays]


def test_the_batch_counters() -> None:
    stats = BatchStats()
    stats.count([0.001])
    stats.count([0.002, 0.0, 0.004])
    report = stats.to_json()
    assert (report["batches"], report["rows"], report["largest"]) == (2, 4, 3)
    assert report["mean_rows"] == 2.0 and report["sizes"] == {"1": 1, "3": 1}
    assert report["wait_s"]["count"] == 4
    assert report["wait_s"]["sum"] == pytest.approx(0.007)


# --- through hops ---------------------------------------------------------------------


async def generate_all(
    pipeline: Pipeline, chain: list[ChainHop], prompts: Sequence[tuple[int, ...]]
) -> dict[tuple[int, ...], list[int]]:
    """Every prompt's greedy tokens, all generated at once."""
    out: dict[tuple[int, ...], list[int]] = {}

    async def one(prompt: tuple[int, ...]) -> None:
        out[prompt] = await collect(pipeline, chain, prompt, GREEDY)

    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, prompt)
    return out


async def alone_then_together(shards: Sequence[ShardBackend]) -> list[dict[str, Any]]:
    """Each prompt generated alone, one after another, then all at once:
    the same tokens both ways; the hops' batch counters after each."""
    async with trio.open_nursery() as nursery:
        entry, hops = await start_chain(nursery, shards)
        pipeline, chain = entry.engine.pipeline, [node.as_hop() for node in hops]
        alone = {p: await collect(pipeline, chain, p, GREEDY) for p in PROMPTS}
        await settle(hops)
        assert all(node.hop.stats.batching.batches == 0 for node in hops)  # none waited
        together = await generate_all(pipeline, chain, PROMPTS)
        assert together == alone
        assert len({tuple(tokens) for tokens in alone.values()}) == len(PROMPTS)
        await settle(hops)
        nursery.cancel_scope.cancel()
    return [node.hop.stats.to_json() for node in hops]


@pytest.mark.parametrize("backend", ["torch", "mlx"])
async def test_generations_at_once_through_a_hop_batch_and_decode_what_they_do_alone(
    qwen3_dir: Path, backend: str
) -> None:
    shard = PacedShard(_load(qwen3_dir, WHOLE, backend), PACE_S)
    (stats,) = await alone_then_together([shard])
    batching = stats["batching"]
    assert batching["largest"] > 1 and batching["rows"] > batching["batches"]
    # A batch's compute is counted once, its steps one each (a one-token
    # prompt's prefill is a one-token step too).
    steps = sum(NEW_TOKENS - 1 + (len(prompt) == 1) for prompt in PROMPTS)
    assert stats["decode_steps"] == 2 * steps
    assert stats["step_s"]["decode"]["count"] < stats["decode_steps"]


async def test_generations_at_once_batch_at_every_hop_of_a_chain(qwen3_dir: Path) -> None:
    shards = [PacedShard(_load(qwen3_dir, span, "torch"), PACE_S) for span in SPANS]
    for stats in await alone_then_together(shards):
        assert stats["batching"]["largest"] > 1


class GatedShard(PacedShard):
    """A paced shard whose batched forwards, once armed, stop after
    computing until the test opens the gate: a batch held mid-flight."""

    def __init__(self, shard: ShardBackend) -> None:
        super().__init__(shard, PACE_S)
        self.armed = False
        self.held: list[KVCache] = []  # the caches of the batch at the gate
        self.holding = threading.Event()
        self.gate = threading.Event()

    def forward_batch(
        self, steps: Sequence[tuple[np.ndarray, np.ndarray, KVCache]]
    ) -> list[np.ndarray]:
        outputs = super().forward_batch(steps)
        if self.armed and len(steps) > 1:
            self.armed = False
            self.held = [cache for _, _, cache in steps]
            self.holding.set()
            self.gate.wait(GATE_S)
        return outputs


async def test_a_generation_that_ends_mid_batch_leaves_the_others_untouched(
    qwen3_dir: Path,
) -> None:
    shard = GatedShard(_load(qwen3_dir, WHOLE, "torch"))
    async with trio.open_nursery() as nursery:
        entry, (node,) = await start_chain(nursery, [shard])
        pipeline, chain = entry.engine.pipeline, [node.as_hop()]
        alone = {p: await collect(pipeline, chain, p, GREEDY) for p in PROMPTS}
        await settle([node])
        got: dict[tuple[int, ...], list[int]] = {p: [] for p in PROMPTS}
        scopes = {p: trio.CancelScope() for p in PROMPTS}

        async def run(prompt: tuple[int, ...]) -> None:
            # Patient: the others' steps wait at the gate too.
            stream = pipeline.generate(MODEL, chain, prompt, GREEDY, seed=SEED, deadlines=PATIENT)
            with scopes[prompt]:
                async with aclosing(stream) as tokens:
                    async for token in tokens:
                        got[prompt].append(token)
                        if len(got[prompt]) == 3:
                            shard.armed = True

        async with trio.open_nursery() as runs:
            for prompt in PROMPTS:
                runs.start_soon(run, prompt)
            with trio.fail_after(10):
                while not shard.holding.is_set():
                    await trio.sleep(0.005)
            # One of the batch's sessions ends while its step is computed:
            # the entry closes it on the hop, which drops it mid-batch.
            sessions = {id(s.cache): s for s in node.hop._sessions.values()}
            leaving = sessions[id(shard.held[0])]
            # Its step continues its prompt and the tokens sampled so far.
            prompt = next(p for p in PROMPTS if len(p) == leaving.next_pos - len(leaving.generated))
            scopes[prompt].cancel()
            with trio.fail_after(5):
                while leaving.id in node.hop._sessions:
                    await trio.sleep(0.005)
            shard.gate.set()
        for other in PROMPTS:
            want = alone[other]
            assert got[other] == (want[: len(got[other])] if other == prompt else want)
        assert len(got[prompt]) < NEW_TOKENS
        await settle([node])
        assert not any(reason.startswith("engine.") for reason in node.drops)
        nursery.cancel_scope.cancel()
