"""The runtime benchmark's pieces (`benchmarks.runtime`): the spans the
recipe figures load, how rates are taken from timed runs, and what the JSON
says about the model measured. Loading peaks in a fresh process are used
by tests/runtime/model/backends/test_torch_backend.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from benchmarks.runtime import SPAN_PARTS, describe_model, rates_of, recipe_spans
from runtime.model.weights import SafetensorsReader


def test_recipe_spans_are_the_whole_model_then_its_parts() -> None:
    assert SPAN_PARTS == 3
    assert recipe_spans(30) == [(0, 30), (0, 10), (10, 20), (20, 30)]
    assert recipe_spans(8) == [(0, 8), (0, 3), (3, 5), (5, 8)]


def test_rates_take_the_best_run_and_the_last_runs_tokens() -> None:
    runs = [([1, 2, 3], 0.5, 2.0), ([1, 2, 4], 0.25, 4.0), ([1, 2, 5], 1.0, 1.0)]
    rates = rates_of(runs, prompt_len=10, steps=5)
    assert rates == {"prefill_tok_s": 40.0, "decode_tok_s": 4.0, "tokens": [1, 2, 5]}


def test_the_model_measured_is_described(qwen3_dir: Path) -> None:
    described = describe_model(qwen3_dir, generated=False)
    assert described["path"] == str(qwen3_dir)
    assert described["architecture"] == "Qwen3ForCausalLM"
    assert described["layers"] == 8 and described["manifest"] is True
    assert described["tensor_bytes"] == SafetensorsReader(qwen3_dir).total_bytes
    assert describe_model(qwen3_dir, generated=True)["path"] is None


@pytest.mark.parametrize("layers", [3, 4, 30])
def test_the_parts_tile_the_model(layers: int) -> None:
    parts = recipe_spans(layers)[1:]
    assert parts[0][0] == 0 and parts[-1][1] == layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
