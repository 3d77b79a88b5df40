"""The calls into mlx-lm (`runtime.model.backends.mlx_adapter`), on mlx's CPU device.

The adapter is checked against the real mlx and mlx-lm with the shared tiny
models' configs and weights: the ModelArgs it builds (rotary base lifted
from `rope_parameters`) and every setting it refuses rather than approximate;
a whole-model `ShardModel` loaded with the checkpoint's tensors computing
transformers' logits; which parts each shard owns; experts stacked in
order; what is quantized at which bits; and the per-session caches. The
chained-shard parity across recipes is test_mlx_backend.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

from runtime.model import architectures
from runtime.model.backends import mlx_adapter
from runtime.model.backends.base import BackendError
from runtime.model.backends.mlx_adapter import (
    ShardModel,
    cache_offset,
    eval_step,
    model_args,
    module_weights,
    new_layer_caches,
    quantizable_input_dims,
    quantization_predicate,
)
from runtime.model.recipes import QUANT_GROUP_SIZE
from runtime.model.tiny import make_tiny_model
from runtime.model.weights import SINGLE_FILE, read_config

TOKENS = [11, 200, 37, 5, 98]
PARITY_ATOL = 1e-4
"""As test_mlx_backend.py: mlx's fp32 kernels against torch's."""


def config_of(family: str, tmp_path: Path, **changes: Any) -> dict[str, Any]:
    """A tiny `family` model's config as the backend reads it, with `changes`."""
    model = make_tiny_model(tmp_path / family, layers=2, family=family, with_manifest=False)
    return {**read_config(model), **changes}


def local_weights(model_dir: Path) -> dict[str, mx.array]:
    """The checkpoint's tensors under ShardModel's names for layers [0, end)."""
    return {
        name.removeprefix("model."): mx.array(array)
        for name, array in load_file(model_dir / SINGLE_FILE).items()
    }


def test_model_args_lift_the_rotary_base_from_rope_parameters(qwen3_dir: Path) -> None:
    config = read_config(qwen3_dir)
    args = model_args(config)
    assert type(args).__module__ == "mlx_lm.models.qwen3"
    assert args.rope_theta == config["rope_parameters"]["rope_theta"]
    assert args.num_hidden_layers == config["num_hidden_layers"]
    assert args.hidden_size == config["hidden_size"]


def test_settings_mlx_lm_would_compute_otherwise_are_refused(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    qwen3 = read_config(qwen3_dir)
    refused = [
        ({**qwen3, "hidden_act": "gelu"}, "with silu, not 'gelu'"),
        ({**qwen3, "attention_bias": True}, "has no projection biases"),
        (
            {**qwen3, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            "does not run rotary scaling 'longrope'",
        ),
        (
            config_of("gemma2", tmp_path, attn_logit_softcapping=None),
            "always softcaps attention logits",
        ),
        (config_of("phi3", tmp_path, head_dim=8), "derives head_dim from hidden_size"),
    ]
    for config, words in refused:
        with pytest.raises(BackendError, match=words):
            model_args(config)
    # Llama takes its biases; the families' own configs are accepted.
    assert model_args(config_of("llama", tmp_path, attention_bias=True)).attention_bias
    for family in ("gemma2", "gemma3", "phi3", "qwen3_moe"):
        model_args(config_of(family, tmp_path))


def test_every_architecture_the_runtime_knows_has_its_mlx_lm_classes() -> None:
    assert set(mlx_adapter.FAMILIES) == set(architectures.FAMILIES)


def test_gemma3s_layer_kinds_must_be_periodic() -> None:
    full, sliding = "full_attention", "sliding_attention"
    assert mlx_adapter._gemma3_pattern([sliding, sliding, full, sliding, sliding, full]) == 3
    assert mlx_adapter._gemma3_pattern([sliding, sliding]) == 3  # no global layer in range
    with pytest.raises(BackendError, match="needs periodic layer types"):
        mlx_adapter._gemma3_pattern([sliding, full, sliding, sliding, full])


def test_a_whole_model_shard_computes_transformers_logits(qwen3_dir: Path) -> None:
    config = read_config(qwen3_dir)
    model = ShardModel(config, model_args(config), 0, config["num_hidden_layers"])
    model.load_weights(list(module_weights(local_weights(qwen3_dir)).items()), strict=True)
    caches = new_layer_caches(len(model.layers))
    ids = mx.array([TOKENS])
    logits = model(ids, caches)
    eval_step(logits, caches)
    assert cache_offset(caches) == len(TOKENS)
    # One more token on top of the cache: the offset grows by one.
    step = model(mx.array([[3]]), caches)
    eval_step(step, caches)
    assert cache_offset(caches) == len(TOKENS) + 1
    full = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = full(torch.tensor([[*TOKENS, 3]])).logits.numpy()
    assert np.abs(np.array(logits) - reference[:, : len(TOKENS)]).max() < PARITY_ATOL
    assert np.abs(np.array(step) - reference[:, -1:]).max() < PARITY_ATOL


def test_each_shard_owns_its_ends_only(llama_dir: Path) -> None:
    config = read_config(llama_dir)
    args = model_args(config)
    first, middle, last = (ShardModel(config, args, a, b) for a, b in ((0, 3), (3, 6), (6, 8)))
    assert (first.first, first.last, middle.first, middle.last, last.last) == (
        True, False, False, False, True,
    )  # fmt: skip
    assert "embed_tokens" in first and "norm" not in first and "lm_head" not in first
    assert "embed_tokens" not in middle and "norm" not in middle
    assert "embed_tokens" not in last and {"norm", "lm_head"} <= set(last)
    assert [len(s.layers) for s in (first, middle, last)] == [3, 3, 2]
    assert first.kinds == ("full_attention",) * 3


def test_an_moe_layers_experts_are_stacked_in_expert_order() -> None:
    experts = {
        f"layers.0.mlp.experts.{e}.gate_proj.weight": mx.full((2, 3), float(e)) for e in (2, 0, 1)
    }
    weights = module_weights({**experts, "layers.0.mlp.gate.weight": mx.zeros((3, 4))})
    assert set(weights) == {"layers.0.mlp.switch_mlp.gate_proj.weight", "layers.0.mlp.gate.weight"}
    stacked = weights["layers.0.mlp.switch_mlp.gate_proj.weight"]
    assert stacked.shape == (3, 2, 3)
    assert [float(stacked[e, 0, 0]) for e in range(3)] == [0.0, 1.0, 2.0]


def test_linears_are_quantized_the_router_at_8_bits_the_embedding_never(
    qwen3_dir: Path,
) -> None:
    assert quantization_predicate("layers.0.self_attn.q_proj", nn.Linear(4, 4)) is True
    assert quantization_predicate("layers.0.mlp.gate", nn.Linear(4, 4)) == {
        "group_size": QUANT_GROUP_SIZE, "bits": 8, "mode": "affine",
    }  # fmt: skip
    assert quantization_predicate("embed_tokens", nn.Embedding(10, 4)) is False
    assert quantization_predicate("norm", nn.RMSNorm(4)) is False
    config = read_config(qwen3_dir)
    model = ShardModel(config, model_args(config), 0, 8)
    assert quantizable_input_dims(model) == {
        config["hidden_size"],
        config["intermediate_size"],
        config["num_attention_heads"] * config["head_dim"],
    }


def test_the_covered_versions_are_the_installed_ones() -> None:
    """The module says which mlx-lm it is written against; so does the test."""
    from importlib.metadata import version

    assert version("mlx-lm").startswith("0.32.") and version("mlx").startswith("0.32.")
    assert "0.32.x" in (mlx_adapter.__doc__ or "")
