"""The torch backend: shards chained together compute what transformers'
full model computes, in prefill and decode, for both families; recipes stay
within their tolerances; q8/q4 weights are held at 8/4 bits, computed by the
int4 kernel on the same grid as the dequantizing fallback, loaded without
ever holding the fp32 weights, and chain with MLX's; bad input is refused."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from benchmarks.runtime import load_peak, run_in_fresh_process
from runtime.model.backends import ShardSpec, load_shard
from runtime.model.backends.base import BackendError, ShardBackend
from runtime.model.backends.torch_backend import (
    DequantizingLinear,
    Int4KernelLinear,
    load_torch_shard,
    quantize_rows,
)
from runtime.model.manifest import load_golden, load_manifest
from runtime.model.recipes import QUANT_GROUP_SIZE, RECIPES, SUPPORT, check_recipe, relative_error
from runtime.model.tiny import make_tiny_model

SPANS = [(0, 3), (3, 6), (6, 8)]
PROMPT = [1, 57, 203, 9, 330, 41]
DECODE_STEPS = 4
# fp32 parity bound. Chained shards run the very same kernels on the same
# inputs as the full model, so on CPU the difference is exactly 0; 1e-5
# allows for a kernel that splits a reduction differently for shorter
# sequences.
PARITY_ATOL = 1e-5


def _chain(shards: Sequence[ShardBackend], caches: list, ids: list[int], start: int) -> np.ndarray:
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
    # Per weight: 1 byte of code (two 4-bit planes) + a bfloat16 scale and
    # zero per plane per 64 weights = 9/32 of fp32's 4 bytes; q4 half the
    # codes and planes, 9/64. The norms (fp32, 0.3% of the shard) add a hair.
    assert sizes["q8"] / sizes["fp32"] == pytest.approx(9 / 32, abs=0.005)
    assert sizes["q4"] / sizes["fp32"] == pytest.approx(9 / 64, abs=0.005)
    # On the CPU every projection (7 per layer) runs the int4 kernel.
    quantization = load_torch_shard(ShardSpec(qwen3_dir, 0, 8, "q8"), "cpu").info()["quantization"]
    assert quantization == {
        "bits": 8,
        "group_size": QUANT_GROUP_SIZE,
        "embedding_bits": 8,
        "int4_kernel_projections": 7 * 8 + 1,
        "dequantizing_projections": 0,
    }


def test_tied_head_is_held_once(llama_dir: Path) -> None:
    """Under fp recipes a whole tied model's head is its embedding matrix,
    read and held once."""
    info = load_torch_shard(ShardSpec(llama_dir, 0, 8, "fp32"), "cpu").info()
    assert info["weight_bytes"] == info["bytes_read"]


@pytest.mark.parametrize("bits", [8, 4])
def test_affine_grid(bits: int) -> None:
    """Every weight lies within half a step of its group's grid; the codes
    span the grid; a constant group is exact."""
    rows, width = 96, 4 * QUANT_GROUP_SIZE
    weight = torch.randn(rows, width, generator=torch.Generator().manual_seed(bits)) * 0.05
    weight[0, :QUANT_GROUP_SIZE] = 0.25  # a constant group
    grid = quantize_rows(weight, bits)
    groups = grid.codes.reshape(rows, -1, QUANT_GROUP_SIZE).float()
    rebuilt = groups * grid.scale[..., None] + grid.bias[..., None]
    error = (rebuilt - weight.reshape(rows, -1, QUANT_GROUP_SIZE)).abs()
    assert (error <= grid.scale[..., None] * 0.5001).all()
    assert error[0, 0].max() == 0
    assert int(grid.codes.min()) == 0 and int(grid.codes.max()) == (1 << bits) - 1
    assert torch.equal(grid.scale, grid.scale.bfloat16().float())  # the kernel's dtype holds it


@pytest.mark.parametrize("bits", [8, 4])
def test_int4_kernel_computes_the_grid(bits: int) -> None:
    """The CPU kernel and the dequantizing fallback (other devices) compute
    the same weights: they differ by the kernel's bfloat16 input and output
    rounding only. Packing row blocks one at a time, as loading does, gives
    the packing of the whole weight, also with a partial last block."""
    rows, width = 3 * 64 + 16, 3 * QUANT_GROUP_SIZE
    generator = torch.Generator().manual_seed(bits)
    weight = torch.randn(rows, width, generator=generator) * 0.05
    grid = quantize_rows(weight, bits)
    whole = Int4KernelLinear(rows, width, bits)
    whole.fill(0, grid)
    blocks = Int4KernelLinear(rows, width, bits)
    for first in range(0, rows, 64):
        blocks.fill(first, quantize_rows(weight[first : first + 64], bits))
    assert torch.equal(blocks.packed, whole.packed)
    assert torch.equal(blocks.scale_zeros, whole.scale_zeros)

    fallback = DequantizingLinear(rows, width, bits, torch.device("cpu"))
    fallback.fill(0, grid)
    x = torch.randn(2, 5, width, generator=generator)
    expected = fallback(x.bfloat16().float())
    got = whole(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    # One bfloat16 rounding of each output: 2^-8 of its magnitude at most.
    assert ((got - expected).abs() <= expected.abs() * 2**-8 + 1e-6).all()
    assert relative_error(fallback(x).numpy(), (x @ weight.T).numpy()) < (
        0.02 if bits == 8 else 0.3
    )


def test_q8_chain_mixes_torch_and_mlx(qwen3_dir: Path) -> None:
    """q8 hops of either backend quantize alike (affine groups of 64; torch
    rounds the scales to bfloat16, MLX keeps them float32, and MLX keeps
    the embedding exact), so a chain that alternates them stays within
    q8's tolerance of the fp32 golden."""
    manifest = load_manifest(qwen3_dir)
    golden = load_golden(qwen3_dir, manifest)
    ids = np.asarray(manifest["probe"]["token_ids"])
    backends = ("torch", "mlx", "torch")
    shards = [
        load_shard(ShardSpec(qwen3_dir, a, b, "q8"), backend)
        for (a, b), backend in zip(SPANS, backends, strict=True)
    ]
    assert [s.name for s in shards] == list(backends)
    logits = _chain(shards, [s.new_cache() for s in shards], ids.tolist(), 0)
    assert relative_error(logits, golden.logits) <= RECIPES["q8"].tolerance


