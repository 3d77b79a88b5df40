"""The torch backend: shards chained together compute what transformers'
full model computes, in prefill and decode, for both families; recipes stay
within their tolerances; bad input is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from runtime.model.backends import ShardSpec, load_shard
from runtime.model.backends.base import BackendError
from runtime.model.backends.torch_backend import TorchShard, load_torch_shard
from runtime.model.manifest import load_golden, load_manifest
from runtime.model.recipes import RECIPES, SUPPORT, check_recipe, relative_error

pytest_plugins = ["tests.runtime_fixtures"]

SPANS = [(0, 3), (3, 6), (6, 8)]
PROMPT = [1, 57, 203, 9, 330, 41]
DECODE_STEPS = 4
# fp32 parity bound. Chained shards run the very same kernels on the same
# inputs as the full model, so on CPU the difference is exactly 0; 1e-5
# allows for a kernel that splits a reduction differently for shorter
# sequences.
PARITY_ATOL = 1e-5


def _chain(shards: list[TorchShard], caches: list, ids: list[int], start: int) -> np.ndarray:
    hidden: np.ndarray = np.asarray(ids, dtype=np.int64)
    positions = np.arange(start, start + len(ids), dtype=np.int64)
    for shard, cache in zip(shards, caches, strict=True):
        hidden = shard.forward(hidden, positions, cache)
    return hidden


def test_chained_shards_match_full_model(model_dir: Path) -> None:
    full = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    shards = [load_torch_shard(ShardSpec(model_dir, a, b, "fp32"), "cpu") for a, b in SPANS]
    caches = [s.new_cache() for s in shards]
    full_cache = DynamicCache()

    with torch.no_grad():
        ref = full(torch.tensor([PROMPT]), cache=full_cache, use_cache=True).logits[0].numpy()
    got = _chain(shards, caches, PROMPT, 0)
    assert got.shape == (len(PROMPT), full.config.vocab_size)
    np.testing.assert_allclose(got, ref, rtol=0, atol=PARITY_ATOL)

    position = len(PROMPT)
    token = int(got[-1].argmax())
    for _ in range(DECODE_STEPS):
        with torch.no_grad():
            ref = full(torch.tensor([[token]]), cache=full_cache, use_cache=True).logits[0].numpy()
        got = _chain(shards, caches, [token], position)
        np.testing.assert_allclose(got, ref, rtol=0, atol=PARITY_ATOL)
        assert int(got[-1].argmax()) == int(ref[-1].argmax())
        token = int(got[-1].argmax())
        position += 1


def test_caches_are_per_session(qwen3_dir: Path) -> None:
    shard = load_torch_shard(ShardSpec(qwen3_dir, 0, 8, "fp32"), "cpu")
    a, b = shard.new_cache(), shard.new_cache()
    first = shard.forward(np.asarray(PROMPT), np.arange(len(PROMPT)), a)
    shard.forward(np.asarray([3, 4]), np.arange(2), b)  # another session in between
    again = shard.forward(np.asarray(PROMPT), np.arange(len(PROMPT)), shard.new_cache())
    np.testing.assert_array_equal(first, again)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipes_within_tolerance(model_dir: Path, recipe: str) -> None:
    manifest = load_manifest(model_dir)
    golden = load_golden(model_dir, manifest)
    ids = np.asarray(manifest["probe"]["token_ids"])
    positions = np.arange(len(ids))
    tolerance = RECIPES[recipe].tolerance
    for start, end in [*SPANS, (0, 8)]:
        shard = load_torch_shard(ShardSpec(model_dir, start, end, recipe), "cpu")
        inputs = ids if start == 0 else golden.boundaries[start]
        out = shard.forward(inputs, positions, shard.new_cache())
        expected = golden.logits if end == 8 else golden.boundaries[end]
        error = relative_error(out, expected)
        assert error <= tolerance, (recipe, start, end, error)
        if start == 3:
            # The shard fed the previous layer's activations (one layer too
            # few upstream) must fail: the bound tells right from wrong. On
            # the tiny model q4's own noise is of the same order as one
            # layer's contribution, so q4 can only be held to "worse".
            wrong = relative_error(
                shard.forward(golden.boundaries[2], positions, shard.new_cache()), expected
            )
            assert wrong > (error if recipe == "q4" else tolerance), (recipe, wrong)


def test_recipes_store_less(qwen3_dir: Path) -> None:
    sizes = {
        r: load_torch_shard(ShardSpec(qwen3_dir, 3, 6, r), "cpu").info()["weight_bytes"]
        for r in RECIPES
    }
    assert sizes["bf16"] == sizes["fp16"] == sizes["fp32"] // 2
    assert sizes["q8"] < sizes["fp32"] * 0.3  # 1 byte per weight + per-group scale and bias
    assert sizes["q4"] < sizes["q8"] * 0.6


def test_check_recipe() -> None:
    assert check_recipe("torch", "q4", "cuda:1").bits == 4
    assert set(SUPPORT) == {"torch", "mlx"}
    with pytest.raises(BackendError, match="unknown recipe 'int3'; choose one of fp32"):
        check_recipe("torch", "int3", "cpu")
    with pytest.raises(BackendError, match="does not run on device 'xla:0'"):
        check_recipe("torch", "fp32", "xla:0")
    with pytest.raises(BackendError, match="unknown backend"):
        check_recipe("onnx", "fp32", "cpu")


def test_bad_forward_inputs(qwen3_dir: Path) -> None:
    first = load_torch_shard(ShardSpec(qwen3_dir, 0, 2, "fp32"), "cpu")
    middle = load_torch_shard(ShardSpec(qwen3_dir, 2, 4, "fp32"), "cpu")
    cache = first.new_cache()
    with pytest.raises(BackendError, match="continue the cache at 0"):
        first.forward(np.asarray([1, 2]), np.asarray([5, 6]), cache)
    with pytest.raises(BackendError, match="token id out of range"):
        first.forward(np.asarray([1, 10**6]), np.arange(2), cache)
    with pytest.raises(BackendError, match="int token ids"):
        first.forward(np.zeros((2, 64), np.float32), np.arange(2), cache)
    with pytest.raises(BackendError, match=r"hidden states \[T, 64\]"):
        middle.forward(np.asarray([1, 2]), np.arange(2), middle.new_cache())
    with pytest.raises(BackendError, match="not made by this torch shard"):
        middle.forward(np.zeros((2, 64), np.float32), np.arange(2), object())
    with pytest.raises(BackendError, match="only the last shard"):
        middle.head(np.zeros((2, 64), np.float32))


def test_load_shard_picks_torch_here(qwen3_dir: Path) -> None:
    shard = load_shard(ShardSpec(qwen3_dir, 6, 8, "bf16"))
    info = shard.info()
    assert (shard.name, shard.device) == ("torch", "cpu") or shard.name == "mlx"
    assert shard.is_last and not shard.is_first
    assert info["layers"] == [6, 8] and info["recipe"] == "bf16"
