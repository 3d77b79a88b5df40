"""Chunked prefill at a hop: a long prompt loads in chunks, and the decode batches run between them.

The first test holds the chunk sizer (`ChunkSizer`) to its rule. Then real
engines on loopback: a prompt prefilled in chunks through a three-hop chain
decodes exactly what it decodes in one forward (fp32 greedy), and the
issue's acceptance: a 2,000-token prompt arriving while 8 streams decode
keeps their p99 inter-token time within 3x of before, on a random model
wide enough (384) that its prefill in one forward stalls them for about a
quarter second on the development CPU: 1.5-1.7x measured, and 10x with
chunking off (one chunk as big as the prompt). Last, prompts that arrive
together take turns: a decode batch waits behind one of their forwards,
not one of each.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import aclosing
from functools import partial
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import trio

from benchmarks.pipeline import PacedShard
from runtime.inference.batcher import MIN_CHUNK_TOKENS, PREFILL_CHUNK_TOKENS, ChunkSizer
from runtime.inference.chain import ChainHop, Pipeline
from runtime.inference.hop_server import HopServer
from runtime.model.backends.base import KVCache, ShardBackend
from runtime.model.sampling import SamplingParams
from runtime.model.tiny import make_tiny_model
from tests.runtime.inference.test_engine import (
    MODEL,
    PATIENT,
    SEED,
    SPANS,
    _load,
    collect,
    settle,
    start_chain,
    start_node,
)

WHOLE = (0, SPANS[-1][1])
LONG_PROMPT = 2000
"""The issue's long prompt; the random model's context is 2,048."""
STREAMS = 8
BEFORE_S = 1.0
"""How long the streams' inter-token times are measured before the long
prompt arrives: about 60 batches of 8 on the development CPU."""
STREAM_TOKENS = 1500  # more than the streams ever decode: they are cancelled
WITHIN = 3.0  # the bound on p99 during / p99 before
HUGE = 10**6  # a chunk bigger than any prompt: chunking off
WIDE_LAYERS = 4


def test_a_chunk_takes_about_one_decode_batchs_time_while_sessions_decode() -> None:
    sizer = ChunkSizer()
    # Nobody decoding: the largest chunks, however little is measured.
    assert sizer.next(5000, decoding=False) == PREFILL_CHUNK_TOKENS
    assert sizer.next(100, decoding=False) == 100
    # Decoding, with nothing measured yet: the smallest.
    assert sizer.next(5000, decoding=True) == MIN_CHUNK_TOKENS
    sizer.decoded(0.02)
    sizer.chunked(16, 0.016)  # 1 ms per position
    assert sizer.next(5000, decoding=True) == 20
    sizer.decoded(0.04)  # batches grow: the average follows halfway
    assert sizer.next(5000, decoding=True) == 30
    sizer.chunked(30, 0.3)  # positions cost more as the prompt's attention grows
    assert sizer.next(5000, decoding=True) == MIN_CHUNK_TOKENS
    sizer.chunked(10, 1e-6)
    assert sizer.next(5000, decoding=True) == PREFILL_CHUNK_TOKENS
    assert sizer.next(7, decoding=True) == 7
    with pytest.raises(ValueError):
        sizer.next(0, decoding=True)


async def test_a_prompt_prefilled_in_chunks_decodes_what_one_forward_does(
    qwen3_dir: Path,
) -> None:
    shards = [_load(qwen3_dir, span, "torch") for span in SPANS]
    prompt = tuple(int(t) for t in np.random.default_rng(SEED).integers(0, 300, 61))
    async with trio.open_nursery() as nursery:
        entry, hops = await start_chain(nursery, shards)
        pipeline, chain = entry.engine.pipeline, [node.as_hop() for node in hops]
        params = SamplingParams(temperature=0.0, max_tokens=12)
        for node in hops:
            node.hop.chunks = ChunkSizer(smallest=HUGE, largest=HUGE)
        whole = await collect(pipeline, chain, prompt, params)
        await settle(hops)
        for node in hops:  # 7, 7, ..., 5: every hop's cache grows chunk by chunk
            node.hop.chunks = ChunkSizer(smallest=7, largest=7)
        chunked = await collect(pipeline, chain, prompt, params)
        await settle(hops)
        nursery.cancel_scope.cancel()
    assert chunked == whole and len(set(whole)) > 1
    for node in hops:
        stats = node.hop.stats.to_json()
        assert stats["prefill_steps"] == 2 and stats["prefill_chunks"] == 1 + 9


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model whose prefill costs what a real one's does per
    position, relative to a decode step: 4 layers 384 wide."""
    out = tmp_path_factory.mktemp("wide") / MODEL
    return make_tiny_model(
        out, layers=WIDE_LAYERS, hidden_size=384, intermediate_size=1152, vocab_size=4096,
        with_manifest=False,
    )  # fmt: skip


async def _stream(
    pipeline: Pipeline, chain: Sequence[ChainHop], prompt: list[int], times: list[float]
) -> None:
    """Decode until cancelled, noting when each token arrived."""
    params = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS)
    stream = pipeline.generate(MODEL, chain, prompt, params, seed=SEED, deadlines=PATIENT)
    async with aclosing(stream) as tokens:
        async for _token in tokens:
            times.append(trio.current_time())


def _p99(gaps: Sequence[float], least: int) -> float:
    """The 99th percentile of ``gaps``, of which there are at least ``least``."""
    assert len(gaps) >= least, len(gaps)
    return float(np.quantile(gaps, 0.99))


