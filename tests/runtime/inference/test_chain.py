"""The entry side's rules that need no hops: chains, limits, timing, the next chain.

Generations through real hops (failover, replays, closing) are in
tests/runtime/inference/test_engine.py and test_slow_hops.py.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any, cast

import pytest

from runtime.inference.chain import (
    ChainHop,
    ChainTiming,
    Failure,
    Pipeline,
    PipelineError,
    _check_chain,
    _next_chain,
    _token_limit,
)
from runtime.model.sampling import SamplingParams

A, B = "a" * 64, "b" * 64
CHAIN = [ChainHop(A, "tcp://127.0.0.1:1", (0, 4)), ChainHop(B, "tcp://127.0.0.1:2", (4, 8))]
FAILURE = Failure(frozenset({A, B}), frozenset({B}), "error: boom", 3)


def test_a_chain_tiles_contiguous_layers_from_zero() -> None:
    _check_chain(CHAIN)
    assert CHAIN[0].node == bytes.fromhex(A)
    with pytest.raises(ValueError, match="at least one hop"):
        _check_chain([])
    with pytest.raises(ValueError, match="contiguous from 0"):
        _check_chain([ChainHop(A, "x", (1, 4))])
    with pytest.raises(ValueError, match="contiguous from 0"):
        _check_chain([ChainHop(A, "x", (0, 4)), ChainHop(B, "y", (5, 8))])
    with pytest.raises(ValueError, match="contiguous from 0"):
        _check_chain([ChainHop(A, "x", (0, 0))])
    with pytest.raises(ValueError, match="not a node id"):
        _check_chain([ChainHop("A" * 64, "x", (0, 4))])


def test_the_token_limit_is_max_tokens_capped_by_the_window() -> None:
    assert _token_limit(10, 5, None) == 5
    assert _token_limit(10, 5, 100) == 5
    assert _token_limit(10, 500, 100) == 90
    assert _token_limit(10, None, 100) == 90, "no max_tokens: fill the window"
    with pytest.raises(ValueError, match="fills the context window"):
        _token_limit(100, 5, 100)
    with pytest.raises(ValueError, match="need max_tokens or a context window"):
        _token_limit(10, None, None)


async def test_generate_refuses_what_it_cannot_bound_before_sending_anything() -> None:
    plane = cast(Any, SimpleNamespace(address="tcp://127.0.0.1:9"))  # never sent to
    pipeline = Pipeline(plane, drops=Counter())
    params = SamplingParams(max_tokens=None)
    with pytest.raises(ValueError, match="at least one token"):
        await pipeline.generate("m", CHAIN, [], SamplingParams(), seed=1).__anext__()
    with pytest.raises(ValueError, match="need max_tokens"):
        await pipeline.generate("m", CHAIN, [1], params, seed=1).__anext__()
    with pytest.raises(ValueError, match="contiguous"):
        await pipeline.generate("m", CHAIN[1:], [1], SamplingParams(), seed=1).__anext__()


def test_timing_follows_the_chain_that_produced_the_last_token() -> None:
    timing = ChainTiming()
    timing.restart(CHAIN)
    timing.add_prefill([100, 200], tokens=7, wall_s=0.5)
    timing.add([10, 20])
    timing.add([10, 20])
    timing.add([5])  # a hop that did not report: nothing attributed
    assert (timing.prefill_us, timing.prefill_tokens, timing.prefill_wall_s) == ([100, 200], 7, 0.5)
    assert (timing.decode_us, timing.decode_steps) == ([20, 40], 2)
    timing.restart(CHAIN[:1])  # a failover: the new chain starts afresh
    assert (timing.nodes, timing.decode_us, timing.decode_steps) == ([A], [0], 0)


async def test_the_next_chain_is_the_reroutes_or_an_error() -> None:
    async def elsewhere(failure: Failure) -> list[ChainHop]:
        assert failure is FAILURE
        return [ChainHop(A, "tcp://127.0.0.1:3", (0, 8))]

    async def give_up(failure: Failure) -> None:
        return None

    async def broken(failure: Failure) -> list[ChainHop]:
        return [ChainHop(A, "tcp://127.0.0.1:3", (2, 8))]

    assert [hop.layers for hop in await _next_chain(FAILURE, elsewhere)] == [(0, 8)]
    for reroute in (None, give_up):
        with pytest.raises(PipelineError, match="step 3 failed: error: boom") as caught:
            await _next_chain(FAILURE, reroute)
        assert caught.value.failure is FAILURE
    with pytest.raises(ValueError, match="contiguous"):
        await _next_chain(FAILURE, broken)
