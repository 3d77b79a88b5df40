"""The MLX backend computes what transformers computes.

Parity is the property that makes a swarm of shards one model: layers
[0,3), [3,6), [6,8) of an 8-layer tiny model, chained on MLX with one KV
cache per shard, must give the full transformers model's logits (fp32) through
a prefill, a second multi-token chunk on top of the cache, and single-token
decode steps; MLX and torch shards must agree and mix in one chain; every
recipe must stay within the tolerance the doctor admits it with. Both model
families, with and without tied embeddings, since each changes which tensors
a shard owns.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

from runtime.model.backends import load_shard
from runtime.model.backends.base import BackendError, ShardBackend, ShardSpec
from runtime.model.backends.mlx_backend import MlxShard, load_mlx_shard
from runtime.model.backends.torch_backend import load_torch_shard
from runtime.model.manifest import probe_token_ids
from runtime.model.recipes import RECIPES, SUPPORT, relative_error
from runtime.model.tiny import make_tiny_model
from runtime.model.weights import SafetensorsReader

LAYERS = 8
SPANS = ((0, 3), (3, 6), (6, 8))
# A 5-token prefill, a 2-token chunk on top of the cache (causal mask with an
# offset), then three single-token decode steps.
STEPS = ((0, 5), (5, 7), (7, 8), (8, 9), (9, 10))
TOKENS = np.array([11, 200, 37, 5, 98, 143, 7, 64, 250, 3], dtype=np.int64)
# fp32 parity bound (absolute, on logits of magnitude ~5-70); measured <= 1.6e-5.
PARITY_ATOL = 1e-4
MLX_DEVICE = mx.default_device().type.name
# (family, tied embeddings, safetensors files): both families, both head
# layouts, and the index-sharded checkpoint layout once.
MODELS = [("qwen3", False, 1), ("qwen3", True, 1), ("llama", False, 1), ("llama", True, 2)]


@pytest.fixture(
    scope="session",
    params=MODELS,
    ids=[f"{f}-{'tied' if t else 'untied'}-{n}file" for f, t, n in MODELS],
)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, tied, files = request.param
    return make_tiny_model(
        tmp_path_factory.mktemp(family),
        layers=LAYERS,
        family=family,
        tie_embeddings=tied,
        shards=files,
        with_manifest=False,
    )


@pytest.fixture(scope="session")
def hf_model(model_dir: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_forward(
    model: transformers.PreTrainedModel, ids: Sequence[int]
) -> tuple[list[np.ndarray], np.ndarray]:
    """transformers' full model, no cache: hidden states at every layer
    boundary below the final norm (index i = input of layer i), and logits."""
    with torch.no_grad():
        out = model(torch.tensor([list(ids)]), output_hidden_states=True)
    boundaries = [h[0].numpy() for h in out.hidden_states[:LAYERS]]
    return boundaries, out.logits[0].numpy()


@pytest.fixture(scope="session")
def reference(hf_model: transformers.PreTrainedModel) -> tuple[list[np.ndarray], np.ndarray]:
    return hf_forward(hf_model, TOKENS.tolist())


def load_chain(
    model_dir: Path, recipe: str = "fp32", backends: Sequence[str] = ("mlx",) * 3
) -> list[ShardBackend]:
    loaders = {"mlx": load_mlx_shard, "torch": load_torch_shard}
    return [
        loaders[b](ShardSpec(model_dir, a, e, recipe))
        for b, (a, e) in zip(backends, SPANS, strict=True)
    ]


def run_chain(shards: Sequence[ShardBackend]) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """Feed TOKENS through the chain in STEPS with one cache per shard, as a
    session does; returns each shard boundary's hidden states and the logits,
    concatenated over the steps."""
    caches = [shard.new_cache() for shard in shards]
    boundaries: dict[int, list[np.ndarray]] = {shard.spec.end: [] for shard in shards[:-1]}
    logits = []
    for lo, hi in STEPS:
        x: np.ndarray = TOKENS[lo:hi]
        for shard, cache in zip(shards, caches, strict=True):
            x = shard.forward(x, np.arange(lo, hi), cache)
            if not shard.is_last:
                boundaries[shard.spec.end].append(x)
        logits.append(x)
    return {b: np.concatenate(xs) for b, xs in boundaries.items()}, np.concatenate(logits)


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape
    return float(np.abs(a.astype(np.float64) - b).max())


def test_mlx_chain_matches_transformers(
    model_dir: Path,
    reference: tuple[list[np.ndarray], np.ndarray],
    record_property: pytest.RecordProperty,
) -> None:
    golden_boundaries, golden_logits = reference
    shards = load_chain(model_dir)
    boundaries, logits = run_chain(shards)
    errors = {f"boundary {b}": max_abs(h, golden_boundaries[b]) for b, h in boundaries.items()}
    errors["logits"] = max_abs(logits, golden_logits)
    record_property("max_abs_error", errors)
    assert max(errors.values()) < PARITY_ATOL, errors
    # A second session on the same shards starts from its own empty caches.
    assert np.array_equal(run_chain(shards)[1], logits)


def test_whole_model_as_one_shard(
    model_dir: Path, reference: tuple[list[np.ndarray], np.ndarray]
) -> None:
    shard = load_mlx_shard(ShardSpec(model_dir, 0, LAYERS, "fp32"))
    assert shard.is_first and shard.is_last
    logits = shard.forward(TOKENS, np.arange(len(TOKENS)), shard.new_cache())
    assert max_abs(logits, reference[1]) < PARITY_ATOL


def test_mlx_and_torch_agree_and_mix(
    model_dir: Path, reference: tuple[list[np.ndarray], np.ndarray]
) -> None:
    _, mlx_logits = run_chain(load_chain(model_dir))
    _, torch_logits = run_chain(load_chain(model_dir, backends=("torch",) * 3))
    assert max_abs(mlx_logits, torch_logits) < PARITY_ATOL
    # Activations cross backends as float32 NumPy, so a chain may mix them.
    _, mixed_logits = run_chain(load_chain(model_dir, backends=("torch", "mlx", "torch")))
    assert max_abs(mixed_logits, reference[1]) < PARITY_ATOL


@pytest.mark.parametrize("recipe", sorted(SUPPORT["mlx"][MLX_DEVICE]))
def test_recipe_within_doctor_tolerance(
    model_dir: Path,
    hf_model: transformers.PreTrainedModel,
    recipe: str,
    record_property: pytest.RecordProperty,
) -> None:
    """What the doctor checks: each span run from the fp32 golden input at
    its first boundary on the manifest probe, compared with the golden
    output at its last boundary (logits on the last shard)."""
    ids = probe_token_ids(hf_model.config.vocab_size)
    golden_boundaries, golden_logits = hf_forward(hf_model, ids)
    positions = np.arange(len(ids))
    errors = {}
    for start, end in (*SPANS, (0, LAYERS)):
        shard = load_mlx_shard(ShardSpec(model_dir, start, end, recipe))
        inputs = np.array(ids) if start == 0 else golden_boundaries[start]
        golden = golden_logits if end == LAYERS else golden_boundaries[end]
        errors[f"{start}:{end}"] = relative_error(
            shard.forward(inputs, positions, shard.new_cache()), golden
        )
    record_property("relative_error", errors)
    assert max(errors.values()) <= RECIPES[recipe].tolerance, errors


@pytest.mark.parametrize("recipe,bits", [("q8", 8), ("q4", 4)])
def test_quantized_shards_are_smaller(model_dir: Path, recipe: str, bits: int) -> None:
    full = load_mlx_shard(ShardSpec(model_dir, 3, 6, "fp32"))
    quantized = load_mlx_shard(ShardSpec(model_dir, 3, 6, recipe))
    assert quantized.info()["quantization"] == {"bits": bits, "group_size": 64}
    # Weights at `bits` plus an fp32 scale and bias per 64 weights.
    assert quantized.weight_bytes < full.weight_bytes * (bits + 2 * 32 / 64) / 32 + 4096


def test_unknown_recipe_is_refused(model_dir: Path) -> None:
    with pytest.raises(BackendError, match="unknown recipe 'q2'"):
        load_mlx_shard(ShardSpec(model_dir, 0, 3, "q2"))


@pytest.mark.parametrize("span", [(6, 9), (3, 3), (-1, 2), (8, 8)])
def test_layer_span_out_of_range(model_dir: Path, span: tuple[int, int]) -> None:
    with pytest.raises(BackendError, match=r"layer span .* model's 8 layers"):
        load_mlx_shard(ShardSpec(model_dir, *span, "fp32"))


def test_bad_steps_are_refused(model_dir: Path) -> None:
    first, middle = (load_mlx_shard(ShardSpec(model_dir, a, b, "fp32")) for a, b in SPANS[:2])
    cache = first.new_cache()
    with pytest.raises(BackendError, match="positions must continue the cache"):
        first.forward(TOKENS[:3], np.arange(1, 4), cache)
    first.forward(TOKENS[:3], np.arange(3), cache)
    with pytest.raises(BackendError, match=r"positions must continue the cache \(3\.\.3\)"):
        first.forward(TOKENS[3:4], np.array([0]), cache)
    with pytest.raises(BackendError, match="token ids must lie in"):
        first.forward(np.array([first.vocab_size]), np.array([3]), cache)
    with pytest.raises(BackendError, match="hidden states"):
        middle.forward(TOKENS[:3], np.arange(3), middle.new_cache())
    with pytest.raises(BackendError, match="foreign cache"):
        middle.forward(np.zeros((1, middle.hidden_size), np.float32), np.arange(1), object())


def test_info_is_json_ready_and_reads_only_the_shard(model_dir: Path) -> None:
    shard = load_shard(ShardSpec(model_dir, 3, 6, "bf16"), backend="mlx")
    assert isinstance(shard, MlxShard)
    info = json.loads(json.dumps(shard.info()))
    assert info["backend"] == "mlx" and info["device"] == MLX_DEVICE
    assert info["layers"] == [3, 6] and info["dtype"] == "bfloat16"
    assert info["versions"]["mlx-lm"].startswith("0.")
    # A middle shard of 3 of 8 layers reads 3/8 of the layer weights and no
    # embedding or head.
    total = SafetensorsReader(model_dir).total_bytes
    assert 0 < info["bytes_read"] < total * 3 / 8
    assert info["weight_bytes"] == info["bytes_read"] // 2  # fp32 on disk, bf16 held


def test_missing_mlx_is_reported(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlx_lm", None)  # what `import mlx_lm` sees when absent
    with pytest.raises(BackendError, match=r"backend mlx is not installed: pip install"):
        load_mlx_shard(ShardSpec(model_dir, 0, 3, "fp32"))


def test_llama_rope_theta_nested_in_rope_parameters(tmp_path: Path) -> None:
    """transformers 5 writes rope_theta only inside `rope_parameters`, which
    mlx-lm's llama args ignore (falling back to 10000); a non-default theta
    proves the adapter passes the real one."""
    model_dir = make_tiny_model(
        tmp_path / "llama", layers=LAYERS, family="llama", with_manifest=False
    )
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_parameters"]["rope_theta"] = 1_000_000.0
    config_path.write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _, golden_logits = hf_forward(model, TOKENS.tolist())
    _, logits = run_chain(load_chain(model_dir))
    assert max_abs(logits, golden_logits) < PARITY_ATOL
