"""The batching benchmark's pieces (`benchmarks.batching`): the prompts'
spread of lengths, and one measurement on the tiny model per backend (the
full run, on its bigger model, takes a minute and is not a test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.batching import CONTEXT_SPREAD, Sessions, measure, prompt_lengths
from runtime.model.backends import ShardSpec, load_shard


def test_prompts_spread_around_the_context() -> None:
    lengths = prompt_lengths(16, 128)
    assert len(lengths) == 16 and lengths == sorted(lengths)
    assert lengths[0] == round(128 * (1 - CONTEXT_SPREAD))
    assert lengths[-1] == round(128 * (1 + CONTEXT_SPREAD))
    assert len(set(lengths)) == 16  # every row its own length
    assert prompt_lengths(3, 2) == [1, 2, 3]


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_measurement_steps_every_session(qwen3_dir: Path, backend: str) -> None:
    shard = load_shard(ShardSpec(qwen3_dir, 0, 8, "fp32"), backend)
    lengths = prompt_lengths(3, 4)
    figures = measure(shard, lengths)
    assert figures["alone_step_ms"] > 0 and figures["batched_step_ms"] > 0
    assert figures["batched_vs_alone"] > 0 and figures["gather_ms"] > 0
    sessions = Sessions(shard, lengths)
    sessions.batched()
    assert sessions.positions == [n + 1 for n in lengths]