@pytest.mark.slow  # minutes of CPU: `make test` runs it, `make check` leaves it
@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="peak memory is read from Linux /proc"
)
def test_quantized_loading_never_holds_fp32_weights(tmp_path: Path) -> None:
    """Each weight is quantized block by block as it is read, so a q8/q4
    shard's peak memory while loading is a fraction of an fp32 shard's,
    where quantizing a loaded fp32 shard would peak above it. The weights'
    own bytes are 9/32 and ~1/5 of fp32 (the 8-bit embedding); the rest of
    the bound is the allocator's and the loader's scratch."""
    # Big enough that the fp32 weights (~100 MB) dwarf the allocator's
    # noise, small enough to load in seconds.
    model = make_tiny_model(
        tmp_path / "model",
        layers=2,
        hidden_size=512,
        intermediate_size=2048,
        vocab_size=16384,
        with_manifest=False,
    )
    peaks = {
        r: run_in_fresh_process(load_peak, str(model), 0, 2, r)["peak"]
        for r in ("fp32", "q8", "q4")
    }
    assert peaks["q8"] < 0.5 * peaks["fp32"], peaks
    assert peaks["q4"] < 0.4 * peaks["fp32"], peaks
    # Several load blocks per tensor here, and the shards still agree.
    fp32, q8 = (load_torch_shard(ShardSpec(model, 0, 2, r), "cpu") for r in ("fp32", "q8"))
    ids = np.arange(8) * 997
    logits = [s.forward(ids, np.arange(8), s.new_cache()) for s in (fp32, q8)]
    assert relative_error(logits[1], logits[0]) <= RECIPES["q8"].tolerance


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