async def itl_before_and_during(wide: Path, sizer: ChunkSizer) -> tuple[float, float, int]:
    """8 streams decode through one hop; p99 inter-token time over
    `BEFORE_S`, then while a `LONG_PROMPT` prefills; and its chunks."""
    rng = np.random.default_rng(SEED)
    async with trio.open_nursery() as nursery:
        entry, (node,) = await start_chain(nursery, [_load(wide, (0, WIDE_LAYERS), "torch")])
        node.hop.chunks = sizer
        chain = [node.as_hop()]
        # A hop gives one entry at most half its sessions: the prompt comes from another.
        other = await start_node(nursery, "entry2")
        times: list[list[float]] = [[] for _ in range(STREAMS)]
        async with trio.open_nursery() as streams:
            for mine in times:
                prompt = rng.integers(0, 4096, 8).tolist()
                streams.start_soon(_stream, entry.engine.pipeline, chain, prompt, mine)
            await trio.sleep(0.3)  # every stream decoding
            began = trio.current_time()
            await trio.sleep(BEFORE_S)
            arrives = trio.current_time()
            long = rng.integers(0, 4096, LONG_PROMPT).tolist()
            params = SamplingParams(temperature=0.0, max_tokens=1)
            await collect(other.engine.pipeline, chain, long, params, deadlines=PATIENT)
            done = trio.current_time()
            await trio.sleep(0.3)  # the stalled steps' tokens arrive
            streams.cancel_scope.cancel()
        chunks = node.hop.stats.prefill_chunks
        nursery.cancel_scope.cancel()
    pairs = [(a, b) for one in times for a, b in pairwise(one)]
    before = [b - a for a, b in pairs if began <= a and b <= arrives]
    # Every gap that overlaps the prompt's prefill: a stalled stream has one, the stall.
    during = [b - a for a, b in pairs if b >= arrives and a <= done]
    return _p99(before, 100), _p99(during, STREAMS), chunks


ATTEMPTS = 2
"""Tries of the timing test below before it fails."""


async def test_a_long_prompt_arriving_keeps_the_decoding_streams_p99_within_3x(
    wide_dir: Path,
) -> None:
    """Measured twice at most: on a shared 2-core machine another process's
    stall inside the short "during" window can outweigh the prefill itself
    (seen once in a dozen runs beside a benchmark); chunking off fails both
    tries by far (10x, see the module docstring)."""
    ratios = []
    for _ in range(ATTEMPTS):
        before, during, chunks = await itl_before_and_during(wide_dir, ChunkSizer())
        print(f"p99 inter-token time: {before * 1e3:.1f} ms before, {during * 1e3:.1f} ms during")
        assert chunks > LONG_PROMPT // PREFILL_CHUNK_TOKENS
        ratios.append(during / before)
        if ratios[-1] <= WITHIN:
            break
    assert min(ratios) <= WITHIN, ratios


class TurnWatch(PacedShard):
    """A shard that notes what the hop runs, in order: ``B`` a decode
    batch, ``P`` a prefill forward (or chunk) begun while decode steps
    waited for the shard, ``p`` one begun while none did (the batch had
    just taken them)."""

    def __init__(self, shard: ShardBackend) -> None:
        super().__init__(shard, 0.0)
        self.hop: HopServer | None = None
        self.log: list[str] = []

    def forward(self, inputs: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        if len(positions) > 1:
            waiting = self.hop is not None and len(self.hop._decodes) > 0
            self.log.append("P" if waiting else "p")
        return super().forward(inputs, positions, cache)

    def forward_batch(
        self, steps: Sequence[tuple[np.ndarray, np.ndarray, KVCache]]
    ) -> list[np.ndarray]:
        self.log.append("B")
        return super().forward_batch(steps)


PROMPTS_AT_ONCE = 6
PROMPT_TOKENS = 96


async def test_prompts_arriving_together_take_turns_between_the_decode_batches(
    wide_dir: Path,
) -> None:
    """Six prompts arrive at once while four streams decode. The shard's
    limiter serves in order of arrival, so if each prompt queued there on
    its own, six of their forwards would run between two decode batches
    (and a stream's step would wait for all six: 34 s at the p99 through
    three MLX hops at 16 streams); with one prefill turn, one."""
    rng = np.random.default_rng(SEED)
    shard = TurnWatch(_load(wide_dir, (0, WIDE_LAYERS), "torch"))
    async with trio.open_nursery() as nursery:
        entry, (node,) = await start_chain(nursery, [shard])
        shard.hop = node.hop
        chain = [node.as_hop()]
        other = await start_node(nursery, "entry2")  # a hop gives one entry half its sessions
        async with trio.open_nursery() as streams:
            for _ in range(4):
                prompt = rng.integers(0, 4096, 8).tolist()
                streams.start_soon(_stream, entry.engine.pipeline, chain, prompt, [])
            await trio.sleep(0.3)  # every stream decoding
            params = SamplingParams(temperature=0.0, max_tokens=1)
            async with trio.open_nursery() as prompts:
                for _ in range(PROMPTS_AT_ONCE):
                    long = rng.integers(0, 4096, PROMPT_TOKENS).tolist()
                    prompts.start_soon(
                        partial(collect, deadlines=PATIENT),
                        other.engine.pipeline,
                        chain,
                        long,
                        params,
                    )
            streams.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    # Between two decode batches (the streams decode throughout): the
    # prompts' forwards that ran, begun while steps waited (P) or not (p).
    log = "".join(shard.log)
    between = [len(run) for run in log.strip("Pp").split("B")[1:-1]]
    assert sum(between) >= PROMPTS_AT_ONCE, log  # the prompts loaded while streams decoded
    assert max(between) <= 2, log
